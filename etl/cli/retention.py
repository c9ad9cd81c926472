"""``etl prune``: the store does not grow forever with dead prompts and old call rows."""

from __future__ import annotations

from typing import Annotated

import typer

from etl.cli.support import DbOption, existing_engine, fail, go_ahead, out, safe_url, table_of
from etl.errors import EtlError
from etl.settings import Settings


def prune(pipelines: Annotated[list[str], typer.Argument(help=(
              "Every pipeline that uses the store (files or module:attr): cache entries are shared by "
              "fingerprint, so what one pipeline no longer uses another may."))],
          retention_days: Annotated[float, typer.Option(help="Keep LLM call rows this many days.")] = 90.0,
          drop_stage: Annotated[list[str] | None, typer.Option(help=(
              "A stage the files no longer have whose results may go (repeat for several); only once no "
              "worker runs the old files."))] = None,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="Count the rows; delete nothing.")] = False,
          yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
          db: DbOption = None) -> None:
    """Delete cache entries of stage fingerprints no pipeline uses any more (with their texts),
    results of stages given with --drop-stage (with their typed rows), and LLM call rows older
    than --retention-days; one transaction. Refuses while the store shows that the files are not
    what runs (another pipeline's rows, a stage whose newest answer is at another fingerprint).
    Results of a live stage at an older fingerprint stay (the document's answer until it is
    processed again). The store is not migrated."""
    from connectors.store.prune import Refused  # noqa: PLC0415
    from connectors.store.prune import prune as run_prune  # noqa: PLC0415
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.runtime.calls import plans_by_tenant  # noqa: PLC0415
    from etl.runtime.wiring import database_url, default_llm  # noqa: PLC0415

    if retention_days < 1:
        fail(f"--retention-days {retention_days:g}: keep at least 1 day (today's calls count against budgets)")
    settings = Settings()
    try:
        loaded = [load_pipeline(p) for p in pipelines]
    except EtlError as exc:
        fail(str(exc))
    names = [p.name for p in loaded]
    if len(set(names)) < len(names):
        fail(f"pipeline(s) {', '.join(sorted({n for n in names if names.count(n) > 1}))} given twice: give the one "
             "file each pipeline runs now")
    # pipeline → tenant configuration ("": every tenant without its own) → stage → fingerprint
    live = {p.name: {tenant: {plan.stage.name: (plan.fingerprint, *(() if plan.fallback is None else
                                                                  (plan.fallback.fingerprint,)))
                              for plan in plans} for tenant, plans in
                     plans_by_tenant(p, p.llm or default_llm(settings), settings.repairs).items()} for p in loaded}
    drop = frozenset(drop_stage or ())
    url = db or database_url(loaded[0], settings)
    engine = existing_engine(url, "prune")  # not migrated: counting and deleting change no schema

    def attempt(dry: bool) -> dict[str, int]:
        try:
            return run_prune(engine, live, retention_days, dry_run=dry, drop_stages=drop)
        except Refused as exc:
            fail(f"{'' if dry else 'nothing deleted: '}{exc}")
        except Exception as exc:  # noqa: BLE001 - one line for the user
            fail(f"{'cannot count what to prune' if dry else 'nothing deleted'}: {type(exc).__name__}: "
                 f"{str(exc).splitlines()[0]}; run it as the tables' owner, on a store `etl db upgrade` has migrated")

    counts = attempt(True)
    kept = counts.pop("kept_stale_results", 0)
    total = sum(counts.values())
    out.print(table_of(f"prunable in {safe_url(url)}: {total} row(s)",
                       [{"table": t, "rows": n} for t, n in counts.items()]))
    if kept:
        out.print(f"{kept} result(s) of live stages at an older fingerprint are kept: `etl replay` recomputes them")
    if not go_ahead(total, dry_run=dry_run, yes=yes, question=f"delete these {total} row(s)?"):
        return
    deleted = attempt(False)  # checked again in the deleting transaction
    deleted.pop("kept_stale_results", None)
    out.print(f"deleted {sum(deleted.values())} row(s)")


def register(app: typer.Typer) -> None:
    app.command("prune")(prune)
