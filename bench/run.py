"""idem-etl benchmarks against real Kafka and PostgreSQL; writes bench/RESULTS.md.

Every figure is a ratio against a baseline measured in the same run (so it holds on a noisy
machine), reported as the median and min–max over RUNS runs. Run with `bash bench/run.sh`.

Each section lives in ``bench/sections/``; this is the runner and the RESULTS.md writer.
"""

from __future__ import annotations

import statistics
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from bench import long_docs
from bench.common import POSTGRES, ROOT, RUNS, log
from bench.sections import (batch, capacity, cold, constrained, dedup, memory, quix, replay, router, stability, store,
                            workers)
from etl.log import configure


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


def hosts(sections: dict[str, dict[str, Any]]) -> list[str]:
    """The machine each section ran on (as recorded with its results), one block per machine."""
    by_host: dict[tuple[str, ...], list[str]] = {}
    for name, section in sections.items():
        by_host.setdefault(tuple(section.get("machine") or machine()), []).append(name)
    if len(by_host) == 1:
        return list(next(iter(by_host)))
    lines = []
    for host, names in by_host.items():
        lines += [f"{host[0]} (sections: {', '.join(names)})", *host[1:]]
    return lines


def fmt(v: float, unit: str) -> str:
    return f"{v:,.0f}" if unit in ("msgs/s", "bytes", "rows") else f"{v:,.1f}" if unit in ("MB", "s", "ms", "µs") else \
        f"{v:.6f}" if unit == "USD" else f"{v:.3f}"


def write(sections: dict[str, dict[str, Any]]) -> Path:
    """RESULTS.md from every section's latest saved run (bench/results/<section>.json)."""
    figures = [f for name in SECTIONS if name in sections for f in sections[name]["figures"]]
    runs = ", ".join(f"{name} {s['started']} ({s['minutes']:.1f} min, "
                     f"{statistics.mode(f['runs'] for f in s['figures']) if s['figures'] else 0} runs)" for name, s in sections.items())
    lines = ["# Benchmark results", "",
             f"`bash bench/run.sh`; sections last run: {runs}. Every figure is the median and min–max over "
             "its section's runs; ratios are against a baseline measured in the same run. The router section is "
             "not a timing benchmark: one run, its data and simulated model being deterministic.", "",
             "## Machine", "", *hosts(sections), "", "## Figures", "",
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


SECTIONS = {"replay": replay.replay_figures, "cold": cold.cold_figures, "dedup": dedup.dedup_figures,
            "constrained": constrained.constrained_figures, "memory": memory.memory_figures, "batch": batch.batch_figures,
            "router": router.router_figures, "store": store.store_figures, "quix": quix.quix_figures,
            "capacity": capacity.capacity_figures, "long": lambda: long_docs.figures(RUNS),
            "workers": workers.workers_figures, "stability": stability.stability_figures}


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
            "machine": machine(), "figures": figures}, indent=1))
    sections = {p.stem: json.loads(p.read_text()) for p in sorted(saved.glob("*.json"))}
    log(f"wrote {write(sections)}")


if __name__ == "__main__":
    main()
