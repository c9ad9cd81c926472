"""``etl distill`` and ``etl students``: a Classify stage's cache, distilled into a gated student."""

from __future__ import annotations

from typing import Annotated

import typer
from sqlalchemy import select

from etl.cli.support import DbOption, PipelineArg, fail, out, store_engine, table_of
from etl.errors import EtlError
from etl.settings import Settings


def distill(pipeline: PipelineArg,
            stage: Annotated[str, typer.Option(help="The Classify stage to distill.")],
            tenant: Annotated[str | None, typer.Option(help="Only this tenant (default: every tenant with answers).")] = None,
            target: Annotated[float | None, typer.Option(help=(
                "Accuracy (golden set) or agreement (LLM answers) the student must reach by its lower bound; "
                "default: the LLM's golden accuracy minus 0.01, else 0.90."))] = None,
            level: Annotated[float, typer.Option(help="Confidence of the lower bound.")] = 0.95,
            min_golden: Annotated[int, typer.Option(help="Golden examples needed to certify on human labels.")] = 200,
            db: DbOption = None) -> None:
    """Train a student on the stage's stored answers (its current fingerprint), certify a threshold
    on documents it did not train on, and activate it only if the target holds."""
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.quality.router import distill as run_distill  # noqa: PLC0415
    from etl.runtime.wiring import default_llm  # noqa: PLC0415

    if not 0.5 <= level < 1.0:
        fail(f"--level {level}: give a confidence between 0.5 and 1")
    try:
        loaded = load_pipeline(pipeline)
        engine, _ = store_engine(db, loaded)
        settings = Settings()
        llm = loaded.llm or default_llm(settings)
        with out.status(f"distilling {loaded.name}/{stage} …"):
            made = run_distill(engine, loaded, llm, stage, tenant, target, level, settings.repairs, min_golden)
    except EtlError as exc:
        fail(str(exc))
    if not made:
        fail(f"no stored answers with text for {loaded.name}/{stage}: give the stage a router "
             "(Classify(..., router=Router())) and run it first")
    out.print(table_of(f"Students for {loaded.name}/{stage}", [
        {"tenant": m.tenant, "version": m.version, "status": m.status, "trained_on": m.row.get("trained_on", 0),
         "holdout": m.row.get("holdout", ""), "threshold": m.row.get("threshold"),
         "coverage": (m.row["covered"] / m.row["certified_on"]) if m.row.get("certified_on") else 0.0,
         "lower_bound": m.row.get("lower_bound", 0.0), "target": m.row.get("target", 0.0), "reason": m.reason}
        for m in made]))
    if not any(m.status == "active" for m in made):
        raise typer.Exit(2)  # scripts can tell "nothing activated" apart from success


def list_students(pipeline: Annotated[str | None, typer.Option(help="Only this pipeline (by name).")] = None,
                  tenant: Annotated[str | None, typer.Option(help="Only this tenant.")] = None,
                  db: DbOption = None) -> None:
    """Every student, newest first: status, threshold, certified bound, coverage and why."""
    from connectors.store.tables import students  # noqa: PLC0415

    engine, _ = store_engine(db)
    s = students.c
    query = select(s.id, s.pipeline, s.stage, s.tenant, s.version, s.status, s.threshold, s.lower_bound, s.target,
                   s.covered, s.certified_on, s.agreement, s.created_at, s.reason).order_by(s.id.desc())
    if pipeline:
        query = query.where(s.pipeline == pipeline)
    if tenant:
        query = query.where(s.tenant == tenant)
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(query).mappings()]
    if not rows:
        out.print("no students yet: `etl distill PIPELINE --stage S`")
        return
    for row in rows:
        row["coverage"] = row.pop("covered") / row["certified_on"] if row["certified_on"] else 0.0
        row["created_at"] = str(row["created_at"])[:19]
    out.print(table_of("Students", rows))


def register(app: typer.Typer) -> None:
    app.command("distill")(distill)
    app.command("students")(list_students)
