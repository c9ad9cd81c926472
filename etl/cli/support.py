"""What every ``etl`` command shares: consoles, one-line errors, common options, tables."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from etl.settings import Settings

console = Console(stderr=True)
# Piped or captured output gets wide tables rather than columns cut to 80 characters.
out = Console(width=None if sys.stdout.isatty() else 200)

DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL; default: the pipeline's, then ETL_DATABASE_URL.")]
PipelineArg = Annotated[str, typer.Argument(help="path/to/pipeline.py, file.py:attr or package.module:attr")]


def fail(message: str, code: int = 1) -> NoReturn:
    """One line on stderr, the cause and what to do; no traceback."""
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def safe_url(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def table_of(title: str, rows: Sequence[dict[str, Any]]) -> Table:
    """A rich table from dict rows; floats with 6 significant decimals, numbers right-aligned."""
    table = Table(title=title, title_justify="left")
    for column in rows[0]:
        table.add_column(column, justify="right" if isinstance(rows[0][column], (int, float)) else "left")
    for row in rows:
        table.add_row(*["" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v) for v in row.values()])
    return table


def store_engine(db: str | None, pipeline: Any = None) -> tuple[Engine, str]:
    """The store at ``db`` (default: the pipeline's, then ETL_DATABASE_URL), migrated to head."""
    from connectors.store import make_engine, upgrade  # noqa: PLC0415
    from etl.runtime.wiring import database_url  # noqa: PLC0415

    url = db or database_url(pipeline, Settings())
    engine = make_engine(url)
    try:
        upgrade(engine)
    except Exception as exc:  # noqa: BLE001 - one line for the user
        fail(f"cannot open {safe_url(url)}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return engine, url


def existing_engine(url: str, doing: str) -> Engine:
    """The store at ``url`` as it is: never migrated or created (a mistyped SQLite path is refused,
    not made into an empty database). For commands that only count and delete rows."""
    from connectors.store import make_engine  # noqa: PLC0415

    location = make_url(url)
    if location.get_backend_name() == "sqlite" and not Path(location.database or "").is_file():
        fail(f"no store at {safe_url(url)}: nothing to {doing} (check --db or ETL_DATABASE_URL)")
    return make_engine(url)


def go_ahead(total: int, *, dry_run: bool, yes: bool, question: str) -> bool:
    """After a deletion's counts were shown: whether to delete now (asked on a terminal unless
    ``yes``; refused without one)."""
    if dry_run or not total:
        out.print("dry run: nothing deleted" if dry_run else "nothing to delete")
        return False
    if not yes:
        if not sys.stdin.isatty():
            fail("not a terminal to confirm on: pass --yes to delete, or --dry-run to count")
        typer.confirm(f"{question} This cannot be undone", abort=True)
    return True


def summary(name: str, url: str, stats: Any) -> None:
    """The table a run ends with."""
    table = Table(title=f"{name} → {url}", show_header=False, title_justify="left")
    rows = [
        ("documents read", f"{stats.messages}"),
        ("stage runs", f"{stats.stage_runs}"),
        ("  already stored (no-op)", f"{stats.stored_hits}"),
        ("  from cache", f"{stats.cache_hits}"),
        ("older versions (no-op)", f"{stats.older_versions}"),
        ("LLM calls", f"{stats.llm_calls}"),
        *([("answered by students", f"{stats.student_answers}")] if stats.student_answers else []),
        ("cache hit rate", f"{stats.hit_rate:.1%}"),
        ("results written", f"{stats.results_written}"),
        ("dead letters", f"{stats.dead_letters}"),
        ("elapsed", f"{stats.elapsed_s:.1f} s ({stats.messages / max(stats.elapsed_s, 1e-9):.1f} docs/s)"),
    ]
    for label, value in rows:
        table.add_row(label, value)
    out.print(table)

