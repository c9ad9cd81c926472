"""A store of 10 million documents: replay, cold path and write path against a near-empty one."""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from sqlalchemy import create_engine, text

from etl.settings import Settings
from etl.testing import FakeLLM, lognormal

from bench.common import (
    Figure, KAFKA, MEAN_S, MEDIAN_S, POSTGRES, REPLAY_IN_FLIGHT, RUNS, SIGMA, STAGE, _setting, fresh_schema,
    log, new_topic, produce, rss_of_replay, run_idem, steady_rate, summary, tickets,
)


#: Rows of the production-size store (BENCH_STORE_ROWS for a smaller trial).
STORE_ROWS = int(os.environ.get("BENCH_STORE_ROWS", "10000000"))


STORE_TABLES = ("documents", "stage_results", "llm_cache", "llm_calls")


def _fill_sql(fingerprint: str, start: int, end: int) -> list[str]:
    """INSERT … SELECT statements making rows start..end-1 of each core table, shaped as the bench
    pipeline's own (one Classify stage, two tenants, four partitions): PostgreSQL generates them
    itself, so a bulk load is bounded by the server, not by a client."""
    g = f"generate_series({start}, {end - 1}) AS g"
    doc = "md5('big' || g)"  # random-looking keys, the key space of random_ids(): replays probe all of the index
    key = "encode(sha256(('c' || g)::bytea), 'hex')"
    content = "encode(sha256(('t' || g)::bytea), 'hex')"
    tenant = "CASE WHEN g % 2 = 0 THEN 'acme' ELSE 'globex' END"
    label = "(ARRAY['billing', 'technical', 'account', 'other'])[1 + g % 4]"
    return [
        "INSERT INTO documents (pipeline, tenant, doc_key, content_hash, stream, partition, message_offset, received_at) "
        f"SELECT 'bench', {tenant}, {doc}, {content}, 'bench-big', g % 4, g / 4, now() FROM {g}",
        "INSERT INTO llm_cache (cache_key, tenant, stage, fingerprint, output, model, tokens_in, tokens_out, cost, "
        f"structured, created_at) SELECT {key}, {tenant}, 'route', '{fingerprint}', "
        f"jsonb_build_object('label', {label}, 'confidence', NULL), 'fake', 450, 8, 0.0000723, 'json_schema', now() "
        f"FROM {g}",
        "INSERT INTO stage_results (pipeline, tenant, doc_key, stage, output, cache_key, fingerprint, model, prompt_hash, "
        "schema_hash, cache_hit, attempts, tokens_in, tokens_out, cost, latency_ms, structured, created_at, updated_at) "
        f"SELECT 'bench', {tenant}, {doc}, 'route', jsonb_build_object('label', {label}, 'confidence', NULL), "
        f"{key}, '{fingerprint}', 'fake', '{fingerprint}', '{fingerprint}', false, 1, 450, 8, 0.0000723, 200.0, "
        f"'json_schema', now(), now() FROM {g}",
        "INSERT INTO llm_calls (pipeline, tenant, stage, doc_key, cache_key, model, outcome, tokens_in, tokens_out, cost, "
        f"latency_ms, created_at, call_id) SELECT 'bench', {tenant}, 'route', {doc}, {key}, 'fake', 'ok', 450, 8, "
        f"0.0000723, 200.0, now() - g * interval '100 ms', md5('call' || g) FROM {g}",  # a year of calls, in order
    ]


def _store_bytes(conn: Any) -> dict[str, int]:
    return {t: int(conn.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar_one()) for t in STORE_TABLES}


def big_store(schema: str = "bench_store_v2") -> tuple[str, list[tuple[int, dict[str, int]]], bool]:
    """A store of STORE_ROWS documents with their result, cache entry and call row, bulk-loaded
    (indexes dropped, rows made by the server, indexes built once), kept between bench runs.
    Returns its URL, (rows, bytes per table) at 1/10 and at the full size, and whether this call
    loaded it."""
    url = f"{POSTGRES}?options=-csearch_path%3D{schema}"
    engine = create_engine(url)
    with create_engine(POSTGRES).begin() as conn:
        conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
        conn.execute(text(f"CREATE TABLE IF NOT EXISTS {schema}.bench_sizes (rows bigint PRIMARY KEY, sizes jsonb)"))
    with engine.connect() as conn:
        sizes = [(int(r), dict(s)) for r, s in conn.execute(text("SELECT rows, sizes FROM bench_sizes ORDER BY rows"))]
    if sizes and sizes[-1][0] == STORE_ROWS:
        log(f"store: {schema} holds {STORE_ROWS:,} rows already")
        return url, sizes, False
    from connectors.store import upgrade  # noqa: PLC0415
    from etl.runtime.calls import StagePlan  # noqa: PLC0415

    with create_engine(POSTGRES).begin() as conn:  # another size (or a half-done load): start over
        conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        conn.execute(text(f"CREATE SCHEMA {schema}"))
        conn.execute(text(f"CREATE TABLE {schema}.bench_sizes (rows bigint PRIMARY KEY, sizes jsonb)"))
    upgrade(engine)
    fingerprint = StagePlan.of(STAGE, FakeLLM(), Settings().repairs).fingerprint
    sizes = []
    done = 0
    for target in (STORE_ROWS // 10, STORE_ROWS):
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL maintenance_work_mem = '1GB'"))
            conn.execute(text("SET LOCAL synchronous_commit = off"))
            names = list(STORE_TABLES)
            constraints = conn.execute(text(
                "SELECT c.conrelid::regclass::text, c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c "
                "WHERE c.connamespace = current_schema()::regnamespace AND c.contype IN ('p', 'u') "
                "AND c.conrelid::regclass::text = ANY(:t)"), {"t": names}).all()
            owned = {name for _, name, _ in constraints}
            indexes = [(n, d) for n, d in conn.execute(text(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() AND tablename = ANY(:t)"),
                {"t": names}) if n not in owned]
            for name, _ in indexes:
                conn.execute(text(f'DROP INDEX "{name}"'))
            for table, name, _ in constraints:
                conn.execute(text(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"'))
            step = 1_000_000
            for start in range(done, target, step):
                for statement in _fill_sql(fingerprint, start, min(target, start + step)):
                    conn.execute(text(statement))
                log(f"store: {min(target, start + step):,} rows loaded ({time.perf_counter() - started:.0f} s)")
            for table, name, definition in constraints:
                conn.execute(text(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}'))
            for _, definition in indexes:
                conn.execute(text(definition))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE " + ", ".join(STORE_TABLES)))
        with engine.begin() as conn:
            measured = _store_bytes(conn)
            conn.execute(text("INSERT INTO bench_sizes VALUES (:r, CAST(:s AS jsonb))"),
                         {"r": target, "s": json.dumps(measured)})
        sizes.append((target, measured))
        done = target
        log(f"store: {target:,} rows with indexes in {time.perf_counter() - started:.0f} s: "
            f"{sum(measured.values()) / target:.0f} bytes per document")
    engine.dispose()
    return url, sizes, True


def random_ids(docs: list[dict[str, str]]) -> list[dict[str, str]]:
    """The documents with random hex ids (32 characters), as the loaded store's keys are: the two
    interleave in every index, as a production store's keys do."""
    return [{**doc, "id": uuid.uuid4().hex} for doc in docs]


def store_figures() -> list[Figure]:
    """Replay and the cold path on a store of STORE_ROWS documents against a near-empty one, in
    the same run, alternating; bytes on disk per document at 1/10 and at the full size."""
    loaded_at = time.perf_counter()
    big, sizes, loaded = big_store()
    load_s = time.perf_counter() - loaded_at
    n = 100_000
    seed = int(time.time())  # the kept store must never have seen this run's contents
    topic = new_topic()
    produce(topic, random_ids(tickets(n, seed=seed)))
    empty = fresh_schema()
    for url in (empty, big):  # process everything once into each store
        run_idem(topic, url, FakeLLM(), in_flight=REPLAY_IN_FLIGHT)
    replay, cold, write, rates = [], [], [], {"empty": [], "big": []}
    concurrency = 64
    m = int(6.0 * concurrency / MEAN_S)
    for r in range(RUNS):
        got = {}
        for name, url in (("empty", empty), ("big", big)) if r % 2 == 0 else (("big", big), ("empty", empty)):
            processed, seconds, _ = run_idem(topic, url, FakeLLM(), in_flight=REPLAY_IN_FLIGHT)
            assert processed == n
            got[name] = n / seconds
        replay.append(got["big"] / got["empty"])
        steady = {}
        cold_topic = new_topic()
        produce(cold_topic, random_ids(tickets(m, seed=seed + 1 + r)))
        for name, url in (("empty", empty), ("big", big)) if r % 2 == 0 else (("big", big), ("empty", empty)):
            done, _, marks = run_idem(cold_topic, url, FakeLLM(latency_s=lognormal(MEDIAN_S, SIGMA, seed=r)),
                                      in_flight=concurrency)
            assert done == m
            steady[name] = steady_rate(marks, m)
            rates[name].append(steady[name])
        cold.append(steady["big"] / steady["empty"])
        # the write path at full speed: new documents, an instant model, 256 in flight (the store is the bound)
        fast = {}
        write_topic = new_topic()
        produce(write_topic, random_ids(tickets(20_000, seed=seed + 100 + r)))
        for name, url in (("empty", empty), ("big", big)) if r % 2 == 0 else (("big", big), ("empty", empty)):
            done, seconds, _ = run_idem(write_topic, url, FakeLLM(), in_flight=256)
            assert done == 20_000
            fast[name] = done / seconds
        write.append(fast["big"] / fast["empty"])
        log(f"store run {r}: replay {got['big']:.0f} vs {got['empty']:.0f} msgs/s ({replay[-1]:.3f}); cold c=64 "
            f"{steady['big']:.1f} vs {steady['empty']:.1f} msgs/s ({cold[-1]:.3f}); write path {fast['big']:.0f} vs "
            f"{fast['empty']:.0f} msgs/s ({write[-1]:.3f})")
    env = {**os.environ, "ETL_KAFKA_BOOTSTRAP": KAFKA, "BENCH_TOPIC": topic, "BENCH_REPLAY": "1",
           "ETL_MAX_IN_FLIGHT": str(REPLAY_IN_FLIGHT), "ETL_FLUSH_SIZE": "2000"}
    rss = []
    for r in range(RUNS):
        peak = {name: rss_of_replay({**env, "ETL_DATABASE_URL": url})[0]
                for name, url in ((("empty", empty), ("big", big)) if r % 2 == 0 else (("big", big), ("empty", empty)))}
        rss.append(peak["big"] / peak["empty"])
    (small_rows, small), (full_rows, full) = sizes
    with create_engine(empty).connect() as conn:  # a store grown by idem-etl's own inserts, not built in one pass
        grown = sum(_store_bytes(conn).values()) / conn.execute(text("SELECT count(*) FROM documents")).scalar_one()
    per_doc = {t: full[t] / full_rows for t in STORE_TABLES}
    note = (f"{full_rows:,} documents, each with its result, cache entry and call row ({4 * full_rows:,} rows), made "
            f"by PostgreSQL itself (INSERT … SELECT generate_series, indexes dropped and built after): " +
            (f"loaded in {load_s / 60:.1f} min" if loaded else "kept from an earlier run") +
            f"; PostgreSQL at its defaults (shared_buffers {_setting('shared_buffers')}). Replay: {n:,} processed "
            f"messages with random 32-hex ids (the loaded keys are md5 hex: both interleave in the indexes); cold: {m:,} "
            f"new messages at concurrency {concurrency}, FakeLLM lognormal "
            f"{MEDIAN_S * 1000:.0f} ms; each run does both stores, in alternating order")
    return [
        summary(f"store of {full_rows:,} documents: replay ÷ the same on a near-empty store", replay, "≥ 0.9", "ratio",
                met=lambda v: v >= 0.9, note=note),
        summary("  cold path, concurrency 64: steady throughput ÷ the same on a near-empty store", cold, "≥ 0.9",
                "ratio", met=lambda v: v >= 0.9),
        summary("  cold path steady throughput, large store", rates["big"], "", "msgs/s"),
        summary("  write path (20,000 new documents, instant model, 256 in flight) ÷ the same on a near-empty store",
                write, "", "ratio"),
        summary("  peak RSS of a replay (`etl run`), large store ÷ near-empty store", rss,
                "flat (≤ 1.1)", "ratio", met=lambda v: v <= 1.1),
        summary(f"  bytes on disk per document at {full_rows:,} (4 tables with their indexes)",
                [sum(full.values()) / full_rows], "", "bytes",
                note=", ".join(f"{t} {per_doc[t]:.0f}" for t in STORE_TABLES)),
        summary(f"  bytes on disk per document at {small_rows:,}", [sum(small.values()) / small_rows], "", "bytes"),
        summary("  bytes on disk per document written by idem-etl itself (the near-empty store, indexes grown "
                "by inserts)", [grown], "", "bytes",
                note="the loaded store's indexes are built in one pass, packed fuller than ones grown by inserts: "
                     "its figures are a lower bound"),
    ]
