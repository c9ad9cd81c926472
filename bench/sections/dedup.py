"""Duplicates across workers: one model call per unique content, however many copies and workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text

from bench.common import Figure, KAFKA, ROOT, RUNS, fresh_schema, log, new_topic, produce, summary, tickets


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
