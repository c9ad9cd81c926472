"""Capacity: CPU of worker, PostgreSQL and broker per 1,000 documents."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from etl import KafkaSource, Pipeline
from etl.runtime.wiring import build_runner
from etl.settings import Settings
from etl.testing import FakeLLM

from bench.common import (
    Figure, KAFKA, REPLAY_IN_FLIGHT, RUNS, STAGE, fresh_schema, log, new_topic, produce, summary, tickets,
)


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
