"""Quix Streams side by side: the same pipeline written by hand in Quix (bench/quix_app.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from kafka import KafkaConsumer, TopicPartition

from etl.testing import FakeLLM, lognormal

from bench.common import (
    Figure, KAFKA, MEAN_S, MEDIAN_S, REPLAY_IN_FLIGHT, ROOT, RUNS, SIGMA, fresh_schema, log, new_topic, produce,
    run_idem, summary, tickets,
)


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
