"""``etl batch status`` and ``etl batch cancel``: the provider batches of ``etl run --batch``."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Annotated

import typer
from sqlalchemy import select

from etl.cli.support import DbOption, PipelineArg, fail, out, store_engine, table_of
from etl.errors import EtlError
from etl.settings import Settings

batch_app = typer.Typer(no_args_is_help=True, help="Provider batches sent by `etl run --batch`.")


@batch_app.command("status")
def batch_status(pipeline: Annotated[str | None, typer.Option(help="Only this pipeline (by name).")] = None,
                 all_: Annotated[bool, typer.Option("--all", help="Finished batches too.")] = False,
                 db: DbOption = None) -> None:
    """Batches as the store recorded them: live ones (recorded, submitted) unless --all."""
    from connectors.store.batches import LIVE  # noqa: PLC0415
    from connectors.store.tables import llm_batches as b  # noqa: PLC0415

    engine, _ = store_engine(db)
    query = select(b).order_by(b.c.id)
    if pipeline:
        query = query.where(b.c.pipeline == pipeline)
    if not all_:
        query = query.where(b.c.status.in_(LIVE))
    now = datetime.now(timezone.utc)
    with engine.connect() as conn:
        found = [{"batch": r.id, "pipeline": r.pipeline, "provider id": r.provider_id or "", "status": r.status,
                  "lines": r.lines, "age": _age(now, r.created_at), "provider": r.provider}
                 for r in conn.execute(query)]
    out.print(table_of("Provider batches", found) if found else "no live batches" if not all_ else "no batches")


def _age(now: datetime, created: datetime) -> str:
    seconds = int((now - (created if created.tzinfo else created.replace(tzinfo=timezone.utc))).total_seconds())
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


@batch_app.command("cancel")
def batch_cancel(pipeline: PipelineArg, db: DbOption = None) -> None:
    """Ask the provider to cancel PIPELINE's live batches (what they answered until then is kept
    and billed; the rest is sent again by the next `etl run --batch`)."""
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.runtime.wiring import build_runner  # noqa: PLC0415

    try:
        loaded = load_pipeline(pipeline)
        runner = build_runner(loaded, Settings(), store_url=db, batch=True)
        cancelled = asyncio.run(_cancel(runner.llm))
    except EtlError as exc:
        fail(str(exc))
    out.print(f"{loaded.name}: {len(cancelled)} live batch(es) cancelled {cancelled}")


async def _cancel(llm: object) -> list[str]:
    from etl.llm.batch import BatchLLM  # noqa: PLC0415

    assert isinstance(llm, BatchLLM)
    try:
        return await llm.cancel_live()
    finally:
        await llm.aclose()


def register(app: typer.Typer) -> None:
    app.add_typer(batch_app, name="batch")
