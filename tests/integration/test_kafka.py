"""Kafka → PostgreSQL on real services: positions in the database, no-op replays, dead letters on
a DLQ topic, and single-flight across workers."""

from __future__ import annotations

import asyncio
import json
import time

from etl import Classify, KafkaSource, Pipeline
from etl.runtime.wiring import build_runner
from etl.settings import Settings
from etl.testing import FakeLLM, ListSource
from tests.helpers import counts, end_offsets, produce, read_all, rows

LABELS = ["billing", "technical", "other"]


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
