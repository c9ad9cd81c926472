"""``etl run --workers N``: N worker processes in one Kafka consumer group, under a small supervisor.

Each child is an ordinary ``etl run`` of the same pipeline (so every guarantee of one worker holds
for each: leases and single-flight already hold across processes, as across machines). The
supervisor only starts, watches and stops them:

- a child that exits non-zero (crashed, killed, out of memory) is started again after a back-off
  (1 s, doubling to 30 s while it keeps failing; a minute of running resets it); five failures in a
  row within 10 s of starting end the run with that child's exit code (1 if a signal ended it), so a broken pipeline does
  not restart forever;
- a child whose loop has stopped turning (its status file or its loop older than ``ETL_STALL_S``:
  hung, or stopped with SIGSTOP) is killed and started again the same way;
- SIGTERM or SIGINT is passed to every child, which drains (``ETL_DRAIN_TIMEOUT_S``); a second
  one kills them at once (nothing uncommitted is lost: it is redelivered); children run in their
  own process group (a terminal's Ctrl+C reaches only the supervisor) and are sent SIGTERM by the
  kernel if the supervisor dies (Linux: PR_SET_PDEATHSIG). The supervisor exits 0 when every child
  drained, 3 when one hit the drain deadline (as a single worker does), 130 on a second signal;
- each child writes its counts and probes to a status file every half second; the progress line
  and the closing summary add them up. They are a view, not the record (the store's tables are): a
  crashed child's count is its last report's, at most half a second short, and a message a
  restarted child reads again (it was not committed) is counted again;
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

import typer
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
#: A child that ran this long before failing starts its back-off again from 1 s.
STEADY_S = 60.0
#: A status file older than this is a child that stopped reporting (hung): not ready.
STALE_S = 5.0
COUNTED = [f.name for f in dataclasses.fields(RunStats) if f.name not in ("started", "elapsed_s", "in_flight")]


@dataclasses.dataclass
class Child:
    number: int
    status: Path
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_failures: int = 0  # in a row, each within QUICK_S of starting
    failures: int = 0  # in a row, each within STEADY_S of starting (the back-off)
    restarts: int = 0
    start_at: float = 0.0  # when a crashed child is started again
    done: bool = False
    returncode: int | None = None
    hung: bool = False  # killed by the supervisor for not reporting
    past_deadline: bool = False  # killed by the supervisor after the drain deadline

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
    began = beat = time.monotonic()

    def start(child: Child) -> None:
        child.status.unlink(missing_ok=True)
        child.hung = False
        # Its own process group: a terminal's Ctrl+C reaches the supervisor only, which passes one
        # SIGTERM on (two would end the drain at once); it exits if the supervisor dies.
        child.process = subprocess.Popen(argv, env={**env, "ETL_WORKER": str(child.number),
                                                    "ETL_WORKER_STATUS": str(child.status),
                                                    "ETL_SUPERVISOR_PID": str(os.getpid())},
                                         stdout=subprocess.DEVNULL, process_group=0)  # logs (stderr) pass through
        child.started = time.monotonic()
        if stopping:  # a signal that came while it was being started did not reach it
            child.process.send_signal(signal.SIGTERM)
        log.info("worker_started", worker=child.number, pid=child.process.pid, restarts=child.restarts)

    def current() -> tuple[RunStats, list[dict[str, Any] | None]]:
        total = dataclasses.replace(past)
        reports = [c.report() if c.process is not None else None for c in children]
        for report in reports:
            if report is not None:
                for name in COUNTED:
                    setattr(total, name, getattr(total, name) + report["stats"][name])
        return total, reports

    def stuck(child: Child, report: dict[str, Any] | None, now: float) -> bool:
        """Its loop stopped turning: no report for ETL_STALL_S (the reporter shares the loop), or
        a report that says so. A child still starting has its own bound (ETL_STORE_RETRY_S)."""
        if report is None or report.get("final"):
            return False  # not reporting yet (imports, a restart), or done and exiting (its last flush ran)
        return time.time() - report["time"] > settings.stall_s or not report.get("alive", True)

    if metrics_port is not None:
        from etl.health import registry_metrics, serve, store_check  # noqa: PLC0415

        def alive() -> dict[str, Any]:
            # The supervisor's own loop: a stuck child is its job (killed and restarted), not the pod's.
            age = time.monotonic() - beat
            return {"ok": age < settings.stall_s, "loop_age_s": round(age, 3),
                    "workers": sum(c.process is not None and c.process.poll() is None for c in children)}

        def ready() -> dict[str, Any]:
            _, reports = current()
            now = time.time()
            fresh = [r for c, r in zip(children, reports, strict=True) if not c.done and r is not None
                     and now - r["time"] < STALE_S and r.get("alive", True)]
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
            shutil.rmtree(run_dir, ignore_errors=True)
            os._exit(130)
        stopping, kill_at = True, time.monotonic() + settings.drain_timeout_s + 5
        console.print(f"stopping: draining {count} workers (signal again to exit now)")
        for child in children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    failure: tuple[str, int] | None = None
    try:
        for child in children:
            start(child)
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=False) as progress:
            task = progress.add_task(f"{loaded.name}: starting {count} workers")
            while not all(c.done for c in children):
                now = beat = time.monotonic()
                total, reports = current()
                for child, report in zip(children, reports, strict=True):
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
                            child.past_deadline = True
                            child.process.kill()  # past the drain deadline and its own: it is stuck
                        elif not stopping and not child.hung and stuck(child, report, now):
                            child.hung = True
                            log.warning("worker_stuck", worker=child.number, pid=child.process.pid,
                                        stall_s=settings.stall_s)
                            child.process.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
                        continue
                    _ended(child, past)
                    if metrics_port is not None:
                        from prometheus_client import multiprocess  # noqa: PLC0415

                        multiprocess.mark_process_dead(child.process.pid)
                    child.returncode, child.process = code, None
                    if code == 0 or stopping:
                        child.done = True
                        continue
                    ran = now - child.started
                    child.quick_failures = child.quick_failures + 1 if ran < QUICK_S else 0
                    child.failures = child.failures + 1 if ran < STEADY_S else 1
                    if child.quick_failures >= GIVE_UP_AFTER:
                        failure = (f"worker {child.number} failed {GIVE_UP_AFTER} times in a row within {QUICK_S:g} s "
                                   f"of starting (exit {code}): see its log above", code if code > 0 else 1)
                        on_signal(signal.SIGTERM, None)
                        child.done = True
                        continue
                    child.restarts += 1
                    backoff = min(MAX_BACKOFF_S, 2.0 ** (child.failures - 1))
                    child.start_at = now + backoff
                    log.warning("worker_exited", worker=child.number, returncode=code, hung=child.hung,
                                restart_in_s=backoff)
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
        fail(*failure)
    code = exit_code(children)
    if code:
        raise typer.Exit(code)


def exit_code(children: list[Child]) -> int:
    """The run's exit status from its children's: 3 when one hit the drain deadline (its own, exit 3,
    or the supervisor's kill after it), else a child's failure during the drain, else 0. A child
    ended by the SIGTERM itself (it had not yet set its handler: nothing read) drained."""
    codes = [c.returncode for c in children if c.returncode is not None]
    if any(c.past_deadline or c.returncode == 3 for c in children):
        return 3
    return next((code if code > 0 else 1 for code in codes if code not in (0, -signal.SIGTERM)), 0)


def _ended(child: Child, past: RunStats) -> None:
    """A child's last report, added to the totals of ended runs (its file is then gone, so a
    restarted child's counts start again from 0 and nothing is counted twice)."""
    report = child.report()
    if report is not None:
        for name in COUNTED:
            setattr(past, name, getattr(past, name) + report["stats"][name])
    child.status.unlink(missing_ok=True)
