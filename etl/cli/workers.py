"""``etl run --workers N``: N worker processes in one Kafka consumer group, under a small supervisor.

Each child is an ordinary ``etl run`` of the same pipeline (so every guarantee of one worker holds
for each: leases and single-flight already hold across processes, as across machines). The
supervisor only starts, watches and stops them:

- a child that exits non-zero (crashed, killed, out of memory) is started again after a back-off
  (1 s, doubling to 30 s while it keeps failing within 10 s of starting; five such in a row end the
  run with its exit code, so a broken pipeline does not restart forever);
- SIGTERM or SIGINT is passed to every child, which drains (``ETL_DRAIN_TIMEOUT_S``); a second
  one kills them at once (nothing uncommitted is lost: it is redelivered); children run in their
  own process group (a terminal's Ctrl+C reaches only the supervisor) and are sent SIGTERM by the
  kernel if the supervisor dies (Linux: PR_SET_PDEATHSIG);
- each child writes its counts and probes to a status file every half second; the progress line
  and the closing summary add them up (a crashed child's count is its last report's: at most half a
  second short; the store's tables are the record);
- with ``--metrics-port`` the supervisor serves the probes and every child's metrics (labelled
  ``worker``) on that one port.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from etl.cli.support import console, fail, safe_url, summary
from etl.errors import EtlError
from etl.log import configure, get_logger
from etl.runtime.stats import RunStats
from etl.settings import Settings

log = get_logger(__name__)
#: A child that fails within this many seconds of starting counts toward giving up.
QUICK_S = 10.0
GIVE_UP_AFTER = 5
MAX_BACKOFF_S = 30.0
#: A status file older than this is a child that stopped reporting (hung): not ready.
STALE_S = 5.0
COUNTED = [f.name for f in dataclasses.fields(RunStats) if f.name not in ("started", "elapsed_s", "in_flight")]


@dataclasses.dataclass
class Child:
    number: int
    status: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_failures: int = 0
    restarts: int = 0
    start_at: float = 0.0  # when a crashed child is started again
    done: bool = False
    returncode: int | None = None

    def report(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.status.read_text(encoding="utf-8"))  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None


def supervise(pipeline: str, db: str | None, metrics_port: int | None, stop_when_idle: float | None,
              batch: bool, count: int) -> None:
    from connectors.sources.kafka import KafkaSource  # noqa: PLC0415
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.runtime.wiring import database_url  # noqa: PLC0415

    settings = Settings()
    configure(settings.log_level, settings.log_json)
    metrics_port = metrics_port if metrics_port is not None else settings.metrics_port
    try:
        loaded = load_pipeline(pipeline)
        url = db or database_url(loaded, settings)
    except EtlError as exc:
        fail(str(exc))
    if not isinstance(loaded.source, KafkaSource):
        fail(f"--workers {count}: pipeline {loaded.name!r} reads {type(loaded.source).__name__}; worker processes "
             "share a Kafka consumer group's partitions, a file is read by one worker: drop --workers")
    run_dir = Path(tempfile.mkdtemp(prefix="etl-workers-"))
    env = {k: v for k, v in os.environ.items() if k not in ("ETL_METRICS_PORT", "ETL_WORKER", "ETL_WORKER_STATUS")}
    if db:
        env["ETL_DATABASE_URL"] = db  # not on the command line, where `ps` shows it
    if metrics_port is not None:
        (run_dir / "metrics").mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(run_dir / "metrics")
    argv = [sys.executable, "-m", "etl.cli", "run", pipeline,
            *(["--stop-when-idle", str(stop_when_idle)] if stop_when_idle is not None else []),
            *(["--batch"] if batch else [])]
    children = [Child(n, run_dir / f"worker-{n}.json") for n in range(count)]
    stopping, kill_at = False, float("inf")
    past = RunStats()  # the counts of children's ended runs (a restarted child starts again from 0)
    began = time.monotonic()

    def start(child: Child) -> None:
        child.status.unlink(missing_ok=True)
        # Its own process group: a terminal's Ctrl+C reaches the supervisor only, which passes one
        # SIGTERM on (two would end the drain at once); it exits if the supervisor dies.
        child.process = subprocess.Popen(argv, env={**env, "ETL_WORKER": str(child.number),
                                                    "ETL_WORKER_STATUS": str(child.status),
                                                    "ETL_SUPERVISOR_PID": str(os.getpid())},
                                         stdout=subprocess.DEVNULL, process_group=0)  # logs (stderr) pass through
        child.started = time.monotonic()
        log.info("worker_started", worker=child.number, pid=child.process.pid, restarts=child.restarts)

    def current() -> tuple[RunStats, list[dict[str, Any] | None]]:
        total = dataclasses.replace(past)
        reports = [c.report() if c.process is not None else None for c in children]
        for report in reports:
            if report is not None:
                for name in COUNTED:
                    setattr(total, name, getattr(total, name) + report["stats"][name])
        return total, reports

    if metrics_port is not None:
        from etl.health import registry_metrics, serve, store_check  # noqa: PLC0415

        def alive() -> dict[str, Any]:
            return {"ok": True, "workers": sum(c.process is not None and c.process.poll() is None for c in children)}

        def ready() -> dict[str, Any]:
            _, reports = current()
            now = time.time()
            fresh = [r for c, r in zip(children, reports, strict=True) if not c.done and r is not None
                     and now - r["time"] < STALE_S]
            running = [c for c in children if not c.done]
            return {"ok": bool(fresh) and len(fresh) == len(running) and any(r["assigned"] for r in fresh)
                    and not stopping, "workers_reporting": len(fresh), "workers": len(running),
                    "partitions_assigned": any(r["assigned"] for r in fresh), "draining": stopping}

        try:
            serve(metrics_port, settings.metrics_host, alive, ready, store_check(url), registry_metrics)
        except OSError as exc:
            fail(f"cannot serve probes on {settings.metrics_host}:{metrics_port}: {exc.strerror or exc}")

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping, kill_at
        if stopping:  # the second: at once
            for child in children:
                if child.process is not None and child.process.poll() is None:
                    child.process.kill()
            os._exit(130)
        stopping, kill_at = True, time.monotonic() + settings.drain_timeout_s + 5
        console.print(f"stopping: draining {count} workers (signal again to exit now)")
        for child in children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    failure: str | None = None
    try:
        for child in children:
            start(child)
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=False) as progress:
            task = progress.add_task(f"{loaded.name}: starting {count} workers")
            while not all(c.done for c in children):
                now = time.monotonic()
                for child in children:
                    if child.done:
                        continue
                    if child.process is None:
                        if stopping:
                            child.done = True
                        elif now >= child.start_at:
                            start(child)
                        continue
                    code = child.process.poll()
                    if code is None:
                        if now > kill_at:
                            child.process.kill()  # past the drain deadline and its own: it is stuck
                        continue
                    _ended(child, past)
                    if metrics_port is not None:
                        from prometheus_client import multiprocess  # noqa: PLC0415

                        multiprocess.mark_process_dead(child.process.pid)
                    child.returncode, child.process = code, None
                    if code == 0 or stopping:
                        child.done = True
                        continue
                    quick = now - child.started < QUICK_S
                    child.quick_failures = child.quick_failures + 1 if quick else 0
                    if child.quick_failures >= GIVE_UP_AFTER:
                        failure = (f"worker {child.number} failed {GIVE_UP_AFTER} times within {QUICK_S:g} s of "
                                   f"starting (exit {code}): see its log above")
                        on_signal(signal.SIGTERM, None)
                        child.done = True
                        continue
                    child.restarts += 1
                    backoff = min(MAX_BACKOFF_S, 2.0 ** max(0, child.quick_failures - 1))
                    child.start_at = now + backoff
                    log.warning("worker_exited", worker=child.number, returncode=code, restart_in_s=backoff)
                total, _ = current()
                elapsed = max(1e-9, time.monotonic() - began)
                up = sum(c.process is not None for c in children)
                progress.update(task, description=(
                    f"{loaded.name}: {up}/{count} workers · {total.messages} docs · {total.messages / elapsed:.1f} "
                    f"docs/s · hit rate {total.hit_rate:.0%} · LLM calls {total.llm_calls} · dead letters "
                    f"{total.dead_letters} · restarts {sum(c.restarts for c in children)}"))
                time.sleep(0.2)
    finally:
        for child in children:
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    past.elapsed_s = time.monotonic() - began
    summary(f"{loaded.name} ({count} workers, {sum(c.restarts for c in children)} restarts)", safe_url(url), past)
    if failure is not None:
        fail(failure)


def _ended(child: Child, past: RunStats) -> None:
    """A child's last report, added to the totals of ended runs (its file is then gone, so a
    restarted child's counts start again from 0 and nothing is counted twice)."""
    report = child.report()
    if report is not None:
        for name in COUNTED:
            setattr(past, name, getattr(past, name) + report["stats"][name])
    child.status.unlink(missing_ok=True)
