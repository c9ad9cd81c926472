"""The ``etl`` command: run a pipeline, show status, migrate the store."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from etl.cli.access import register as register_access
from etl.cli.batches import register as register_batches
from etl.cli.quality import register as register_quality
from etl.cli.retention import register as register_retention
from etl.cli.router import register as register_router
from etl.cli.support import DbOption, PipelineArg, console, out, summary, table_of
from etl.cli.support import fail as _fail
from etl.cli.support import safe_url as _safe
from etl.errors import EtlError
from etl.log import configure
from etl.settings import Settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="idem-etl: idempotent LLM batch ETL.")
db_app = typer.Typer(no_args_is_help=True, help="The store's schema.")
app.add_typer(db_app, name="db")
dlq_app = typer.Typer(no_args_is_help=True, help="Quarantined messages: list them, replay them after a fix.")
app.add_typer(dlq_app, name="dlq")


@app.command()
def run(
    pipeline: PipelineArg,
    db: DbOption = None,
    metrics_port: Annotated[int | None, typer.Option(
        help="Serve /healthz, /readyz and /metrics on this port (ETL_METRICS_PORT; host: ETL_METRICS_HOST, "
             "default 127.0.0.1).")] = None,
    stop_when_idle: Annotated[float | None, typer.Option(
        help="Stop once no message arrived for this many seconds while this worker holds partitions (Kafka sources never end by themselves).")] = None,
    batch: Annotated[bool, typer.Option("--batch", help=(
        "Send model calls through the provider's Batch API (half price, answers within 24 h); "
        "killed and run again, it resumes the batches it sent."))] = False,
    workers: Annotated[str, typer.Option(help=(
        "Worker processes in the consumer group (Kafka sources): a number, or auto (one per core). A crashed "
        "one is restarted; SIGTERM drains them all."))] = "1",
) -> None:
    """Run PIPELINE until its source ends (files) or a signal (Kafka). Re-running is free: processed
    documents are no-ops. SIGTERM/SIGINT drain in-flight work and commit within ETL_DRAIN_TIMEOUT_S
    (30 s); a second one, or the deadline, exits at once (what was not committed is redelivered)."""
    count = _workers(workers)
    if count > 1:
        from etl.cli.workers import supervise  # noqa: PLC0415

        supervise(pipeline, db, metrics_port, stop_when_idle, batch, count)
        return
    _run(pipeline, db, metrics_port, stop_when_idle, replay=False, since=None, batch=batch)


def _workers(given: str) -> int:
    if given == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        count = int(given)
    except ValueError:
        count = 0
    if not 1 <= count <= 256:
        _fail(f"--workers {given!r}: give a number from 1 to 256, or auto")
    return count


@app.command()
def replay(
    pipeline: PipelineArg,
    db: DbOption = None,
    since: Annotated[datetime | None, typer.Option(help="Replay from this time instead of offset 0.")] = None,
) -> None:
    """Re-read PIPELINE's Kafka topic from offset 0 (or --since) to its current end, outside the
    consumer group. Everything already processed is a no-op: expect 0 LLM calls and 0 new rows."""
    _run(pipeline, db, None, None, replay=True, since=since)


@dlq_app.command("list")
def dlq_list(
    reason: Annotated[str | None, typer.Option(help="Only this reason (bad_input, schema_invalid, ...).")] = None,
    pipeline: Annotated[str | None, typer.Option(help="Only this pipeline (by name).")] = None,
    db: DbOption = None,
    limit: Annotated[int, typer.Option(help="Rows to show.")] = 50,
) -> None:
    """Open dead letters, newest first, with their typed reason."""
    from connectors.store import make_engine  # noqa: PLC0415
    from connectors.store.report import open_dead_letters  # noqa: PLC0415

    url = db or Settings().database_url.get_secret_value()
    try:
        found, total = open_dead_letters(make_engine(url), pipeline, reason, limit)
    except Exception as exc:  # noqa: BLE001
        _fail(f"cannot read {_safe(url)}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    table = Table(title=f"{total} open dead letter(s)" + (f" with reason {reason}" if reason else ""),
                  title_justify="left")
    for column in ("id", "pipeline", "reason", "stage", "tenant", "doc_key", "position", "detail"):
        table.add_column(column)
    for row in found:
        table.add_row(str(row["id"]), row["pipeline"], row["reason"], row["stage"] or "", row["tenant"] or "",
                      row["doc_key"] or "", f"{row['stream']}:{row['partition']}:{row['message_offset']}",
                      row["detail"][:80])
    out.print(table)


@dlq_app.command("replay")
def dlq_replay(
    pipeline: PipelineArg,
    reason: Annotated[str | None, typer.Option(help="Only this reason.")] = None,
    db: DbOption = None,
) -> None:
    """Reprocess PIPELINE's open dead letters with the pipeline as it is now (after a prompt or schema
    fix, or once a provider is back). A replayed item that succeeds leaves quarantine exactly once;
    one that fails again stays, with its latest reason."""
    _run(pipeline, db, None, None, replay=False, since=None, dead_letters=reason or "")


def _run(pipeline: str, db: str | None, metrics_port: int | None, stop_when_idle: float | None, *,
         replay: bool, since: datetime | None, dead_letters: str | None = None, batch: bool = False) -> None:
    from etl.health import Probe, registry_metrics, serve, store_check  # noqa: PLC0415
    from etl.metrics import Metrics  # noqa: PLC0415
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.runtime.wiring import build_runner, database_url, replay_source  # noqa: PLC0415

    settings = Settings()
    configure(settings.log_level, settings.log_json)
    metrics_port = metrics_port if metrics_port is not None else settings.metrics_port
    status_file = os.environ.get("ETL_WORKER_STATUS")  # a child of `etl run --workers N`: report to it
    if status_file:
        _die_with_supervisor()
    try:
        loaded = load_pipeline(pipeline)
        url = db or database_url(loaded, settings)
        if replay:
            loaded.source = replay_source(loaded, since)
        if dead_letters is not None:
            from connectors.sources.dead_letters import DeadLetterSource  # noqa: PLC0415
            from connectors.store import make_engine  # noqa: PLC0415

            loaded.source = DeadLetterSource(make_engine(url), loaded.name, dead_letters or None,
                                             loaded.source.value_format)
        probe = Probe(settings.stall_s)
        metrics = Metrics(loaded.name) if metrics_port is not None or os.environ.get("PROMETHEUS_MULTIPROC_DIR") else None
        if metrics_port is not None:
            serve(metrics_port, settings.metrics_host, probe.alive, probe.ready, store_check(url), registry_metrics)
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console, transient=False, disable=bool(status_file)) as progress:
            task = progress.add_task(f"{loaded.name}: starting")

            def show(stats: Any) -> None:
                elapsed = max(1e-9, stats_elapsed(stats))
                progress.update(task, description=(
                    f"{loaded.name}: {stats.messages} docs · {stats.messages / elapsed:.1f} docs/s · "
                    f"hit rate {stats.hit_rate:.0%} · LLM calls {stats.llm_calls} · dead letters "
                    f"{stats.dead_letters}"))

            runner = build_runner(loaded, settings, store_url=url, on_progress=show, metrics=metrics,
                                  idle_stop_s=stop_when_idle, replaying_dead_letters=dead_letters is not None,
                                  batch=batch)
            runner.probe = probe
            stats = asyncio.run(_run_until_signalled(runner, settings.drain_timeout_s, status_file))
            show(stats)
    except EtlError as exc:
        _fail(str(exc))
    except OSError as exc:  # e.g. the metrics port is taken
        _fail(f"{exc.strerror or exc}")
    if not status_file:
        summary(loaded.name, _safe(url), stats)


def stats_elapsed(stats: Any) -> float:
    return stats.elapsed_s or (time.perf_counter() - stats.started)


async def _run_until_signalled(runner: Any, drain_s: float, status_file: str | None = None) -> Any:
    """First SIGINT/SIGTERM: stop polling, finish in-flight work, commit, leave the group. Second, or
    ``drain_s`` later: exit at once — still safe, since nothing uncommitted is ever counted as done
    (it is redelivered, and a claim it held lapses after its lease)."""
    loop = asyncio.get_running_loop()
    signals = 0

    def deadline() -> None:
        console.print(f"stopping: the drain deadline ({drain_s:g} s) passed; exiting, uncommitted documents "
                      "will be redelivered")
        os._exit(3)

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            os._exit(130)
        console.print("stopping: finishing in-flight documents (signal again to exit now)")
        runner.stop()
        loop.call_later(drain_s, deadline)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    reporting = asyncio.create_task(_report_status(runner, status_file)) if status_file else None
    try:
        return await runner.run()
    finally:
        if reporting is not None:
            reporting.cancel()
            _write_status(status_file, runner, final=True)  # type: ignore[arg-type]
        await runner.llm.aclose()


def _die_with_supervisor() -> None:
    """A child of ``etl run --workers N`` is sent SIGTERM (a drain) when its supervisor dies, so no
    worker outlives it unwatched (Linux; elsewhere the supervisor's own exit path stops them)."""
    import ctypes  # noqa: PLC0415

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(os.environ.get("ETL_SUPERVISOR_PID", os.getppid())):
        os.kill(os.getpid(), signal.SIGTERM)  # it died before the line above ran


async def _report_status(runner: Any, path: str) -> None:
    """A child's counts and probes, for its supervisor: written every half second."""
    while True:
        _write_status(path, runner, final=False)
        await asyncio.sleep(0.5)


def _write_status(path: str, runner: Any, *, final: bool) -> None:
    import dataclasses  # noqa: PLC0415
    import json  # noqa: PLC0415

    probe = runner.probe
    stats = dataclasses.asdict(runner.stats)
    stats["elapsed_s"] = stats["elapsed_s"] or stats_elapsed(runner.stats)
    status = {"pid": os.getpid(), "time": time.time(), "final": final, "stats": stats,
              "assigned": bool(probe and probe.assigned), "draining": bool(probe and probe.draining),
              "alive": probe.alive()["ok"] if probe else True}
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as out_file:
        json.dump(status, out_file)
    os.replace(temporary, path)


@app.command()
def status(
    pipeline: Annotated[str | None, typer.Argument(
        help="A pipeline name, or a pipeline file/module: then Kafka lag per partition is shown too.")] = None,
    db: DbOption = None,
) -> None:
    """Documents, results per stage, long documents' chunks, grounded values, LLM calls and spend,
    dead letters, in-flight claims, stored positions (and lag, for a Kafka pipeline given as a file
    or module)."""
    from connectors.store import behind, make_engine  # noqa: PLC0415
    from connectors.store.report import status as report  # noqa: PLC0415

    settings = Settings()
    url = db or settings.database_url.get_secret_value()
    name, ends = pipeline, None
    if pipeline is not None and (pipeline.endswith(".py") or ":" in pipeline):
        from etl.pipeline import load_pipeline  # noqa: PLC0415
        from etl.runtime.wiring import database_url, topic_end_offsets  # noqa: PLC0415

        try:
            loaded = load_pipeline(pipeline)
            name, url = loaded.name, db or database_url(loaded, settings)
            ends = topic_end_offsets(loaded, settings)
        except EtlError as exc:
            _fail(str(exc))
    try:
        engine = make_engine(url)
        if (unreadable := behind(engine)) is not None:
            _fail(f"{_safe(url)}: {unreadable}")
        found = report(engine, name, ends)
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001 - any database failure is one line for the user
        _fail(f"cannot read {_safe(url)}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    if not any(found.values()):
        out.print(f"{_safe(url)}: nothing processed yet")
        return
    titles = {"documents": "Documents", "stages": "Results per stage",
              "chunks": "Long documents: chunks per tenant and stage (an unchanged chunk is a cache hit)",
              "grounding": "Extracted values found in their document's text (field_spans)",
              "calls": "LLM calls: spend and cache savings (USD) per tenant, stage, model",
              "dead_letters": "Dead letters", "in_flight": "In-flight LLM work (claims; expired ones are free to take)",
              "positions": "Stored positions and lag"}
    for name, rows in found.items():
        if rows:
            out.print(table_of(titles[name], rows))


SchemaPipelineArg = Annotated[str | None, typer.Argument(
    help="A pipeline file or module: its typed tables too (without one: the core tables only).")]


def _schema_store(pipeline: str | None, db: str | None) -> tuple[Any, Any, str]:
    """(store, typed tables, url) for ``etl db``: the pipeline's store unless --db says otherwise."""
    from connectors.store import SqlStore  # noqa: PLC0415

    settings = Settings()
    tables: Any = []
    url = db or settings.database_url.get_secret_value()
    if pipeline is not None:
        from etl.pipeline import load_pipeline  # noqa: PLC0415
        from etl.runtime.wiring import database_url  # noqa: PLC0415

        try:
            loaded = load_pipeline(pipeline)
        except EtlError as exc:
            _fail(str(exc))
        tables, url = loaded.extract_tables, db or database_url(loaded, settings)
    return SqlStore(url), tables, url


@db_app.command("plan")
def db_plan(pipeline: SchemaPipelineArg = None, db: DbOption = None) -> None:
    """Print the statements `etl db upgrade` would run (core migrations, typed-table changes), without
    making them: they run in a transaction that is rolled back (so, for its length, they hold the
    locks they take: a table being copied is not written meanwhile)."""
    store, tables, url = _schema_store(pipeline, db)
    try:
        statements = store.plan(tables)
    except Exception as exc:  # noqa: BLE001 - one line for the user
        _fail(f"cannot plan {_safe(url)}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    if not statements:
        out.print(f"{_safe(url)}: nothing to do; the schema is up to date")
        return
    out.print(f"-- {_safe(url)}: `etl db upgrade{' ' + pipeline if pipeline else ''}` would run:")
    for statement in statements:
        out.print(f"{statement};", markup=False, highlight=False, soft_wrap=True)


@db_app.command("upgrade")
def db_upgrade(pipeline: SchemaPipelineArg = None, db: DbOption = None) -> None:
    """Create or migrate the store's tables to the latest revision; with a pipeline, also its typed
    tables, type changes included (see them first with `etl db plan`)."""
    store, tables, url = _schema_store(pipeline, db)
    try:
        store.upgrade(tables)
    except Exception as exc:  # noqa: BLE001
        _fail(f"cannot migrate {_safe(url)}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    out.print(f"{_safe(url)}: schema is at the latest revision"
              + (f", typed tables of {pipeline} included" if pipeline else ""))


register_quality(app)
register_router(app)
register_retention(app)
register_access(app)
register_batches(app)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
