"""Worker processes: the cold path at a total concurrency of 256 with ``etl run --workers K``
(ETL_MAX_IN_FLIGHT = 256 ÷ K each), K = 1, 2, 4, ÷ the same with one worker, and ÷ the ideal.
Each run is the real CLI on a fresh topic and schema; throughput is the steady state (10%–90% of the
results by their commit times), start-up (imports, joining the group) left out."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from sqlalchemy import create_engine, text

from bench.common import (
    KAFKA, MEAN_S, MEDIAN_S, ROOT, RUNS, Figure, fresh_schema, log, new_topic, produce, steady_rate, summary, tickets,
)

CONCURRENCY = 256


def _rate(url: str, n: int) -> float:
    engine = create_engine(url)
    with engine.connect() as conn:
        commits = conn.execute(text("SELECT extract(epoch FROM updated_at), count(*) FROM stage_results "
                                    "GROUP BY 1 ORDER BY 1")).all()
    engine.dispose()
    marks, done = [], 0
    for at, count in commits:
        done += count
        marks.append((float(at), done))
    return steady_rate(marks, n)


def workers_figures() -> list[Figure]:
    n = int(12.0 * CONCURRENCY / MEAN_S)  # about 12 s of ideal work per run
    ideal = CONCURRENCY / MEAN_S
    rates: dict[int, list[float]] = {1: [], 2: [], 4: []}
    cpu: dict[int, list[float]] = {1: [], 2: [], 4: []}
    for r in range(RUNS):
        for count in sorted(rates, key=lambda k: (k + r) % 3):  # a different order each run
            topic, url = new_topic(), fresh_schema()
            produce(topic, tickets(n, seed=7000 + 10 * r + count))
            env = {**os.environ, "ETL_DATABASE_URL": url, "ETL_KAFKA_BOOTSTRAP": KAFKA, "BENCH_TOPIC": topic,
                   "BENCH_LATENCY_S": str(MEDIAN_S), "ETL_MAX_IN_FLIGHT": str(CONCURRENCY // count),
                   "ETL_KAFKA_SESSION_TIMEOUT_MS": "6000"}
            subprocess.run([sys.executable, "-m", "etl.cli", "db", "upgrade"], env=env, check=True, capture_output=True)
            before = os.times()
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "etl.cli", "run", str(ROOT / "bench" / "pipeline.py"), "--workers",
                            str(count), "--stop-when-idle", "4"], env=env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=600)
            wall = time.perf_counter() - started
            after = os.times()
            used = (after.children_user - before.children_user) + (after.children_system - before.children_system)
            rates[count].append(_rate(url, n))
            cpu[count].append(used / wall)
            log(f"workers={count} run {r}: steady {rates[count][-1]:.0f}/s (ideal {ideal:.0f}/s), "
                f"{used / wall:.2f} cores busy over {wall:.1f} s")
    out = [summary(f"cold path, concurrency {CONCURRENCY}, best of 1/2/4 workers ÷ ideal",
                   [max(rates[k][r] for k in rates) / ideal for r in range(RUNS)], "≥ 0.9", met=lambda v: v >= 0.9,
                   note=f"ideal = {CONCURRENCY} ÷ {MEAN_S * 1000:.0f} ms = {ideal:.0f} msgs/s; {n:,} msgs per run")]
    for count in (2, 4):
        out.append(summary(f"  workers {count} ÷ 1 worker, concurrency {CONCURRENCY} in all",
                           [a / b for a, b in zip(rates[count], rates[1], strict=True)], ""))
    for count in rates:
        out.append(summary(f"  {count} worker(s): steady throughput", rates[count], "", "msgs/s"))
        out.append(summary(f"  {count} worker(s): cores busy (children's CPU time ÷ wall time)", cpu[count], ""))
    return out
