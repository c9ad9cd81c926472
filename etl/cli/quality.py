"""``etl golden``, ``etl eval``, ``etl drift``, ``etl quality``, ``etl review``, ``etl report``."""

from __future__ import annotations

import asyncio
import json
from datetime import date, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy import select, text, update

from etl.cli.support import DbOption, PipelineArg, fail, out, safe_url, store_engine, table_of
from etl.errors import EtlError
from etl.settings import Settings

golden_app = typer.Typer(no_args_is_help=True, help="Golden sets: labelled examples per tenant and stage.")
review_app = typer.Typer(no_args_is_help=True, help="The human review queue.")
TenantOption = Annotated[str | None, typer.Option(help="Only this tenant.")]


@golden_app.command("import")
def golden_import(
    file: Annotated[Path, typer.Argument(help='JSONL: {"id", "text", "tenant"?, "expected": {...}} or "label".')],
    pipeline: Annotated[str, typer.Option(help="The pipeline's name.")],
    stage: Annotated[str, typer.Option(help="The stage the examples are for.")],
    tenant: Annotated[str, typer.Option(help="Tenant of lines without one.")] = "default",
    db: DbOption = None,
) -> None:
    """Import labelled examples (the same id replaces its earlier expected answer)."""
    from etl.quality.golden import import_golden, read_golden  # noqa: PLC0415

    if not file.is_file():
        fail(f"golden file {file} does not exist")
    try:
        examples = read_golden(file, tenant)
    except EtlError as exc:
        fail(str(exc))
    engine, url = store_engine(db)
    count = import_golden(engine, pipeline, stage, examples)
    tenants = sorted({e["tenant"] for e in examples})
    out.print(f"{count} golden example(s) for {pipeline}/{stage}, tenants {tenants} → {safe_url(url)}")


def evaluate(pipeline: PipelineArg, stage: Annotated[str | None, typer.Option(help="Only this stage.")] = None,
             tenant: TenantOption = None, db: DbOption = None) -> None:
    """Score the current stage (its fingerprint: prompt, schema, model) on the golden set, per tenant.
    The model is asked afresh (no cache); every attempt is costed under '<pipeline>#eval'."""
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.quality.golden import evaluate as run_eval  # noqa: PLC0415
    from etl.runtime.wiring import default_llm  # noqa: PLC0415

    try:
        loaded = load_pipeline(pipeline)
        engine, _ = store_engine(db, loaded)
        settings = Settings()
        llm = loaded.llm or default_llm(settings)
        runs = asyncio.run(run_eval(engine, loaded, llm, stage, tenant, repairs=settings.repairs))
    except EtlError as exc:
        fail(str(exc))
    if not runs:
        fail(f"no golden examples for {loaded.name}: import some with `etl golden import`")
    out.print(table_of("Eval runs", [
        {"tenant": r["tenant"], "stage": r["stage"], "model": r["model"], "fingerprint": r["fingerprint"][:12],
         "examples": r["examples"], "failed": r["failed"], "accuracy": r["accuracy"], "macro_f1": r["macro_f1"]}
        for r in runs]))
    scored = [r for r in runs if "student" in r["details"]]
    if scored:
        out.print(table_of("Students on the same golden set", [
            {"tenant": r["tenant"], "stage": r["stage"], "student": r["details"]["student"]["student"],
             "coverage": r["details"]["student"]["coverage"], "accuracy": r["details"]["student"]["accuracy"],
             "accuracy_when_sure": r["details"]["student"]["accuracy_when_sure"],
             "routed_accuracy": r["details"]["student"]["routed_accuracy"], "llm_accuracy": r["accuracy"]}
            for r in scored]))


def drift(pipeline: Annotated[str, typer.Option(help="The pipeline's name.")],
          window: Annotated[int, typer.Option(help="Latest results to check.")] = 200,
          baseline: Annotated[int, typer.Option(help="First results to compare them with (at least --window).")] = 1000,
          db: DbOption = None) -> None:
    """Compare each tenant and stage's latest window of results with its first ones; record alerts.

    label_shift's score is -log10 of a permutation test's p-value (3: p < 0.001), valid for small
    windows over many labels; the other metrics' scores are changes between the windows."""
    from etl.quality.drift import detect  # noqa: PLC0415

    if window < 1 or baseline < 1:
        fail(f"--window {window} --baseline {baseline}: give positive counts of results")
    engine, _ = store_engine(db)
    alerts = detect(engine, pipeline, window, baseline=baseline)
    if not alerts:
        out.print(f"{pipeline}: no drift over windows of {window}")
        return
    out.print(table_of(f"{len(alerts)} drift alert(s)", [
        {"tenant": a.tenant, "stage": a.stage, "metric": a.metric, "baseline": a.baseline, "recent": a.recent,
         "score": a.score, "threshold": a.threshold} for a in alerts]))


def quality(tenant: TenantOption = None,
            since: Annotated[datetime | None, typer.Option(help="From this day on.")] = None,
            pipeline: Annotated[str | None, typer.Option(help="Only this pipeline (by name).")] = None,
            db: DbOption = None) -> None:
    """Per tenant × stage × model × day: calls, cache hit rate, failure rates by layer, latency
    percentiles, tokens, spend and savings (the quality_daily view); and what routed stages' students
    answered instead of the model, with their shadow checks (the router_daily view)."""
    engine, _ = store_engine(db)
    where, params = ["1 = 1"], {}  # type: list[str], dict[str, Any]
    for column, value in (("tenant", tenant), ("pipeline", pipeline)):
        if value:
            where.append(f"{column} = :{column}")
            params[column] = value
    if since:
        where.append("day >= :since")
        params["since"] = since.date() if engine.dialect.name == "postgresql" else since.date().isoformat()
    sql = f"SELECT * FROM quality_daily WHERE {' AND '.join(where)} ORDER BY day, pipeline, tenant, stage, model"
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(text(sql), params).mappings()]
        if engine.dialect.name != "postgresql":
            for row in rows:
                row.update(_percentiles(conn, row))
    with engine.connect() as conn:
        routed = [dict(r) for r in conn.execute(text(
            f"SELECT * FROM router_daily WHERE {' AND '.join(where)} ORDER BY day, pipeline, tenant, stage"), params)
            .mappings()]
    if not rows and not routed:
        out.print("no model calls recorded yet")
        return
    if routed:
        out.print(table_of("Router per tenant, stage and day (students' answers are calls avoided)", [
            {"day": str(r["day"]), "pipeline": r["pipeline"], "tenant": r["tenant"], "stage": r["stage"],
             "calls_avoided": int(r["student_answers"] or 0), "saved": float(r["saved"] or 0.0),
             "shadow_checks": int(r["shadow_checks"] or 0),
             "shadow_agreement": (int(r["shadow_agreed"]) / int(r["shadow_checks"])) if r["shadow_checks"] else None}
            for r in routed]))
    if not rows:
        return
    keep = ("day", "pipeline", "tenant", "stage", "model", "stage_runs", "llm_calls", "cache_hit_rate",
            "failure_rate", "schema_invalid_rate", "semantic_invalid_rate", "refusal_rate", "truncation_rate",
            "latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "tokens", "cost", "saved")
    out.print(table_of("Quality per tenant, stage, model and day",
                       [{k: (float(row[k]) if hasattr(row[k], "as_integer_ratio") and not isinstance(row[k], int)
                             else str(row[k]) if isinstance(row[k], date) else row[k]) for k in keep} for row in rows]))


def _percentiles(conn: Any, row: dict[str, Any]) -> dict[str, float | None]:
    """SQLite has no percentile aggregate: the same nearest-rank percentiles, computed here."""
    latencies = sorted(v for (v,) in conn.execute(text(
        "SELECT latency_ms FROM llm_calls WHERE outcome = 'ok' AND pipeline = :p AND tenant = :t AND stage = :s "
        "AND model = :m AND date(created_at) = :d"),
        {"p": row["pipeline"], "t": row["tenant"], "s": row["stage"], "m": row["model"], "d": row["day"]}))
    if not latencies:
        return {}
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {"latency_p50_ms": pick(0.5), "latency_p95_ms": pick(0.95), "latency_p99_ms": pick(0.99)}


@review_app.command("export")
def review_export(out_file: Annotated[Path, typer.Option("--out", help="JSONL file to write.")],
                  tenant: TenantOption = None,
                  pipeline: Annotated[str | None, typer.Option(help="Only this pipeline (by name).")] = None,
                  db: DbOption = None) -> None:
    """Write pending review items (text and output) for reviewers; they become 'exported'."""
    from connectors.store.tables import review_queue as q  # noqa: PLC0415

    engine, _ = store_engine(db)
    query = select(q.c.id, q.c.pipeline, q.c.tenant, q.c.stage, q.c.doc_key, q.c.content, q.c.output,
                   q.c.sampled_because).where(q.c.status == "pending")
    if tenant:
        query = query.where(q.c.tenant == tenant)
    if pipeline:
        query = query.where(q.c.pipeline == pipeline)
    with engine.begin() as conn:
        items = [dict(r) for r in conn.execute(query.order_by(q.c.id)).mappings()]
        for item in items:
            item["output"] = json.loads(item["output"]) if isinstance(item["output"], str) else item["output"]
        if items:
            conn.execute(update(q).where(q.c.id.in_([i["id"] for i in items])).values(status="exported"))
    out_file.write_text("".join(json.dumps({**i, "verdict": None, "corrected": None}) + "\n" for i in items))
    out.print(f"{len(items)} item(s) to review → {out_file}; fill in verdict (correct/incorrect) and corrected")


@review_app.command("import")
def review_import(file: Annotated[Path, typer.Argument(help="The exported JSONL with verdicts filled in.")],
                  promote: Annotated[bool, typer.Option(help="Add reviewed items to the golden set.")] = False,
                  reviewer: Annotated[str | None, typer.Option(help="Who reviewed.")] = None,
                  db: DbOption = None) -> None:
    """Record human verdicts; with --promote, confirmed or corrected answers join the golden set.
    Items are matched by id; only verdict, corrected and reviewer are read from the file."""
    from etl.quality.review import read_verdicts, record_verdicts  # noqa: PLC0415

    if not file.is_file():
        fail(f"review file {file} does not exist")
    engine, _ = store_engine(db)
    try:
        verdicts = read_verdicts(engine, file)
    except EtlError as exc:
        fail(str(exc))
    try:
        recorded, promoted = record_verdicts(engine, verdicts, reviewer, promote=promote)
    except EtlError as exc:
        fail(str(exc))
    skipped = f" ({recorded - promoted} without kept text)" if promote and promoted < recorded else ""
    out.print(f"{recorded} verdict(s) recorded; {promoted} promoted to the golden set{skipped}")


@review_app.command("serve")
def review_serve(pipeline: PipelineArg,
                 host: Annotated[str, typer.Option(help="Address to listen on (another than 127.0.0.1 opens it to "
                                                         "the network: put TLS in front).")] = "127.0.0.1",
                 port: Annotated[int, typer.Option(help="Port (0: any free one, printed).")] = 8765,
                 allow_host: Annotated[list[str] | None, typer.Option(
                     help="A Host name the app answers besides the address (e.g. review.example.com).")] = None,
                 db: DbOption = None) -> None:
    """The review queue in a browser: each item's text with its values' spans highlighted, accept or
    correct by keyboard into the golden set. PostgreSQL: reviewers sign in with their own login (in
    etl_reviewer: `etl review init`) and see the tenants `etl analyst grant` gave it. SQLite: the one
    local user, by the link printed here."""
    import secrets  # noqa: PLC0415
    import socket  # noqa: PLC0415

    import uvicorn  # noqa: PLC0415
    from sqlalchemy.engine import make_url  # noqa: PLC0415

    from etl.cli.support import existing_engine  # noqa: PLC0415
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.runtime.wiring import database_url  # noqa: PLC0415
    from etl.web.app import create_app  # noqa: PLC0415

    try:
        loaded = load_pipeline(pipeline)
    except EtlError as exc:
        fail(str(exc))
    existing_engine(db or database_url(loaded, Settings()), "review").dispose()  # a mistyped SQLite path: refused
    engine, url = store_engine(db, loaded)  # migrated: the review columns and policies exist
    engine.dispose()
    postgres = make_url(url).get_backend_name() == "postgresql"
    token = None if postgres else secrets.token_urlsafe(24)
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port (or --port 0)")
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    hosts = [host, "127.0.0.1", "localhost", "[::1]", *(allow_host or [])]
    origin = f"http://{shown}:{bound}/"

    def next_link(fresh: str) -> None:
        out.print(f"that link was used; the next sign-in: {origin}login?token={fresh}", soft_wrap=True)

    app = create_app(loaded, url, allowed_hosts=hosts, local_token=token, new_token=next_link)
    link = origin + (f"login?token={token}" if token else "login")
    out.print(f"reviewing {loaded.name} in {safe_url(url)} at {link}" + (
        "  (sign in with your PostgreSQL login)" if postgres else "  (this link lets the local user in, once)"),
        soft_wrap=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    server.run(sockets=[sock])


@review_app.command("init")
def review_init(db: DbOption = None) -> None:
    """Create the group role etl_reviewer (a member of etl_analyst; needs CREATEROLE) and grant it the
    review writes: verdicts and golden examples, for granted tenants, in the login's own name. Then:
    CREATE ROLE alice LOGIN PASSWORD '...' IN ROLE etl_reviewer; etl analyst grant alice acme."""
    from connectors.store.security import REVIEWER_ROLE, AccessRefused, init_reviewers  # noqa: PLC0415
    from etl.cli.access import postgres_engine  # noqa: PLC0415

    engine, url = postgres_engine(db)
    try:
        with engine.begin() as conn:
            created = init_reviewers(conn)
    except AccessRefused as exc:
        fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - one line for the user
        fail(f"cannot set up reviewers on {safe_url(url)}: {str(exc).splitlines()[0]}; run it as the tables' owner "
             "with CREATEROLE")
    out.print(f"{REVIEWER_ROLE} {'created' if created else 'exists'}: its members may record verdicts and golden "
              f"examples for the tenants granted to them; add one with CREATE ROLE name LOGIN PASSWORD '...' "
              f"IN ROLE {REVIEWER_ROLE}; then `etl analyst grant name TENANT`", soft_wrap=True)


def report(out_dir: Annotated[Path, typer.Option("--out", help="Directory for index.html.")],
           pipeline: Annotated[str | None, typer.Option(help="Only this pipeline (by name).")] = None,
           db: DbOption = None) -> None:
    """An HTML page: accuracy over time, drift, cost and cache savings per tenant."""
    from etl.quality.report import write_report  # noqa: PLC0415

    engine, _ = store_engine(db)
    path = write_report(engine, out_dir, pipeline)
    out.print(f"report → {path}")


def register(app: typer.Typer) -> None:
    app.add_typer(golden_app, name="golden")
    app.add_typer(review_app, name="review")
    app.command("eval")(evaluate)
    app.command("drift")(drift)
    app.command("quality")(quality)
    app.command("report")(report)
