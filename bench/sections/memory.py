"""Memory: peak RSS of a replay as the topic grows."""

from __future__ import annotations

import os

from etl.testing import FakeLLM

from bench.common import (
    Figure, KAFKA, REPLAY_IN_FLIGHT, RUNS, fresh_schema, log, new_topic, produce, rss_of_replay, run_idem,
    summary, tickets,
)


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
