"""Poison messages through the real CLI, on real Kafka and real PostgreSQL: one message can never
stop a run (DESIGN invariant 7).

Each poison sits between good messages in its partition: JSON the decoder parses but the store
cannot hold (lone surrogates, NUL characters, over-long tenants and ids), JSON nested deep enough to
break a recursive parser, an integer id that would collide with a string one, a message too large
for the DLQ topic, and model answers PostgreSQL rejects (NaN, an integer beyond 64 bits, a NUL).
One ``etl run`` must read the topic to its end and exit 0, each poison must end as exactly one dead
letter whose reason and detail say what was wrong, and a second run and a replay must then cost
nothing and write nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect

from connectors.store import make_engine, upgrade
from tests.conftest import ROOT
from tests.helpers import counts, end_offsets, read_all, rows
from tests.reliability.poison_pipeline import HUGE_AMOUNT, NAN_CONFIDENCE, NAN_RATIO, NUL_NOTE

PIPELINE = str(Path(__file__).with_name("poison_pipeline.py"))
PARTITIONS = 4
STAGES = ("pick", "amounts")
#: The most a record may carry on a DLQ topic at Kafka's defaults: kafka-python's producer refuses
#: requests over ``max_request_size`` (1 MiB), just below the broker's ``message.max.bytes``.
DLQ_LIMIT = 1_048_576
#: Over the pipeline decoder's ``max_bytes`` (1,000,000) and over the DLQ limit.
OVERSIZED_TEXT = 2_500_000
#: What the source topic accepts per message, so the oversized poison can be produced at all.
SOURCE_MAX_MESSAGE_BYTES = 10_485_760

pytestmark = pytest.mark.timeout(600)


@dataclass(frozen=True)
class Poison:
    """One message that must end as a dead letter, and what the dead letter must say.

    ``detail`` is a word the dead letter's detail must contain (case-insensitive), so the reason
    an operator reads names the actual cause (or, for an answer, the field) rather than a generic
    failure; ``stage`` is the stage
    a model-answer poison fails in (None for bad input, which fails before any stage).
    """

    name: str
    value: bytes
    reason: str
    detail: str | None = None
    stage: str | None = None


def _doc(doc_id: str, text: str, tenant: str = "acme") -> bytes:
    return json.dumps({"id": doc_id, "tenant": tenant, "text": text}).encode()


def poisons() -> list[Poison]:
    """Every poison the acceptance names; JSON escapes are written by hand where ``json.dumps``
    would refuse or normalise them (a lone surrogate, a NUL)."""
    nested = b'{"id": "p-nested-field", "tenant": "acme", "text": "deep", "extra": ' \
             + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        Poison("surrogate in text", b'{"id": "p-sur-text", "tenant": "acme", "text": "a\\ud800b"}',
               "bad_input", "surrogate"),
        Poison("surrogate in id", b'{"id": "p-\\ud800", "tenant": "acme", "text": "surrogate in the id"}',
               "bad_input", "surrogate"),
        Poison("surrogate in tenant", b'{"id": "p-sur-tenant", "tenant": "ac\\udc00me", "text": "in the tenant"}',
               "bad_input", "surrogate"),
        Poison("nested, unterminated", b"[" * 200_000, "bad_input", "nest"),
        Poison("nested inside a field", nested, "bad_input", "nest"),
        Poison("NUL in text", b'{"id": "p-nul-text", "tenant": "acme", "text": "a\\u0000b"}', "bad_input", "NUL"),
        Poison("NUL in tenant", b'{"id": "p-nul-tenant", "tenant": "ac\\u0000me", "text": "NUL in the tenant"}',
               "bad_input", "NUL"),
        Poison("NUL in id", b'{"id": "p-\\u0000", "tenant": "acme", "text": "NUL in the id"}', "bad_input", "NUL"),
        Poison("tenant of 201 characters", _doc("p-long-tenant", "long tenant", tenant="t" * 201), "bad_input", "200"),
        Poison("id of 501 characters", _doc("i" * 501, "long id"), "bad_input", "500"),
        Poison("integer id", b'{"id": 1, "tenant": "acme", "text": "an integer id"}', "bad_input", "string"),
        Poison("larger than the DLQ limit", _doc("p-big", "x" * OVERSIZED_TEXT), "bad_input", "byte"),
        Poison("NaN confidence", _doc("p-nan-confidence", NAN_CONFIDENCE), "schema_invalid", "confidence", "pick"),
        Poison("integer beyond 64 bits", _doc("p-huge-amount", HUGE_AMOUNT), "schema_invalid", "amount", "amounts"),
        Poison("NaN ratio", _doc("p-nan-ratio", NAN_RATIO), "schema_invalid", "ratio", "amounts"),
        Poison("NUL in an answer", _doc("p-nul-note", NUL_NOTE), "schema_invalid", "note", "amounts"),
    ]


@dataclass(frozen=True)
class Produced:
    """Where each message landed: the test matches dead letters to poisons by position."""

    poison_at: dict[tuple[int, int], Poison]
    good_ids: set[str]
    total: int


def produce_corpus(bootstrap: str, topic: str) -> Produced:
    """Each poison goes to partition ``i % 4`` with a good message before it; every partition ends
    with a good message, so every poison has good neighbours in its own partition. The good message
    with id ``"1"`` sits right before the integer id ``1``."""
    from kafka import KafkaProducer  # noqa: PLC0415

    plan: list[tuple[int, bytes, Poison | None]] = []
    good_ids: set[str] = set()

    def good(partition: int, doc_id: str | None = None) -> None:
        doc_id = doc_id or f"g{len(good_ids)}"
        good_ids.add(doc_id)
        plan.append((partition, _doc(doc_id, f"good message {doc_id}"), None))

    for i, poison in enumerate(poisons()):
        partition = i % PARTITIONS
        good(partition, "1" if poison.name == "integer id" else None)
        plan.append((partition, poison.value, poison))
    for partition in range(PARTITIONS):
        good(partition)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=SOURCE_MAX_MESSAGE_BYTES)
    poison_at: dict[tuple[int, int], Poison] = {}
    try:
        for partition, value, poison in plan:
            sent = producer.send(topic, value=value, partition=partition).get(timeout=60)
            if poison is not None:
                poison_at[(sent.partition, sent.offset)] = poison
    finally:
        producer.close(timeout=10)
    return Produced(poison_at, good_ids, len(plan))


@pytest.fixture
def poison_topic(kafka_bootstrap: str) -> Iterator[str]:
    """A 4-partition topic that accepts the oversized poison, and a DLQ topic left at Kafka's
    default size limit (the limit the oversized dead letter must be truncated to fit)."""
    from kafka.admin import KafkaAdminClient, NewTopic  # noqa: PLC0415

    name = f"poison-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([
        NewTopic(name, PARTITIONS, 1, topic_configs={"max.message.bytes": str(SOURCE_MAX_MESSAGE_BYTES)}),
        NewTopic(f"{name}.dlq", 1, 1),
    ])
    yield name
    admin.delete_topics([name, f"{name}.dlq"])
    admin.close()


def etl(*args: str, env: dict[str, str], timeout: float = 180) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "etl.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    return done, time.perf_counter() - started


def all_counts(url: str) -> dict[str, int]:
    """Row counts of every table in the schema (typed extraction and quality tables included), so
    "writes nothing" covers tables this test does not know by name."""
    engine = create_engine(url)
    try:
        names = tuple(sorted(inspect(engine).get_table_names()))
    finally:
        engine.dispose()
    return counts(url, names)


def call_count(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def tail(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stderr (tail) ---\n{done.stderr[-4000:]}\n--- stdout (tail) ---\n" \
           f"{done.stdout[-2000:]}"


def test_poison_messages_end_as_dead_letters_and_never_stop_a_run(
        kafka_bootstrap: str, poison_topic: str, postgres_url: str, tmp_path: Path) -> None:
    topic, dlq = poison_topic, f"{poison_topic}.dlq"
    produced = produce_corpus(kafka_bootstrap, topic)
    ends = end_offsets(kafka_bootstrap, topic)
    assert sum(ends.values()) == produced.total  # the broker took every message, the oversized one too
    call_log = tmp_path / "calls.log"
    env = {**os.environ, "ETL_DATABASE_URL": postgres_url, "ETL_KAFKA_BOOTSTRAP": kafka_bootstrap,
           "ETL_KAFKA_SESSION_TIMEOUT_MS": "6000", "ETL_LOG_LEVEL": "warning",
           "POISON_TOPIC": topic, "POISON_CALL_LOG": str(call_log)}
    upgrade(make_engine(postgres_url))

    # One run reads the topic to its end, whatever the messages and answers are.
    first, first_s = etl("run", PIPELINE, "--stop-when-idle", "5", env=env)
    assert first.returncode == 0, tail(first)
    stored = dict(rows(postgres_url, f"SELECT partition, next_offset FROM source_positions "
                                     f"WHERE pipeline = 'poison' AND stream = '{topic}'"))
    assert stored == ends, tail(first)

    # Each poison is exactly one dead letter, at its own position, saying what was wrong.
    letters = rows(postgres_url, "SELECT partition, message_offset, reason, detail, stage, payload FROM dead_letters")
    found = {(p, o): (reason, detail, stage, bytes(payload)) for p, o, reason, detail, stage, payload in letters}
    assert len(found) == len(letters)
    assert set(found) == set(produced.poison_at), (
        f"missing: {sorted(p.name for k, p in produced.poison_at.items() if k not in found)}; "
        f"unexpected: {sorted((k, found[k][:2]) for k in set(found) - set(produced.poison_at))}")
    wrong: list[str] = []
    for position, poison in produced.poison_at.items():
        reason, detail, stage, payload = found[position]
        if reason != poison.reason or (poison.detail and poison.detail.lower() not in detail.lower()) \
                or (poison.stage is not None and stage != poison.stage) or payload != poison.value:
            wrong.append(f"{poison.name}: got {reason} / {detail[:120]!r} / stage {stage}"
                         f"{'' if payload == poison.value else ' / payload differs'}; "
                         f"want {poison.reason} / {poison.detail!r} / stage {poison.stage}")
    assert not wrong, "\n".join(wrong)

    # Every good message has a result for every stage; a poison answer keeps the results paid
    # before it (invariant 8) and nothing else. in == results + dead letters.
    results = set(rows(postgres_url, "SELECT doc_key, stage FROM stage_results"))
    assert results == {(g, s) for g in produced.good_ids for s in STAGES} | {
        ("p-huge-amount", "pick"), ("p-nan-ratio", "pick"), ("p-nul-note", "pick")}
    assert rows(postgres_url, "SELECT count(*) FROM poison_amounts") == [(len(produced.good_ids),)]
    assert len(produced.good_ids) + len(found) == produced.total

    # The DLQ topic has one record per dead letter; the oversized one is cut to fit and says so.
    records = read_all(kafka_bootstrap, dlq)
    by_source: dict[tuple[int, int], Any] = {}
    for record in records:
        source = json.loads(dict(record.headers)["source"])
        by_source[(source["partition"], source["offset"])] = record
    assert len(records) == len(by_source) == len(found)
    assert set(by_source) == set(produced.poison_at)
    for position, poison in produced.poison_at.items():
        record, headers = by_source[position], dict(by_source[position].headers)
        assert headers["reason"] == poison.reason.encode(), poison.name
        if len(poison.value) > DLQ_LIMIT:
            assert "truncated" in headers, f"{poison.name}: no 'truncated' header in {sorted(headers)}"
            assert int(headers["truncated"]) == len(poison.value)
            assert len(record.value) < DLQ_LIMIT and poison.value.startswith(record.value)
        else:
            assert "truncated" not in headers and record.value == poison.value, poison.name
    calls_first = call_count(call_log)
    assert calls_first > 0  # the call log works: the no-op checks below can fail
    before = all_counts(postgres_url)

    # A second run and a replay from offset 0: nothing new anywhere, not one model call.
    second, second_s = etl("run", PIPELINE, "--stop-when-idle", "5", env=env)
    assert second.returncode == 0, tail(second)
    assert all_counts(postgres_url) == before and call_count(call_log) == calls_first, tail(second)
    replay, replay_s = etl("replay", PIPELINE, env=env)
    assert replay.returncode == 0, tail(replay)
    assert f"documents read           │ {produced.total}" in replay.stdout, replay.stdout
    assert all_counts(postgres_url) == before and call_count(call_log) == calls_first, tail(replay)
    assert len(read_all(kafka_bootstrap, dlq)) == len(records)  # nothing republished

    reasons = Counter(reason for reason, *_ in found.values())
    print(f"\npoison: {produced.total} messages ({len(produced.poison_at)} poison, {len(produced.good_ids)} good), "
          f"dead letters by reason {dict(reasons)}, {calls_first} model calls; "
          f"first run {first_s:.1f} s, second run {second_s:.1f} s, replay {replay_s:.1f} s")
