"""The batch tier: batch mode ÷ synchronous mode, and through a Batch API server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from etl import Classify, Pipeline
from etl.runtime.wiring import build_runner
from etl.settings import Settings
from etl.testing import FakeLLM

from bench.common import Figure, LABELS, RUNS, fresh_schema, log, summary, tickets


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
