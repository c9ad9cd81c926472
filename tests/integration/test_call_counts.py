"""Every count of model calls a user budgets or alerts on — the run's summary, `etl status`, the
`/metrics` counters — equals what the model itself received: shared calls (single-flight in one
worker, claims across two), retries, repairs and failures, synchronous and batch (issue 26)."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from sqlalchemy import create_engine

from connectors.store.report import status
from etl import Classify, Extract, Pipeline, run_pipeline
from etl.testing import BatchServer
from etl.testing import FaultServer
from etl.llm.openai_compat import OpenAICompatibleLLM
from etl.metrics import Metrics
from etl.runtime.stats import RunStats
from etl.runtime.wiring import build_runner
from etl.settings import Settings
from etl.errors import TransientLLMError
from etl.testing import FakeLLM, ListSource
from tests.helpers import rows

LABELS = ["billing", "technical", "account", "other"]


class Ticket(BaseModel):
    summary: str
    amount: float


def corpus() -> list[dict[str, str]]:
    """20 copies of one text (one call per stage between them), a retried, a repaired and a failing
    document (3 copies each), and 10 ordinary ones."""
    texts = ["my card was charged twice"] * 20
    for directive in ("[fault:500x1]", "[fault:invalid_once]", "[fault:invalid]"):
        texts += [f"{directive} the app crashes when I log in"] * 3
    texts += [f"ticket {i}: please close account {i}" for i in range(10)]
    return [{"id": f"d{i:02d}", "tenant": "acme", "text": text} for i, text in enumerate(texts)]


def pipeline(url: str, llm: OpenAICompatibleLLM) -> Pipeline:
    return Pipeline("counts", ListSource(corpus()), [
        Classify(LABELS, "Route the ticket.", name="route"),
        Extract(Ticket, "Summarise it.", name="ticket"),
    ], store=url, llm=llm)


def model(server: FaultServer) -> OpenAICompatibleLLM:
    return OpenAICompatibleLLM(server.url, "fault-model", api_key="test")


def attempts_in_metrics(registry: CollectorRegistry) -> int:
    """etl_llm_calls_total summed over every outcome but cache hits (which are no model call)."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "etl_llm_calls_total" and sample.labels["outcome"] != "cache_hit":
                total += sample.value
    return int(total)


def attempts_in_status(url: str) -> int:
    """The attempts column of `etl status`'s calls table (what the command prints)."""
    engine = create_engine(url)
    try:
        return sum(int(row["attempts"]) for row in status(engine, "counts")["calls"])
    finally:
        engine.dispose()


def attempts_in_store(url: str) -> int:
    return rows(url, "SELECT count(*) FROM llm_calls WHERE outcome <> 'cache_hit'")[0][0]  # type: ignore[no-any-return]


async def test_one_worker_counts_each_model_attempt_once(store_url: str) -> None:
    registry = CollectorRegistry()
    with FaultServer() as server:
        stats = await run_pipeline(pipeline(store_url, model(server)), Settings(max_in_flight=64),
                                   metrics=Metrics("counts", registry))
        received = server.requests
    # 14 contents: Classify once each, + the 500's retry, + the repair, + the failing one's repair;
    # Extract for the 13 that are classified. The model's own count, whatever the copies.
    print(f"\nmodel received {received}; summary {stats.llm_calls}; metrics {attempts_in_metrics(registry)}; "
          f"status {attempts_in_status(store_url)}; store {attempts_in_store(store_url)}")
    assert received == 14 + 3 + 13
    assert stats.llm_calls == attempts_in_metrics(registry) == attempts_in_status(store_url) == \
        attempts_in_store(store_url) == received
    assert stats.dead_letters == 3


async def test_two_workers_sharing_calls_through_claims_add_up_to_the_model_count(store_url: str) -> None:
    """Two runners on one store, each reading every document: slow answers and a transient fault
    on every fifth call, so each finds the other's claims held and waits, or takes over."""
    llm = FakeLLM(latency_s=0.2, fault=lambda _, n: TransientLLMError("503") if n % 5 == 0 else None)
    registries = [CollectorRegistry(), CollectorRegistry()]
    # the same texts as other documents, in the other order: each worker claims some keys first
    second = [{**doc, "id": f"b-{doc['id']}"} for doc in reversed(corpus())]
    runs: list[RunStats] = await asyncio.gather(*(
        run_pipeline(Pipeline("counts", ListSource(docs), [
            Classify(LABELS, "Route the ticket.", name="route"),
            Extract(Ticket, "Summarise it.", name="ticket"),
        ], store=store_url), Settings(max_in_flight=16), llm=llm, metrics=Metrics("counts", registry))
        for docs, registry in zip((corpus(), second), registries, strict=True)))
    summaries = [run.llm_calls for run in runs]
    metrics = sum(attempts_in_metrics(registry) for registry in registries)
    print(f"\nmodel received {len(llm.calls)}; summaries {summaries}; metrics {metrics}; "
          f"status {attempts_in_status(store_url)}")
    assert min(summaries) > 0  # both workers called the model
    assert sum(summaries) == metrics == attempts_in_status(store_url) == attempts_in_store(store_url) == len(llm.calls)


async def test_batch_mode_counts_each_line_once(store_url: str) -> None:
    registry = CollectorRegistry()
    with BatchServer(polls=1) as server:
        llm = OpenAICompatibleLLM(server.url, "batch-model", api_key="test")
        runner = build_runner(pipeline(store_url, llm), Settings(batch_poll_s=0.05), batch=True,
                              metrics=Metrics("counts", registry))
        try:
            stats = await runner.run()
        finally:
            await runner.llm.aclose()
        received: Any = server.lines_received
    print(f"\nbatch lines received {received}; summary {stats.llm_calls}; metrics {attempts_in_metrics(registry)}")
    assert stats.llm_calls == attempts_in_metrics(registry) == attempts_in_status(store_url) == \
        attempts_in_store(store_url) == received
