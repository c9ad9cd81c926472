"""``etl prune``: the store does not grow forever with dead prompts and old call rows."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from etl.cli.support import DbOption, fail, out, safe_url, store_engine, table_of
from etl.errors import EtlError
from etl.settings import Settings


def prune(pipelines: Annotated[list[str], typer.Argument(help=(
              "Every pipeline that uses the store (files or module:attr): cache entries are shared by "
              "fingerprint, so what one pipeline no longer uses another may."))],
          retention_days: Annotated[float, typer.Option(help="Keep LLM call rows this many days.")] = 90.0,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="Count the rows; delete nothing.")] = False,
          yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
          db: DbOption = None) -> None:
    """Delete cache entries of stage fingerprints no pipeline uses any more (with their texts),
    results of stages no pipeline has any more (with their typed rows), and LLM call rows older
    than --retention-days; one transaction. Results of a live stage at an older fingerprint stay
    (the document's answer until it is processed again)."""
    from connectors.store.prune import prune as run_prune  # noqa: PLC0415
    from connectors.store.prune import stored_pipelines, unproven_stages  # noqa: PLC0415
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.runtime.calls import plans_by_tenant  # noqa: PLC0415
    from etl.runtime.wiring import default_llm  # noqa: PLC0415

    if retention_days < 1:
        fail(f"--retention-days {retention_days:g}: keep at least 1 day (today's calls count against budgets)")
    settings = Settings()
    try:
        loaded = [load_pipeline(p) for p in pipelines]
    except EtlError as exc:
        fail(str(exc))
    # per pipeline, its plans per tenant configuration ("": every tenant without its own)
    plans = {p.name: plans_by_tenant(p, p.llm or default_llm(settings), settings.repairs) for p in loaded}
    stages = {name: {plan.stage.name for tenant in by_tenant.values() for plan in tenant}
              for name, by_tenant in plans.items()}
    fingerprints = {plan.fingerprint for by_tenant in plans.values() for tenant in by_tenant.values() for plan in tenant}

    def live(tenant: str, stage: str) -> set[str]:
        """The fingerprints a tenant's documents get at ``stage``, in any of the pipelines."""
        return {plan.fingerprint for by_tenant in plans.values()
                for plan in by_tenant.get(tenant, by_tenant[""]) if plan.stage.name == stage}

    engine, url = store_engine(db, loaded[0])
    try:  # all read-only: the refusals below come before anything is deleted
        others = sorted(stored_pipelines(engine) - set(stages))
        unproven = unproven_stages(engine, live, set().union(*stages.values()))
        counts = run_prune(engine, stages, fingerprints, retention_days, dry_run=True)
    except Exception as exc:  # noqa: BLE001 - one line for the user
        fail(f"cannot count what to prune: {type(exc).__name__}: {str(exc).splitlines()[0]}; "
             "run it as the tables' owner")
    if others:
        fail(f"{safe_url(url)} also holds pipeline(s) {', '.join(others)}: give their files too (they may "
             "use cache entries the others do not), or purge them first")
    if unproven:
        fail(f"{', '.join(unproven[:5])}{' …' if len(unproven) > 5 else ''}: cache entries, none at the "
             "fingerprint the given pipelines make now for that tenant and stage: run the pipeline once since "
             "it changed, or set the model settings (ETL_LLM_*) as `etl run` has them; pruning now would "
             "delete what its runs use")
    kept = counts.pop("kept_stale_results", 0)
    total = sum(counts.values())
    out.print(table_of(f"prunable in {safe_url(url)}: {total} row(s)",
                       [{"table": t, "rows": n} for t, n in counts.items()]))
    if kept:
        out.print(f"{kept} result(s) of live stages at an older fingerprint are kept: `etl replay` recomputes them")
    if dry_run or not total:
        out.print("dry run: nothing deleted" if dry_run else "nothing to delete")
        return
    if not yes:
        if not sys.stdin.isatty():
            fail("not a terminal to confirm on: pass --yes to delete, or --dry-run to count")
        typer.confirm(f"delete these {total} row(s)? This cannot be undone", abort=True)
    try:
        deleted = run_prune(engine, stages, fingerprints, retention_days, dry_run=False)
    except Exception as exc:  # noqa: BLE001 - one line for the user
        fail(f"nothing deleted: {type(exc).__name__}: {str(exc).splitlines()[0]}; run it as the tables' owner")
    deleted.pop("kept_stale_results", None)
    out.print(f"deleted {sum(deleted.values())} row(s)")


def register(app: typer.Typer) -> None:
    app.command("prune")(prune)
