"""Kafka → PostgreSQL on real services: positions in the database, no-op replays, dead letters on
a DLQ topic, and single-flight across workers; every test with both clients (kafka-python, the
default, and confluent-kafka)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from etl import Classify, KafkaSource, Pipeline
from etl.runtime.wiring import build_runner, with_client
from etl.settings import Settings
from etl.testing import FakeLLM, ListSource
from tests.helpers import counts, end_offsets, produce, read_all, rows

LABELS = ["billing", "technical", "other"]


@pytest.fixture(autouse=True, params=["kafka-python", "confluent"])
def kafka_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """ETL_KAFKA_CLIENT for the runs of this module (and the workers they start)."""
    monkeypatch.setenv("ETL_KAFKA_CLIENT", request.param)
    return str(request.param)


def messages(n: int, hot: int = 0) -> list[tuple[bytes | None, bytes]]:
    """``n`` tickets over two tenants; every ``hot``-th one repeats one hot text."""
    out = []
    for i in range(n):
        text = "my invoice is wrong" if hot and i % hot == 0 else f"ticket {i} about thing {i * 7 % 13}"
        out.append((f"k{i}".encode(), json.dumps({"id": f"m{i}", "tenant": ["acme", "globex"][i % 2], "text": text}).encode()))
    return out


def kafka_pipeline(topic: str, url: str, **source: object) -> Pipeline:
    src = KafkaSource(topic, **source) if source else KafkaSource(topic, group=f"{topic}-etl")  # type: ignore[arg-type]
    return Pipeline("tickets", src, [Classify(LABELS, "Route the ticket.", name="route")], store=url)


async def run(p: Pipeline, llm: FakeLLM, bootstrap: str, idle: float | None = 3.0, **settings: object) -> object:
    runner = build_runner(p, Settings(kafka_bootstrap=bootstrap, kafka_session_timeout_ms=6000, **settings),
                          llm=llm, idle_stop_s=idle)
    return await runner.run()


async def test_run_then_replay_from_zero_is_a_no_op(kafka_bootstrap: str, topic: str, postgres_url: str) -> None:
    sent = messages(400, hot=5)
    sent.insert(77, (b"bad", b"{not json"))
    produce(kafka_bootstrap, topic, sent)
    llm = FakeLLM(latency_s=0.005)
    stats = await run(kafka_pipeline(topic, postgres_url), llm, kafka_bootstrap)
    assert stats.messages == 401 and stats.dead_letters == 1  # type: ignore[attr-defined]
    unique = {(json.loads(v)["tenant"], json.loads(v)["text"]) for _, v in sent if v != b"{not json"}
    assert len(llm.calls) == len(unique)
    ends = end_offsets(kafka_bootstrap, topic)
    stored = dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions"))
    assert stored == ends  # positions in the database equal the end offsets
    before = counts(postgres_url)
    assert before["stage_results"] == 400 and before["dead_letters"] == 1
    dlq_before = len(read_all(kafka_bootstrap, f"{topic}.dlq"))
    assert dlq_before == 1

    replay = FakeLLM()
    stats = await run(kafka_pipeline(topic, postgres_url, replay_from="start"), replay, kafka_bootstrap, idle=None)
    assert stats.messages == 401  # type: ignore[attr-defined]
    assert replay.calls == [] and counts(postgres_url) == before
    assert len(read_all(kafka_bootstrap, f"{topic}.dlq")) == dlq_before  # not republished


async def test_a_batch_member_reads_to_the_end_it_found_and_a_replay_from_a_time_reads_what_came_after(
        kafka_bootstrap: str, topic: str, postgres_url: str) -> None:
    from datetime import datetime, timezone

    produce(kafka_bootstrap, topic, messages(200))
    llm = FakeLLM()
    stats = await run(kafka_pipeline(topic, postgres_url, group=f"{topic}-batch", until_end=True), llm,
                      kafka_bootstrap, idle=None)  # stops by itself: until_end
    assert stats.messages == 200 and len(llm.calls) == 200  # type: ignore[attr-defined]
    time.sleep(1.0)
    cut = datetime.now(timezone.utc)
    time.sleep(1.0)
    later = [(f"n{i}".encode(), json.dumps({"id": f"n{i}", "text": f"new ticket {i}"}).encode()) for i in range(60)]
    produce(kafka_bootstrap, topic, later)
    stats = await run(kafka_pipeline(topic, postgres_url, group=f"{topic}-batch", until_end=True), llm,
                      kafka_bootstrap, idle=None)  # from the stored positions to the new end
    assert stats.messages == 60 and len(llm.calls) == 260  # type: ignore[attr-defined]
    replay = FakeLLM()
    stats = await run(kafka_pipeline(topic, postgres_url, replay_from=cut), replay, kafka_bootstrap, idle=None)
    assert stats.messages == 60 and replay.calls == []  # type: ignore[attr-defined]  # only what came after; stored
    assert dict(rows(postgres_url, "SELECT partition, next_offset FROM source_positions")) == end_offsets(
        kafka_bootstrap, topic)


async def test_malformed_message_goes_to_dlq_and_the_next_is_processed(
        kafka_bootstrap: str, topic: str, postgres_url: str) -> None:
    produce(kafka_bootstrap, topic, [(b"x", b"\xff\xfe\x00garbage"), (b"y", b'{"id": "ok", "text": "after the bad one"}')],
            partitions=1)
    stats = await run(kafka_pipeline(topic, postgres_url), FakeLLM(), kafka_bootstrap)
    assert stats.results_written == 1  # type: ignore[attr-defined]
    assert rows(postgres_url, "SELECT doc_key FROM stage_results") == [("ok",)]
    letter = rows(postgres_url, "SELECT reason, detail, payload, partition, message_offset FROM dead_letters")
    assert letter[0][:2] == ("bad_input", "not valid UTF-8 at byte 0") and bytes(letter[0][2]) == b"\xff\xfe\x00garbage"
    (record,) = read_all(kafka_bootstrap, f"{topic}.dlq")
    headers = dict(record.headers)
    assert record.value == b"\xff\xfe\x00garbage" and headers["reason"] == b"bad_input"
    assert json.loads(headers["source"]) == {"stream": topic, "partition": 0, "offset": 0}


async def test_two_workers_share_one_call_for_a_hot_duplicate(postgres_url: str) -> None:
    """Two runners (each with its own model client and its own in-process single-flight) fed the
    same content at the same time: the store's claims make it one call in total."""
    hot = "the app crashes when I pay"
    llms = [FakeLLM(latency_s=0.5), FakeLLM(latency_s=0.5)]

    def worker(i: int, llm: FakeLLM) -> object:
        docs = [{"id": f"w{i}-{j}", "tenant": "acme", "text": hot} for j in range(5)]
        p = Pipeline("hot", ListSource(docs, name=f"list-{i}"), [Classify(LABELS, "Route.")], store=postgres_url)
        return build_runner(p, Settings(), llm=llm).run()

    await asyncio.gather(*(worker(i, llm) for i, llm in enumerate(llms)))
    assert sum(len(llm.calls) for llm in llms) == 1
    assert counts(postgres_url)["stage_results"] == 10
    assert rows(postgres_url, "SELECT count(*) FROM llm_calls WHERE outcome = 'ok'") == [(1,)]
    assert rows(postgres_url, "SELECT count(*) FROM llm_claims") == [(0,)]  # released on commit


async def test_a_crashed_claimers_lease_expires(postgres_url: str) -> None:
    from connectors.store import SqlStore
    from dedup import cache_key
    from etl.runtime.execute import StagePlan

    llm = FakeLLM()
    p = Pipeline("lease", ListSource([{"id": "1", "text": "stuck?"}]), [Classify(LABELS, "Route.")], store=postgres_url)
    store = SqlStore(postgres_url)
    store.prepare([])
    doc = p.decoder.decode(next(iter(p.source.poll(1, 0) or [])), "json")  # type: ignore[arg-type]
    p.source = ListSource([{"id": "1", "text": "stuck?"}])
    key = cache_key("default", StagePlan.of(p.stages[0], llm).fingerprint, doc.content_hash)
    assert store.claim(key, "a-worker-that-died", lease_s=1.5)
    started = time.perf_counter()
    await build_runner(p, Settings(), llm=llm).run()
    assert len(llm.calls) == 1 and time.perf_counter() - started >= 1.0


class _Ledger:
    """A ledger with no stored positions: every partition is read from its beginning."""

    def __init__(self) -> None:
        self.revoked_keys: list[tuple[str, int]] = []

    def stored_position(self, stream: str, partition: int) -> int | None:
        return None

    def revoked(self, partitions: list[tuple[str, int]]) -> None:
        self.revoked_keys.extend(partitions)


def test_a_full_member_loses_no_message_of_a_partition_assigned_while_it_was_paused(
        kafka_bootstrap: str, topic: str, kafka_client: str) -> None:
    """The runner full: the source pauses its partitions and polls only to stay in the group. A
    rebalance hands it partitions while paused (another member joins and leaves); their records
    must come back from poll, never be fetched and dropped (the offset tracker only sees what poll
    returns: a dropped record would be committed past, and lost)."""
    produce(kafka_bootstrap, topic, messages(400))
    config = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500}
    full = KafkaSource(topic, group=f"{topic}-g", bootstrap=kafka_bootstrap, consumer_config=config,
                       client=kafka_client)
    full = with_client(full, Settings())
    full.keepalive_s = 0.0  # every full poll is a keep-alive poll
    seen: dict[int, set[int]] = {}

    def take(batch: list | None) -> None:
        for m in batch or []:
            seen.setdefault(m.partition, set()).add(m.offset)

    full.open(_Ledger())
    try:
        deadline = time.monotonic() + 60
        while not full.reading():  # joined (a member full from the start never joins: polls with room do)
            assert time.monotonic() < deadline, "never assigned"
            take(full.poll(1, 0.2))
        take(full.poll(0, 0.2))  # full from here on: paused
        other = KafkaSource(topic, group=f"{topic}-g", bootstrap=kafka_bootstrap, consumer_config=config,
                            client=kafka_client)
        other = with_client(other, Settings())
        other.open(_Ledger())
        try:
            deadline = time.monotonic() + 60
            while not other.reading():  # the rebalance: the partitions split between the two
                assert time.monotonic() < deadline, "the second member was never assigned"
                other.poll(1, 0.1)  # what it reads is read again by the full member after it leaves
                take(full.poll(0, 0.1))
        finally:
            other.close()  # it leaves: its partitions come back to the full member, unpaused
        for _ in range(100):  # still full: keep-alive polls only, for about 10 s
            take(full.poll(0, 0.0))
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while sum(map(len, seen.values())) < 400 and time.monotonic() < deadline:
            take(full.poll(500, 0.5))  # room again
    finally:
        full.close()
    ends = end_offsets(kafka_bootstrap, topic)
    assert {p: len(o) for p, o in seen.items()} == ends and all(o == set(range(ends[p])) for p, o in seen.items())
