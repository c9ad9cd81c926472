"""What the benchmark sections share: services, topics, producers, the runs they
compare, and the figure record (a median and min–max against a baseline of the same run)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from pydantic import BaseModel
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, text

from etl import Classify, KafkaSource, Pipeline
from etl.llm.base import LLMRequest
from etl.runtime.wiring import build_runner
from etl.settings import Settings
from etl.testing import FakeLLM


ROOT = Path(__file__).resolve().parents[1]


RUNS = int(os.environ.get("BENCH_RUNS", "5"))


KAFKA = os.environ["ETL_TEST_KAFKA"]


POSTGRES = os.environ["ETL_TEST_POSTGRES_URL"]


LABELS = ["billing", "technical", "account", "other"]


MEDIAN_S, SIGMA = 0.2, 0.5


MEAN_S = MEDIAN_S * math.exp(SIGMA**2 / 2)  # the mean of that lognormal: what "ideal" divides by


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


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


def run_idem(topic: str, url: str, llm: FakeLLM, in_flight: int, client: str = "kafka-python"
             ) -> tuple[int, float, list[tuple[float, int]]]:
    """(messages, seconds, completion marks) for idem-etl reading ``topic`` from offset 0 to its end."""
    pipeline = Pipeline("bench", KafkaSource(topic, replay_from="start"), [STAGE], store=url, review=None)
    settings = Settings(kafka_bootstrap=KAFKA, max_in_flight=in_flight, flush_size=2000, kafka_client=client)
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


def run_raw_confluent(topic: str) -> tuple[int, float]:
    """The same baseline on confluent-kafka (librdkafka): assign from the beginning, consume in
    batches of 500, decode, until every partition's end offset."""
    from confluent_kafka import Consumer, TopicPartition as Partition  # noqa: PLC0415

    started = time.perf_counter()
    consumer = Consumer({"bootstrap.servers": KAFKA, "group.id": f"raw-{time.time_ns()}", "enable.auto.commit": False})
    partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
    ends = {p: consumer.get_watermark_offsets(Partition(topic, p), timeout=10)[1] for p in partitions}
    consumer.assign([Partition(topic, p, 0) for p in partitions])
    done = {p: 0 for p in partitions}
    count = 0
    while any(done[p] < ends[p] for p in partitions):
        for record in consumer.consume(num_messages=500, timeout=0.2):
            if record.error() is None:
                done[record.partition()] = record.offset() + 1
                count += 1 if json.loads(record.value()) else 0  # decode, as any consumer must
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


Figure = dict[str, Any]


def summary(name: str, values: list[float], goal: str, unit: str = "", met: Callable[[float], bool] | None = None,
            note: str = "") -> Figure:
    median = statistics.median(values)
    return {"figure": name, "median": median, "min": min(values), "max": max(values), "runs": len(values),
            "unit": unit, "goal": goal, "met": None if met is None else met(median), "note": note}


#: Replay window: two polled batches of 1,000 in flight, one looked up while the next is fetched.
REPLAY_IN_FLIGHT = 2000


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


def _setting(name: str) -> str:
    with create_engine(POSTGRES).connect() as conn:
        return str(conn.execute(text(f"SHOW {name}")).scalar_one())
