"""Prometheus metrics for ``etl run --metrics-port``. Labels never carry document content.

Every series is labelled with its pipeline and ``worker`` (``ETL_WORKER``: the child's number
under ``etl run --workers N``, else 0); children write them to ``PROMETHEUS_MULTIPROC_DIR`` and the
supervisor serves them merged."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from connectors.store import DocumentOutcome


class Metrics:
    """The runner's counters, updated after each store commit (so they count committed work)."""

    def __init__(self, pipeline: str, registry: CollectorRegistry = REGISTRY, worker: str | None = None) -> None:
        self.pipeline = pipeline
        self.worker = worker if worker is not None else os.environ.get("ETL_WORKER", "0")
        labels = ["pipeline", "worker"]
        self.messages = Counter("etl_messages_total", "Messages read from the source", labels, registry=registry)
        self.results = Counter("etl_results_written_total", "Stage results committed", labels, registry=registry)
        self.cache_hits = Counter("etl_cache_hits_total", "Stage runs served without a model call "
                                  "(already stored, cache, single-flight)", labels, registry=registry)
        self.llm_calls = Counter("etl_llm_calls_total", "Model attempts by outcome", [*labels, "stage", "outcome"],
                                 registry=registry)
        self.llm_latency = Histogram("etl_llm_latency_seconds", "Model call latency", [*labels, "stage"],
                                     buckets=(0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60), registry=registry)
        self.dead_letters = Counter("etl_dead_letters_total", "Dead letters by reason", [*labels, "reason"],
                                    registry=registry)
        self.in_flight = Gauge("etl_in_flight", "Documents dispatched and not yet committed", labels,
                               registry=registry, multiprocess_mode="livesum")
        self.lag = Gauge("etl_lag_messages", "End offset minus committed position", [*labels, "stream", "partition"],
                         registry=registry, multiprocess_mode="livemax")
        self._lagging: set[tuple[str, int]] = set()

    def committed(self, outcomes: Iterable[DocumentOutcome], messages: int, hits: int, in_flight: int) -> None:
        p = (self.pipeline, self.worker)
        self.messages.labels(*p).inc(messages)
        self.cache_hits.labels(*p).inc(hits)
        self.in_flight.labels(*p).set(in_flight)
        for outcome in outcomes:
            self.results.labels(*p).inc(len(outcome.results))
            if outcome.dead_letter is not None:
                self.dead_letters.labels(*p, outcome.dead_letter.reason).inc()
            for call in outcome.calls:
                self.llm_calls.labels(*p, call.stage, call.outcome).inc()
                if call.outcome != "cache_hit":
                    self.llm_latency.labels(*p, call.stage).observe(call.latency_ms / 1000)

    def set_lag(self, lag: Mapping[tuple[str, int], int]) -> None:
        """This worker's lag for the partitions it holds now; one it no longer holds (a rebalance
        gave it to another worker) reads 0 and leaves the registry (under --workers N the merged
        file keeps the 0: another worker's series carries the partition's lag)."""
        for stream, partition in self._lagging - lag.keys():
            gone = self.lag.labels(self.pipeline, self.worker, stream, str(partition))
            gone.set(0)
            self.lag.remove(self.pipeline, self.worker, stream, str(partition))
        for (stream, partition), value in lag.items():
            self.lag.labels(self.pipeline, self.worker, stream, str(partition)).set(value)
        self._lagging = set(lag)
