"""idem-etl benchmarks against real Kafka and PostgreSQL; writes bench/RESULTS.md.

Every figure is a ratio against a baseline measured in the same run (so it holds on a noisy
machine), reported as the median and min–max over RUNS runs. Run with `bash bench/run.sh`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from pydantic import BaseModel
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, text

from etl import Classify, KafkaSource, ListSource, Pipeline, Router
from etl.llm.base import LLMRequest
from etl.log import configure
from etl.runtime.wiring import build_runner, run_pipeline
from etl.settings import Settings
from etl.testing import FakeLLM, lognormal, simulated_labeller

ROOT = Path(__file__).resolve().parents[1]
RUNS = int(os.environ.get("BENCH_RUNS", "5"))
KAFKA = os.environ["ETL_TEST_KAFKA"]
POSTGRES = os.environ["ETL_TEST_POSTGRES_URL"]
LABELS = ["billing", "technical", "account", "other"]
MEDIAN_S, SIGMA = 0.2, 0.5
MEAN_S = MEDIAN_S * math.exp(SIGMA**2 / 2)  # the mean of that lognormal: what "ideal" divides by


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- services --------------------------------------------------------------------------------


def new_topic(partitions: int = 4) -> str:
    name = f"bench-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=KAFKA)
    admin.create_topics([NewTopic(name, partitions, 1)])
    admin.close()
    return name


def produce(topic: str, docs: list[dict[str, str]], partitions: int = 4) -> None:
    producer = KafkaProducer(bootstrap_servers=KAFKA, linger_ms=50, batch_size=256 * 1024, acks="all")
    for i, doc in enumerate(docs):
        producer.send(topic, json.dumps(doc).encode(), key=doc["id"].encode(), partition=i % partitions)
    producer.flush(timeout=120)
    producer.close()


def fresh_schema() -> str:
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with create_engine(POSTGRES).begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    return f"{POSTGRES}?options=-csearch_path%3D{schema}"


def tickets(n: int, duplicate_share: float = 0.0, seed: int = 0) -> list[dict[str, str]]:
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    texts: list[str] = []
    docs = []
    for i in range(n):
        if texts and rng.random() < duplicate_share:
            text_ = rng.choice(texts)
        else:
            text_ = f"ticket {seed}-{i}: {rng.choice(['refund', 'login', 'crash'])} #{rng.randint(0, 10**9)}"
            texts.append(text_)
        docs.append({"id": f"d{seed}-{i}", "tenant": ["acme", "globex"][i % 2], "text": text_})
    return docs


def steady_rate(marks: list[tuple[float, int]], total: int) -> float:
    """Completions per second between 10% and 90% of the run: the steady state, without start-up
    (joining, first fetch) or the drain (the slowest calls of the last batch)."""
    t10 = next(t for t, done in marks if done >= 0.1 * total)
    t90 = next(t for t, done in marks if done >= 0.9 * total)
    done10 = next(done for t, done in marks if t == t10)
    done90 = next(done for t, done in marks if t == t90)
    return (done90 - done10) / (t90 - t10) if t90 > t10 else float("nan")


STAGE = Classify(LABELS, "Route the support ticket.", name="route")  # the stage bench/pipeline.py runs too


def run_idem(topic: str, url: str, llm: FakeLLM, in_flight: int) -> tuple[int, float, list[tuple[float, int]]]:
    """(messages, seconds, completion marks) for idem-etl reading ``topic`` from offset 0 to its end."""
    pipeline = Pipeline("bench", KafkaSource(topic, replay_from="start"), [STAGE], store=url, review=None)
    settings = Settings(kafka_bootstrap=KAFKA, max_in_flight=in_flight, flush_size=2000)
    marks: list[tuple[float, int]] = []
    runner = build_runner(pipeline, settings, llm=llm,
                          on_progress=lambda st: marks.append((time.perf_counter(), st.stage_runs)))
    started = time.perf_counter()
    stats = asyncio.run(runner.run())
    return stats.messages, time.perf_counter() - started, marks


def run_raw(topic: str) -> tuple[int, float]:
    """Plain kafka-python consumption of the same topic: the replay baseline. Timed from the
    consumer's creation, as idem-etl's run is (its store check and consumer set-up included)."""
    started = time.perf_counter()
    consumer = KafkaConsumer(bootstrap_servers=KAFKA, enable_auto_commit=False)
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    end = consumer.end_offsets(tps)
    count = 0
    while any(consumer.position(tp) < end[tp] for tp in tps):
        for records in consumer.poll(timeout_ms=200, max_records=500).values():
            count += sum(1 for r in records if json.loads(r.value))  # decode, as any consumer must
    elapsed = time.perf_counter() - started
    consumer.close()
    return count, elapsed


class _Route(BaseModel):
    label: str


def run_naive(topic: str, url: str, llm: FakeLLM, concurrency: int) -> tuple[int, float, list[tuple[float, int]]]:
    """The loop people write first: poll a batch, call the model for each, validate, insert, commit."""
    engine = create_engine(url)
    meta = MetaData()
    table = Table("naive_results", meta, Column("id", Integer, primary_key=True), Column("doc_key", String),
                  Column("label", String))
    meta.create_all(engine)
    consumer = KafkaConsumer(bootstrap_servers=KAFKA, enable_auto_commit=False)
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    end = consumer.end_offsets(tps)
    schema = STAGE.llm_schema()

    marks: list[tuple[float, int]] = []

    async def loop() -> int:
        count = 0
        while any(consumer.position(tp) < end[tp] for tp in tps):
            records = [r for rs in consumer.poll(timeout_ms=200, max_records=concurrency).values() for r in rs]
            docs = [json.loads(r.value) for r in records]
            answers = await asyncio.gather(*(llm.generate(LLMRequest(
                messages=[{"role": "user", "content": d["text"]}], json_schema=schema)) for d in docs))
            rows = [{"doc_key": d["id"], "label": _Route.model_validate_json(a.text).label}
                    for d, a in zip(docs, answers, strict=True)]
            if rows:
                with engine.begin() as conn:
                    conn.execute(table.insert(), rows)
            count += len(rows)
            marks.append((time.perf_counter(), count))
        return count

    started = time.perf_counter()
    count = asyncio.run(loop())
    elapsed = time.perf_counter() - started
    consumer.close()
    engine.dispose()
    return count, elapsed, marks


# -- figures ---------------------------------------------------------------------------------

Figure = dict[str, Any]


def summary(name: str, values: list[float], goal: str, unit: str = "", met: Callable[[float], bool] | None = None,
            note: str = "") -> Figure:
    median = statistics.median(values)
    return {"figure": name, "median": median, "min": min(values), "max": max(values), "runs": len(values),
            "unit": unit, "goal": goal, "met": None if met is None else met(median), "note": note}


#: Replay window: two polled batches of 1,000 in flight, one looked up while the next is fetched.
REPLAY_IN_FLIGHT = 2000


def replay_figures(n: int = 100_000) -> list[Figure]:
    topic = new_topic()
    log(f"replay: producing {n:,} messages and processing them once")
    produce(topic, tickets(n))
    url = fresh_schema()
    run_idem(topic, url, FakeLLM(), in_flight=REPLAY_IN_FLIGHT)  # process everything once
    ratios, idem_rates, raw_rates = [], [], []
    for r in range(RUNS):
        llm = FakeLLM()
        if r % 2:  # alternate the order, so neither side always runs on a warmer broker
            idem_n, idem_s, _ = run_idem(topic, url, llm, in_flight=REPLAY_IN_FLIGHT)
            raw_n, raw_s = run_raw(topic)
        else:
            raw_n, raw_s = run_raw(topic)
            idem_n, idem_s, _ = run_idem(topic, url, llm, in_flight=REPLAY_IN_FLIGHT)
        assert raw_n == idem_n == n and not llm.calls, (raw_n, idem_n, len(llm.calls))
        raw_rates.append(raw_n / raw_s)
        idem_rates.append(idem_n / idem_s)
        ratios.append(idem_rates[-1] / raw_rates[-1])
        log(f"replay run {r}: raw {raw_rates[-1]:.0f}/s idem {idem_rates[-1]:.0f}/s ratio {ratios[-1]:.3f}")
    return [
        summary(f"replay of {n:,} processed messages: idem-etl ÷ raw kafka-python", ratios, "≥ 0.8",
                met=lambda v: v >= 0.8,
                note=f"both timed from creating their consumer to the last message; idem-etl with "
                     f"ETL_MAX_IN_FLIGHT={REPLAY_IN_FLIGHT} (see bench/NOTES.md)"),
        summary("  raw kafka-python consume + JSON decode", raw_rates, "baseline", "msgs/s"),
        summary("  idem-etl replay (Kafka → PostgreSQL look-up, 0 LLM calls)", idem_rates, "", "msgs/s"),
    ]


def cold_figures() -> list[Figure]:
    out = []
    for concurrency in (1, 8, 64, 256):
        n = max(30, int(6.0 * concurrency / MEAN_S))  # about 6 s of ideal work per run
        ideal = concurrency / MEAN_S
        vs_ideal, end_to_end, vs_naive, rates = [], [], [], []
        for r in range(RUNS):
            topic = new_topic()
            produce(topic, tickets(n, seed=1000 * concurrency + r))
            idem_n, idem_s, idem_marks = run_idem(
                topic, fresh_schema(), FakeLLM(latency_s=lognormal(MEDIAN_S, SIGMA, seed=r)), in_flight=concurrency)
            naive_n, _, naive_marks = run_naive(
                topic, fresh_schema(), FakeLLM(latency_s=lognormal(MEDIAN_S, SIGMA, seed=r)), concurrency)
            assert idem_n == naive_n == n
            rates.append(steady_rate(idem_marks, n))
            vs_ideal.append(rates[-1] / ideal)
            end_to_end.append(idem_n / idem_s / ideal)
            vs_naive.append(rates[-1] / steady_rate(naive_marks, n))
            log(f"cold c={concurrency} run {r}: steady {rates[-1]:.1f}/s (end to end {idem_n / idem_s:.1f}/s) "
                f"ideal {ideal:.1f}/s naive {steady_rate(naive_marks, n):.1f}/s")
        goal = "≥ 0.9" if concurrency in (64, 256) else ""
        out.append(summary(f"cold path, concurrency {concurrency} ({n} msgs): idem-etl ÷ ideal", vs_ideal, goal,
                           met=(lambda v: v >= 0.9) if goal else None,
                           note=f"ideal = {concurrency} ÷ {MEAN_S * 1000:.0f} ms = {ideal:.1f} msgs/s; steady state "
                                "(10%–90% of completions)"))
        out.append(summary(f"  same, end to end (start-up and drain included), concurrency {concurrency}",
                           end_to_end, ""))
        out.append(summary(f"  idem-etl ÷ naive loop (both steady state), concurrency {concurrency}", vs_naive, ""))
        out.append(summary(f"  idem-etl steady throughput, concurrency {concurrency}", rates, "", "msgs/s"))
    return out


def dedup_figures(n: int = 4000, workers: int = 2) -> list[Figure]:
    out = []
    for share in (0.3, 0.7):
        ratios, saved = [], []
        for r in range(RUNS):
            docs = tickets(n, duplicate_share=share, seed=70_000 + int(share * 100) * 10 + r)
            unique = len({(d["tenant"], d["text"]) for d in docs})
            topic = new_topic()
            produce(topic, docs)
            url = fresh_schema()
            calls = Path(f"/tmp/{topic}.calls")
            env = {**os.environ, "ETL_DATABASE_URL": url, "ETL_KAFKA_BOOTSTRAP": KAFKA, "BENCH_TOPIC": topic,
                   "BENCH_CALL_LOG": str(calls), "ETL_MAX_IN_FLIGHT": "64", "ETL_KAFKA_SESSION_TIMEOUT_MS": "6000"}
            subprocess.run([sys.executable, "-m", "etl.cli", "db", "upgrade"], env=env, check=True, capture_output=True)
            procs = [subprocess.Popen([sys.executable, "-m", "etl.cli", "run", str(ROOT / "bench" / "pipeline.py"),
                                       "--stop-when-idle", "4"], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for _ in range(workers)]
            assert all(p.wait(timeout=600) == 0 for p in procs)
            engine = create_engine(url)
            with engine.connect() as conn:
                done = conn.execute(text("SELECT count(*) FROM stage_results")).scalar_one()
                saved_usd = conn.execute(text("SELECT coalesce(sum(cost), 0) FROM llm_calls "
                                              "WHERE outcome = 'cache_hit'")).scalar_one()
            engine.dispose()
            made = len(calls.read_text().splitlines())
            calls.unlink()
            assert done == n, (done, n)
            ratios.append(made / unique)
            saved.append(float(saved_usd))
            log(f"dedup {share:.0%} run {r}: calls {made} unique {unique} saved ${saved_usd:.6f}")
        out.append(summary(f"dedup, {share:.0%} duplicate contents, {workers} workers: LLM calls ÷ unique contents",
                           ratios, "= 1.00", met=lambda v: abs(v - 1) < 1e-9))
        out.append(summary(f"  cost saved by the cache ({n} docs, FakeLLM at $0.15/$0.60 per Mtok)", saved, "",
                           "USD"))
    return out


def constrained_figures() -> list[Figure]:
    from etl import Extract, LocalLLM, Receipt  # noqa: PLC0415
    from schemas import Document, Position  # noqa: PLC0415

    llm = LocalLLM(n_ctx=2048)
    stage = Extract(Receipt, "Extract the receipt's key fields.")
    receipts = [json.loads(line) for line in (ROOT / "examples/data/receipts.jsonl").read_text().splitlines()[:5]]
    requests = [LLMRequest(stage.render(Document(tenant="t", key=r["id"], content=r["text"], content_hash="-",
                                                  position=Position(stream="s", offset=0))),
                           stage.llm_schema(), max_tokens=96) for r in receipts]
    import llama_cpp  # noqa: PLC0415

    llm.generate_sync(requests[0])  # load the model and build the constraint's index outside the timing
    context = llm._llama._ctx.ctx  # noqa: SLF001 - llama.cpp's own counters tell prompt time apart
    ratios, whole_ratios = [], []
    for r in range(RUNS):
        rates, whole = {}, {}
        for constrained in (True, False) if r % 2 == 0 else (False, True):
            tokens = seconds = prompt_s = 0.0
            for request in requests:
                llm._llama.reset()  # noqa: SLF001 - no prompt-cache advantage for either side
                llama_cpp.llama_perf_context_reset(context)
                started = time.perf_counter()
                response = llm.generate_sync(request, constrained=constrained)
                seconds += time.perf_counter() - started
                prompt_s += llama_cpp.llama_perf_context(context).t_p_eval_ms / 1000
                tokens += response.tokens_out
            # Generation speed: wall time minus the prompt's evaluation, which is the same work on
            # both sides (and would otherwise count against whichever side writes fewer tokens).
            rates[constrained] = tokens / (seconds - prompt_s)
            whole[constrained] = tokens / seconds
        ratios.append(rates[True] / rates[False])
        whole_ratios.append(whole[True] / whole[False])
        log(f"constrained run {r}: generation {rates[True]:.1f} vs {rates[False]:.1f} tokens/s; "
            f"with the prompt {whole[True]:.1f} vs {whole[False]:.1f}")
    return [
        summary("SmolLM2-135M generation tokens/s: outlines-constrained ÷ unconstrained llama.cpp", ratios, "≥ 0.8",
                met=lambda v: v >= 0.8,
                note="5 SROIE receipts, Receipt schema, max 96 tokens, greedy; wall time per generated token, "
                     "prompt evaluation (llama.cpp's own counter) excluded"),
        summary("  same, prompt evaluation included (constrained answers are shorter: ~64 vs 96 tokens)",
                whole_ratios, ""),
    ]


def rss_of_replay(env: dict[str, str]) -> tuple[float, float, float]:
    """(peak RSS MB, last quarter − first quarter of the steady state MB, seconds) of one `etl run`
    of bench/pipeline.py, sampled from /proc every 0.2 s."""
    proc = subprocess.Popen([sys.executable, "-m", "etl.cli", "run", str(ROOT / "bench" / "pipeline.py")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = []
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            samples.append(int(next(l for l in status.splitlines() if l.startswith("VmRSS")).split()[1]) / 1024)
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            pass
        time.sleep(0.2)
    assert proc.returncode == 0 and samples
    steady = samples[len(samples) // 4:] or samples  # after start-up
    quarter = max(1, len(steady) // 4)
    return max(samples), statistics.mean(steady[-quarter:]) - statistics.mean(steady[:quarter]), len(samples) * 0.2


def memory_figures(n: int = 200_000) -> list[Figure]:
    topic = new_topic()
    log(f"memory: producing {n:,} messages")
    produce(topic, tickets(n, seed=424242))
    url = fresh_schema()
    log("memory: processing them once")
    processed, _, _ = run_idem(topic, url, FakeLLM(), in_flight=REPLAY_IN_FLIGHT)
    assert processed == n
    peaks, growth = [], []
    env = {**os.environ, "ETL_DATABASE_URL": url, "ETL_KAFKA_BOOTSTRAP": KAFKA, "BENCH_TOPIC": topic,
           "BENCH_REPLAY": "1", "ETL_MAX_IN_FLIGHT": str(REPLAY_IN_FLIGHT), "ETL_FLUSH_SIZE": "2000"}
    for r in range(RUNS):
        peak, grew, seconds = rss_of_replay(env)
        peaks.append(peak)
        growth.append(grew)
        log(f"memory run {r}: peak {peak:.0f} MB, last-quarter minus first-quarter {grew:+.1f} MB over {seconds:.0f} s")
    return [
        summary(f"peak RSS during a {n:,}-message replay (`etl run`, replay source)", peaks, "< 300", "MB",
                met=lambda v: v < 300),
        summary("  RSS growth over the replay (last quarter − first quarter of steady state)", growth, "flat", "MB",
                met=lambda v: abs(v) < 20),
    ]


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


def _setting(name: str) -> str:
    with create_engine(POSTGRES).connect() as conn:
        return str(conn.execute(text(f"SHOW {name}")).scalar_one())


def run_quix(topic: str, group: str, state: Path, processes: int = 1, median_s: float = 0.0, seed: int = 0,
             then: Callable[[], None] | None = None) -> dict[str, float]:
    """Runs bench/quix_app.py (Quix Streams) in ``processes`` processes of one consumer group until
    the topic is read: messages, model calls, and the times of the first Application's creation,
    the first and the last message done (perf_counter: one clock for all). ``then`` (producing
    the topic) runs 10 s after the processes start, once the group has settled."""
    outs = [state / f"out-{i}.json" for i in range(processes)]
    idle = "3" if then is None else "20"
    procs = [subprocess.Popen([sys.executable, "-m", "bench.quix_app", topic, group, str(state / f"state-{i}"),
                               str(out), "--median-s", str(median_s), "--seed", str(seed * 100 + i), "--idle-s", idle],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i, out in enumerate(outs)]
    if then is not None:
        time.sleep(10)
        then()
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-2000:]
    got = [json.loads(out.read_text()) for out in outs]
    active = [g for g in got if g["messages"]]
    return {"messages": sum(g["messages"] for g in got), "calls": sum(g["calls"] for g in got),
            "started": min(g["started"] for g in got), "first": min(g["first"] for g in active),
            "last": max(g["last"] for g in active)}


def rewind(topic: str, group: str) -> None:
    """Sets a consumer group's committed offsets back to 0 (what an operator does to replay)."""
    from kafka.structs import OffsetAndMetadata  # noqa: PLC0415

    consumer = KafkaConsumer(bootstrap_servers=KAFKA, group_id=group, enable_auto_commit=False)
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(tps)
    consumer.commit({tp: OffsetAndMetadata(0, "", -1) for tp in tps})
    consumer.close()


def quix_figures(n: int = 100_000, m: int = 80) -> list[Figure]:
    """idem-etl against the same pipeline written in Quix Streams (bench/quix_app.py), on the same
    topics: a replay of ``n`` processed messages, and the cold path on ``m`` new ones with the same
    lognormal model latency, one process each and Quix in one process per partition."""
    import tempfile  # noqa: PLC0415

    folder = Path(tempfile.mkdtemp(prefix="bench-quix-"))
    topic = new_topic()
    log(f"quix: producing {n:,} messages and processing them once with each")
    produce(topic, tickets(n, seed=77))
    url = fresh_schema()
    run_idem(topic, url, FakeLLM(), in_flight=REPLAY_IN_FLIGHT)
    group = f"quix-{uuid.uuid4().hex[:8]}"
    first = run_quix(topic, group, folder)
    assert first["messages"] == first["calls"] == n, first
    replay, idem_rates, quix_rates, quix_steady, idem_steady, steady = [], [], [], [], [], []
    for r in range(RUNS):
        rewind(topic, group)
        got = {}
        for side in ("idem", "quix") if r % 2 == 0 else ("quix", "idem"):
            if side == "idem":
                done, seconds, marks = run_idem(topic, url, FakeLLM(), in_flight=REPLAY_IN_FLIGHT)
                assert done == n
                got["idem"] = n / seconds
                # from the first commit that settled messages to the last (start-up left out, as for Quix)
                first = next((t, k) for t, k in marks if k > 0)
                idem_steady.append((n - first[1]) / (marks[-1][0] - first[0]))
            else:
                q = run_quix(topic, group, folder)
                assert q["messages"] == n and q["calls"] == 0, q
                got["quix"] = n / (q["last"] - q["started"])
                quix_steady.append(n / (q["last"] - q["first"]))
        idem_rates.append(got["idem"])
        quix_rates.append(got["quix"])
        replay.append(got["idem"] / got["quix"])
        steady.append(idem_steady[-1] / quix_steady[-1])
        log(f"quix replay run {r}: idem {got['idem']:.0f}/s quix {got['quix']:.0f}/s ({replay[-1]:.3f}); "
            f"quix first to last message {quix_steady[-1]:.0f}/s")
    ideal1 = 1 / MEAN_S
    one, four, quix_one, quix_four, idem_four = [], [], [], [], []
    for r in range(RUNS):
        cold = new_topic()
        produce(cold, tickets(m, seed=9_000_000 + r))
        idem_n, _, marks = run_idem(cold, fresh_schema(), FakeLLM(latency_s=lognormal(MEDIAN_S, SIGMA, seed=r)),
                                    in_flight=4)
        assert idem_n == m
        t1 = next(t for t, done in marks if done >= 1)
        idem_rate = (m - 1) / (marks[-1][0] - t1)
        rates = {}
        q = run_quix(cold, f"quix-{uuid.uuid4().hex[:8]}", folder, 1, MEDIAN_S, seed=r)
        assert q["messages"] == q["calls"] == m, q
        rates[1] = (m - 1) / (q["last"] - q["first"])
        # four processes: started on an empty topic, so every one holds its partition before it fills
        late = new_topic()
        q = run_quix(late, f"quix-{uuid.uuid4().hex[:8]}", folder, 4, MEDIAN_S, seed=r,
                     then=lambda late=late, r=r: produce(late, tickets(m, seed=9_000_000 + r)))
        assert q["messages"] == q["calls"] == m, q
        rates[4] = (m - 1) / (q["last"] - q["first"])
        idem_four.append(idem_rate)
        quix_one.append(rates[1])
        quix_four.append(rates[4])
        one.append(idem_rate / rates[1])
        four.append(idem_rate / rates[4])
        log(f"quix cold run {r}: idem (1 process, 4 in flight) {idem_rate:.1f}/s; quix 1 process {rates[1]:.1f}/s, "
            f"4 processes {rates[4]:.1f}/s")
    shutil.rmtree(folder, ignore_errors=True)
    return [
        summary(f"replay of {n:,} processed messages: idem-etl ÷ Quix Streams", replay, "≥ 1.0", "ratio",
                met=lambda v: v >= 1.0,
                note=f"Quix Streams {version('quixstreams')} (confluent-kafka {version('confluent-kafka')}): the same "
                     "pipeline by hand (bench/quix_app.py): one Application, exactly-once, a stateful apply looking "
                     "the content hash up in RocksDB state, results to a topic; rewound to offset 0 by its consumer "
                     "group. Both timed from creating their consumer (Quix: its Application) to the last message"),
        summary("  idem-etl replay", idem_rates, "", "msgs/s"),
        summary("  Quix Streams replay", quix_rates, "", "msgs/s"),
        summary("  the same, start-up left out (idem-etl: first to last commit; Quix: first to last message)",
                steady, "", "ratio"),
        summary("  idem-etl replay, first to last commit", idem_steady, "", "msgs/s"),
        summary("  Quix Streams replay, first to last message", quix_steady, "", "msgs/s"),
        summary(f"cold path ({m} new messages, 4 partitions), one process each: idem-etl (4 in flight) ÷ Quix Streams",
                one, "≥ 2.0", "ratio", met=lambda v: v >= 2.0,
                note=f"the same FakeLLM latency (lognormal, median {MEDIAN_S * 1000:.0f} ms, sigma {SIGMA}) on both; "
                     "throughput from the first to the last completed message"),
        summary("  Quix Streams, one process ÷ one call at a time (1 ÷ mean latency): sequential if ≈ 1",
                [q / ideal1 for q in quix_one], "", "ratio"),
        summary("  idem-etl (1 process, 4 in flight) ÷ Quix Streams in 4 processes (one per partition)", four, "",
                "ratio"),
        summary("  idem-etl throughput, 1 process, 4 in flight", idem_four, "", "msgs/s"),
        summary("  Quix Streams throughput, 1 process", quix_one, "", "msgs/s"),
        summary("  Quix Streams throughput, 4 processes", quix_four, "", "msgs/s"),
    ]


def _cpu_s(name: str) -> float:
    """CPU seconds (user + system) of every process whose command name is ``name`` (postgres, java),
    with their reaped children's (PostgreSQL's postmaster collects each closed connection's time)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            if fields[0].split("(", 1)[1] == name:
                parts = fields[1].split()
                total += sum(int(v) for v in parts[11:15]) / tick  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            continue
    return total


def _timed(store: Any, names: tuple[str, ...], into: dict[str, list[tuple[float, int]]]) -> None:
    """Records (seconds, items) of each call of the store's ``names`` methods (a bench probe)."""
    for name in names:
        method = getattr(store, name)

        def probe(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = _method(*args, **kwargs)
            items = {"write": lambda: len(args[1].outcomes), "claim_many": lambda: len(args[0]),
                     "unsettled": lambda: len(args[1]), "lookup": lambda: len(set(args[1]))}[_name]()
            into.setdefault(_name, []).append((time.perf_counter() - started, items))
            return result

        setattr(store, name, probe)


def capacity_figures(n: int = 20_000) -> list[Figure]:
    """What one document costs each part, for docs/SCALING.md: CPU of the worker, of PostgreSQL and of
    the broker per 1,000 documents, on the write path (new documents, an instant model, 256 in
    flight: the most a store is asked to write) and on a replay; and the store calls' latency."""
    out: dict[str, list[float]] = {}
    calls: dict[str, dict[str, list[tuple[float, int]]]] = {}
    for r in range(RUNS):
        topic = new_topic()
        produce(topic, tickets(n, seed=7_000_000 + r))
        url = fresh_schema()
        for path, in_flight in (("write", 256), ("replay", REPLAY_IN_FLIGHT)):
            pipeline = Pipeline("bench", KafkaSource(topic, replay_from="start"), [STAGE], store=url, review=None)
            runner = build_runner(pipeline, Settings(kafka_bootstrap=KAFKA, max_in_flight=in_flight, flush_size=2000),
                                  llm=FakeLLM())
            _timed(runner.store, ("write", "claim_many", "lookup", "unsettled"), calls.setdefault(path, {}))
            pg, broker, own = _cpu_s("postgres"), _cpu_s("java"), time.process_time()
            started = time.perf_counter()
            stats = asyncio.run(runner.run())
            seconds = time.perf_counter() - started
            assert stats.messages == n
            for part, used in (("worker", time.process_time() - own), ("postgres", _cpu_s("postgres") - pg),
                               ("broker", _cpu_s("java") - broker)):
                out.setdefault(f"{path} {part}", []).append(used / n * 1e6)  # ms per 1,000
            out.setdefault(f"{path} rate", []).append(n / seconds)
        log(f"capacity run {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in out.items()))

    def per_call(path: str, name: str, of: int) -> list[float]:  # latency (ms), or items, of each call
        return [s * 1000 if of == 0 else k for s, k in calls[path].get(name, [])] or [float("nan")]

    def per_item(path: str, name: str) -> list[float]:
        return [s * 1e6 / k for s, k in calls[path].get(name, []) if k >= 100] or [float("nan")]

    note = (f"{n:,} new documents per run (FakeLLM without latency, ETL_MAX_IN_FLIGHT=256, flush 2,000), then "
            f"their replay (in flight {REPLAY_IN_FLIGHT}); one worker process; CPU from /proc (postgres, java "
            "processes) and the worker's process time; PostgreSQL and Kafka on the same 2 cores")
    figures = [
        summary("capacity, write path: documents per second, one worker", out["write rate"], "", "msgs/s", note=note),
        summary("  worker CPU per 1,000 new documents", out["write worker"], "", "ms"),
        summary("  PostgreSQL CPU per 1,000 new documents", out["write postgres"], "", "ms"),
        summary("  broker CPU per 1,000 new documents", out["write broker"], "", "ms"),
        summary("capacity, replay: messages per second, one worker", out["replay rate"], "", "msgs/s"),
        summary("  worker CPU per 1,000 replayed messages", out["replay worker"], "", "ms"),
        summary("  PostgreSQL CPU per 1,000 replayed messages", out["replay postgres"], "", "ms"),
        summary("  broker CPU per 1,000 replayed messages", out["replay broker"], "", "ms"),
        summary("  write path: results per commit (every commit of the runs, not runs)", per_call("write", "write", 1),
                "", "rows"),
        summary("  write path: one commit (store.write)", per_call("write", "write", 0), "", "ms"),
        summary("  write path: store.write per result (commits of ≥ 100)", per_item("write", "write"), "", "µs"),
        summary("  write path: store.claim_many per key (claims of ≥ 100)", per_item("write", "claim_many"), "", "µs"),
        summary("  write path: store.lookup per document (look-ups of ≥ 100)", per_item("write", "lookup"), "", "µs"),
        summary("  replay: store.unsettled per message (checks of ≥ 100)", per_item("replay", "unsettled"), "", "µs"),
        summary("  replay: one commit of positions (store.write)", per_call("replay", "write", 0), "", "ms"),
    ]
    return figures


# -- report ----------------------------------------------------------------------------------


def machine() -> list[str]:
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    mem_kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
    with create_engine(POSTGRES).connect() as conn:
        pg = conn.execute(text("SHOW server_version")).scalar_one()
    versions = ", ".join(f"{p} {version(p)}" for p in ("kafka-python", "sqlalchemy", "psycopg", "pydantic",
                                                        "llama-cpp-python", "outlines"))
    from kafka.record import util as record_util  # noqa: PLC0415

    versions += (f", crc32c {version('crc32c')} (record CRCs in C, both sides)" if record_util.crc32c_c
                 else ", record CRCs in pure Python (crc32c missing)")
    kafka = "Apache Kafka " + (ROOT / "services/kafka/pom.xml").read_text().split("<kafka.version>")[1].split("<")[0]
    return [f"- CPU: {cpu}, {os.cpu_count()} cores; memory {mem_kb / 1024 / 1024:.0f} GiB; {platform.platform()}",
            f"- Python {platform.python_version()}; {versions}",
            f"- {kafka} (KRaft, single node, 127.0.0.1); PostgreSQL {pg} (127.0.0.1)"]


def fmt(v: float, unit: str) -> str:
    return f"{v:,.0f}" if unit in ("msgs/s", "bytes", "rows") else f"{v:,.1f}" if unit in ("MB", "s", "ms", "µs") else \
        f"{v:.6f}" if unit == "USD" else f"{v:.3f}"


def write(sections: dict[str, dict[str, Any]]) -> Path:
    """RESULTS.md from every section's latest saved run (bench/results/<section>.json)."""
    figures = [f for name in SECTIONS if name in sections for f in sections[name]["figures"]]
    runs = ", ".join(f"{name} {s['started']} ({s['minutes']:.1f} min)" for name, s in sections.items())
    lines = ["# Benchmark results", "",
             f"`bash bench/run.sh`; sections last run: {runs}. Every figure is the median and min–max over "
             f"{RUNS} runs; ratios are against a baseline measured in the same run. The router section is "
             "not a timing benchmark: one run, its data and simulated model being deterministic.", "",
             "## Machine", "", *machine(), "", "## Figures", "",
             "| figure | median | min–max | unit | goal | met |", "|---|---:|---:|---|---|---|"]
    for f in figures:
        met = "" if f["met"] is None else ("yes" if f["met"] else "**no**")
        lines.append(f"| {f['figure']} | {fmt(f['median'], f['unit'])} | {fmt(f['min'], f['unit'])}–"
                     f"{fmt(f['max'], f['unit'])} | {f['unit'] or 'ratio'} | {f['goal']} | {met} |")
    notes = [f"- {f['figure'].strip()}: {f['note']}" for f in figures if f["note"]]
    lines += ["", "## Notes", "", *notes, "", (ROOT / "bench" / "NOTES.md").read_text().strip(), ""]
    path = ROOT / "bench" / "RESULTS.md"
    path.write_text("\n".join(lines))
    return path


def batch_figures(n: int = 20_000, n_http: int = 2_000) -> list[Figure]:
    """The batch tier's own overhead: the same backfill (a JSONL file, one Classify stage, the
    PostgreSQL store) synchronously with an instant in-process model (FakeLLM, no latency: idem-etl's
    own ceiling) and through the Batch API of a server answering as soon as asked (etl.testing.batch_server,
    in a process of its own, as a provider is), timed from start
    to the last commit. Cost per 1,000 documents: synchronously against the same server's chat
    endpoint (on the first ``n_http`` documents: the same mix), and in batch mode."""
    from etl.llm.openai_compat import OpenAICompatibleLLM  # noqa: PLC0415

    prices = (0.15, 0.60)
    ratios, rates, costs = [], {"sync": [], "batch": []}, {"sync": [], "batch": []}

    def backfill(docs: list[dict[str, str]], llm: Any, batch: bool) -> tuple[float, float]:
        """(seconds, USD per 1,000 documents)"""
        path = Path(f"/tmp/bench-batch-{uuid.uuid4().hex[:8]}.jsonl")
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        url = fresh_schema()
        pipeline = Pipeline("bench", str(path), [Classify(LABELS, "Route the support ticket.")], store=url, llm=llm)
        t0 = time.perf_counter()
        runner = build_runner(pipeline, Settings(max_in_flight=64, batch_poll_s=0.2, batch_window=len(docs)),
                              batch=batch)
        stats = asyncio.run(_run_and_close(runner))
        took = time.perf_counter() - t0
        path.unlink()
        engine = create_engine(url)
        with engine.connect() as conn:
            spent = conn.execute(text("SELECT coalesce(sum(cost), 0) FROM llm_calls WHERE outcome <> 'cache_hit'")
                                 ).scalar_one()
            done = conn.execute(text("SELECT count(*) FROM stage_results")).scalar_one()
        engine.dispose()
        assert stats.messages == done == len(docs), (batch, stats.messages, done)
        return took, float(spent) / len(docs) * 1000

    for r in range(RUNS):
        docs = tickets(n, seed=90_000 + r)
        sync_s, _ = backfill(docs, FakeLLM(), batch=False)
        # The server in its own process, as a provider is: its work is not ours.
        server = subprocess.Popen([sys.executable, "-c", "import sys, time; from etl.testing import BatchServer; "
                                   "s = BatchServer().__enter__(); print(s.url, flush=True); time.sleep(86400)"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            server_url = server.stdout.readline().strip()  # type: ignore[union-attr]
            llm = lambda: OpenAICompatibleLLM(server_url, "bench-model", api_key="bench", price_per_mtok=prices)  # noqa: E731
            batch_s, batch_cost = backfill(docs, llm(), batch=True)
            _, sync_cost = backfill(docs[:n_http], llm(), batch=False)
        finally:
            server.kill()
            server.wait()
        ratios.append(sync_s / batch_s)
        rates["sync"].append(n / sync_s)
        rates["batch"].append(n / batch_s)
        costs["sync"].append(sync_cost)
        costs["batch"].append(batch_cost)
        log(f"batch run {r}: sync {n / sync_s:.0f}/s batch {n / batch_s:.0f}/s "
            f"cost/1k sync ${sync_cost:.5f} batch ${batch_cost:.5f}")
    return [
        summary(f"batch tier, {n:,} documents: idem-etl throughput in batch mode ÷ synchronous mode", ratios, "≥ 1.0",
                met=lambda v: v >= 1.0, note="synchronous: FakeLLM without latency, ETL_MAX_IN_FLIGHT=64; batch: "
                "etl.testing.batch_server answering at once; both timed from start to the last commit"),
        summary("  synchronous throughput (instant in-process model)", rates["sync"], "", "msgs/s"),
        summary("  batch-mode throughput (batches answered at once)", rates["batch"], "", "msgs/s"),
        summary("  cost per 1,000 documents, synchronous ($0.15/$0.60 per Mtok)", costs["sync"], "", "USD"),
        summary("  cost per 1,000 documents, batch (discount 0.5)", costs["batch"], "", "USD"),
    ]


async def _run_and_close(runner: Any) -> Any:
    try:
        return await runner.run()
    finally:
        await runner.llm.aclose()


def confusable_pairs(rows: list[dict[str, str]], share: float = 0.16) -> list[tuple[str, str]]:
    """banking77's most confused intents, from the data: a 3-fold cross-validated TF-IDF (word 1-2
    grams) + logistic regression's confusions, counted per unordered pair; the top pairs taken
    greedily (a label in one pair at most) until their labels hold ``share`` of the texts."""
    from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: PLC0415
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.model_selection import cross_val_predict  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    texts, gold = [r["text"] for r in rows], [r["category"] for r in rows]
    predicted = cross_val_predict(make_pipeline(TfidfVectorizer(ngram_range=(1, 2)), LogisticRegression(max_iter=1000)),
                                  texts, gold, cv=3)
    confused = Counter(tuple(sorted((g, p))) for g, p in zip(gold, predicted.tolist(), strict=True) if g != p)
    sizes, pairs, used = Counter(gold), [], set()
    for (a, b), _ in confused.most_common():
        if sum(sizes[label] for label in used) >= share * len(rows):
            break
        if a not in used and b not in used:
            pairs.append((a, b))
            used |= {a, b}
    return pairs


def router_figures(golden_n: int = 1000, accuracy: float = 0.92) -> list[Figure]:
    """The router on banking77: a Classify stage over the 10,003 training texts (every one an LLM
    call), a golden set of ``golden_n`` of them, ``distill``, then the 3,080 test texts as new
    documents; per error model of the simulated LLM (right on ``accuracy`` of the texts either way)."""
    import csv  # noqa: PLC0415
    import random  # noqa: PLC0415

    from etl.quality.golden import import_golden  # noqa: PLC0415
    from etl.quality.router import distill  # noqa: PLC0415

    data = ROOT / "examples/data"
    train, test = ([*csv.DictReader((data / f"banking77_{split}.csv").open())] for split in ("train", "test"))
    labels = json.loads((data / "banking77_categories.json").read_text())
    gold = {r["text"]: r["category"] for r in train + test}
    stage = Classify(labels, "Classify the banking customer's intent.", name="intent", router=Router())
    prices = (0.15, 0.60)
    tokens = (round((len(stage.system_prompt()) + statistics.mean(len(r["text"]) for r in train)) / 4), 8)
    per_call = (tokens[0] * prices[0] + tokens[1] * prices[1]) / 1e6
    pairs = confusable_pairs(train)
    log(f"router: confusable pairs {pairs}")

    def pipeline(llm: FakeLLM, split: str = "", rows: Iterable[dict[str, str]] = ()) -> Pipeline:
        docs = [{"id": f"{split}-{i}", "text": r["text"]} for i, r in enumerate(rows)]
        return Pipeline("banking77", ListSource(docs), [stage], llm=llm)

    out = []
    for errors, partners in (("random", None), ("confusable", {**dict(pairs), **{b: a for a, b in pairs}})):
        answer = simulated_labeller(gold, labels, accuracy, partners=partners)
        llm = FakeLLM(answer, tokens=tokens, price_per_mtok=prices)
        url = fresh_schema()
        engine = create_engine(url)
        asyncio.run(run_pipeline(pipeline(llm, "train", train), Settings(), store_url=url))
        golden = random.Random(0).sample(list(enumerate(train)), golden_n)
        import_golden(engine, "banking77", "intent", [
            {"doc_key": f"train-{i}", "tenant": "default", "content": r["text"], "expected": {"label": r["category"]}}
            for i, r in golden])
        t0 = time.perf_counter()
        (made,) = distill(engine, pipeline(llm), llm, "intent")
        distill_s, gate = time.perf_counter() - t0, made.row
        log(f"router {errors}: distill {made.status} in {distill_s:.1f} s: {made.reason}")
        before = len(llm.calls)
        stats = asyncio.run(run_pipeline(pipeline(llm, "test", test), Settings(), store_url=url))
        calls = len(llm.calls) - before
        with engine.connect() as conn:
            got = dict(conn.execute(text("SELECT doc_key, output FROM stage_results WHERE doc_key LIKE 'test-%'"))
                       .all())
            spent = float(conn.execute(text("SELECT coalesce(sum(cost), 0) FROM llm_calls "
                                            "WHERE doc_key LIKE 'test-%' AND outcome <> 'cache_hit'")).scalar_one())
        engine.dispose()
        truth = [r["category"] for r in test]
        routed = [got[f"test-{i}"]["label"] for i in range(len(test))]
        alone = [answer(LLMRequest([{"role": "user", "content": r["text"]}], stage.llm_schema()))["label"]
                 for r in test]
        agree = lambda a, b: sum(x == y for x, y in zip(a, b, strict=True)) / len(test)  # noqa: E731
        routed_acc, alone_acc = agree(routed, truth), agree(alone, truth)
        log(f"router {errors}: test run {calls} LLM calls (stats {stats.llm_calls}), {stats.student_answers} student "
            f"answers; accuracy routed {routed_acc:.3f}, LLM alone {alone_acc:.3f}; cost ${spent:.6f} "
            f"(calls × price ${calls * per_call:.6f})")
        random_errors = partners is None
        note = f"the LLM is wrong on {1 - accuracy:.0%} of the texts: " + (
            "random texts, with a random other label. Classify over the 77 intents with Router() (shadow_rate "
            f"{stage.router.shadow_rate}); the {len(train):,} training texts answered by the LLM, {golden_n:,} of "
            "them (seed 0) imported as the golden set, `distill`, then the test texts as new documents. FakeLLM "
            f"priced as a hosted small model (gpt-4o-mini list price, ${prices[0]:.2f}/${prices[1]:.2f} per Mtok) at "
            f"{tokens[0]} tokens in (the system prompt with all 77 labels plus the average text, at ~4 characters "
            f"per token) and {tokens[1]} out. One run: the data and the simulated LLM are deterministic"
            if random_errors else
            "only texts of banking77's most confused intent pairs, which get their partner (so about half of "
            "those): " + ", ".join(f"{a} ↔ {b}" for a, b in pairs) + "; pairs from a 3-fold cross-validated "
            "TF-IDF + logistic regression on the training split, taken greedily until they hold ≥ 16% of the texts"
        ) + f". distill: {made.status}: {made.reason}; trained on {gate['trained_on']:,} LLM answers (fit " \
            f"{gate['train_s']} s)"
        out += [
            summary(f"router, {errors} LLM errors: LLM calls per new document ({len(test):,} banking77 test texts)",
                    [calls / len(test)], "≤ 0.25 at accuracy ≥ the LLM's alone" if random_errors else "",
                    "calls/doc", met=(lambda v, ok=routed_acc >= alone_acc: v <= 0.25 and ok) if random_errors else None,
                    note=note),
            summary("  accuracy vs gold, routed (the student where sure, else the LLM)", [routed_acc], "", "share"),
            summary("  accuracy vs gold, the LLM alone (its answers to every test text)", [alone_acc], "", "share"),
            summary("  routed results' agreement with the LLM's answers", [agree(routed, alone)], "", "share"),
            summary("  new documents answered by the student (shadow checks go to the LLM)",
                    [stats.student_answers / len(test)], "", "share"),
            summary("  cost per 1,000 new documents, routed", [spent / len(test) * 1000], "", "USD"),
            summary("  cost per 1,000 new documents, the LLM alone", [per_call * 1000], "", "USD"),
            summary("  distill: train, certify and store the student", [distill_s], "", "s"),
            summary("  gate: confidence threshold", [gate["threshold"] or math.nan], "", "confidence"),
            summary("  gate: golden accuracy's 95% lower bound at the threshold", [gate["lower_bound"]],
                    f"≥ {gate['target']:.3f} (the LLM's golden accuracy − 0.01)", "share",
                    met=lambda v, target=gate["target"]: v >= target),
            summary("  gate: golden coverage at the threshold", [gate["covered"] / gate["certified_on"]], "",
                    "share"),
        ]
    return out

SECTIONS = {"replay": replay_figures, "cold": cold_figures, "dedup": dedup_figures,
            "constrained": constrained_figures, "memory": memory_figures, "batch": batch_figures,
            "router": router_figures, "store": store_figures, "quix": quix_figures,
            "capacity": capacity_figures, "long": lambda: __import__("bench.long_docs").long_docs.figures(RUNS)}


def main() -> None:
    configure("error")
    saved = ROOT / "bench" / "results"
    saved.mkdir(exist_ok=True)
    for name in sys.argv[1:] or list(SECTIONS):
        log(f"== {name}")
        started, t0 = datetime.now(timezone.utc), time.perf_counter()
        figures = SECTIONS[name]()
        (saved / f"{name}.json").write_text(json.dumps({
            "started": f"{started:%Y-%m-%d %H:%M} UTC", "minutes": (time.perf_counter() - t0) / 60,
            "figures": figures}, indent=1))
    sections = {p.stem: json.loads(p.read_text()) for p in sorted(saved.glob("*.json"))}
    log(f"wrote {write(sections)}")


if __name__ == "__main__":
    main()
