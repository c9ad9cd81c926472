"""``etl golden``, ``etl eval``, ``etl stability``, ``etl drift``, ``etl quality``, ``etl review``, ``etl report``."""

from __future__ import annotations

import asyncio
import json
import math
from datetime import date, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy import select, text, update

from rich.progress import TextColumn

from etl.cli.support import DbOption, PipelineArg, console, fail, out, safe_url, store_engine, table_of
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
             tenant: TenantOption = None,
             models: Annotated[str | None, typer.Option(
                 help="Compare these models on the golden set, e.g. 'default,small': names in the pipeline's "
                      "models={...}, 'default' (its own), or models of the ETL_LLM_BASE_URL endpoint.")] = None,
             db: DbOption = None) -> None:
    """Score the current stage (its fingerprint: prompt, schema, model) on the golden set, per tenant.
    The model is asked afresh (no cache); every attempt is costed under '<pipeline>#eval'.

    With --models: every candidate answers the same golden set through the same stage, side by
    side with accuracy (95% interval), macro-F1 or field match, cost, latency, schema-invalid share
    and stability, and a paired test between the best two; answers are cached per candidate's
    fingerprint, so a re-run costs nothing."""
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.quality.golden import evaluate as run_eval  # noqa: PLC0415
    from etl.runtime.wiring import default_llm, priced  # noqa: PLC0415

    try:
        loaded = load_pipeline(pipeline)
        engine, _ = store_engine(db, loaded)
        settings = Settings()
        if models is not None:
            _compare(engine, loaded, [m.strip() for m in models.split(",") if m.strip()], stage, tenant, settings)
            return
        llm = priced(loaded.llm or default_llm(settings), settings)
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


def _compare(engine: Any, loaded: Any, names: list[str], stage: str | None, tenant: str | None,
             settings: Settings) -> None:
    from etl.quality.compare import candidates, compare  # noqa: PLC0415

    if stage is None:
        if len(loaded.stages) > 1:
            fail(f"--models: say which stage with --stage ({', '.join(s.name for s in loaded.stages)})")
        stage = loaded.stages[0].name
    found = candidates(loaded, names, settings)
    compared = asyncio.run(compare(engine, loaded, found, stage, tenant, repairs=settings.repairs))
    out.print(table_of(f"Models on the golden set of {loaded.name}/{stage} (best first)", [
        {"candidate": r["candidate"], "model": r["model"], "examples": r["examples"], "accuracy": r["accuracy"],
         "95% interval": "{:.3f}–{:.3f}".format(*r["accuracy_ci"]),
         "macro_f1/field match": r["quality"], "failed": r["failed"], "schema_invalid": r["schema_invalid"],
         "cost_usd": r["cost"],
         "latency_p50_ms": r["latency_p50_ms"], "stability": r["stability"], "calls_now": r["calls_now"]}
        for r in compared["rows"]]))
    test = compared["test"]
    verdict = "a difference beyond chance" if test["p"] < 0.05 else "not a difference beyond chance"
    out.print(f"{test['best']} vs {test['second']}: right only for {test['best']} on {test['a_only']}, only for "
              f"{test['second']} on {test['b_only']} of {test['examples']} examples; exact McNemar p = {test['p']:.3g} "
              f"({verdict} at 0.05). Stability: as `etl stability --model NAME` last measured it (blank: not measured).")


def stability(
    pipeline: PipelineArg,
    stage: Annotated[str, typer.Argument(help="The stage to measure.")],
    samples: Annotated[int, typer.Option(help="Answers per document (K).")] = 5,
    documents: Annotated[int, typer.Option(help="Documents in the sample (N), drawn at random.")] = 100,
    from_: Annotated[str, typer.Option("--from", help="Where the documents come from: 'source' (the pipeline's "
                                                      "file source), 'golden' (its golden set) or a file or directory.")]
    = "source",
    max_cost: Annotated[float | None, typer.Option(help="USD: stop after the round of answers that reaches it "
                                                        "(two rounds always run).")] = None,
    seed: Annotated[int, typer.Option(help="The sample's random seed.")] = 0,
    model: Annotated[str | None, typer.Option(help="Measure this model instead of the pipeline's: a name in its "
                                                    "models={...} or of the ETL_LLM_BASE_URL endpoint.")] = None,
    db: DbOption = None,
) -> None:
    """Ask STAGE's model K times about N documents, as a run asks it (prompt, schema, validators,
    repairs) but bypassing the cache, and report how often it answers the same: per tenant and
    model, the share of documents answered one way, distinct answers per document, per-field
    agreement, Classify's label flip rate, and the share of stored answers it gives again. Nothing
    stored is overwritten; every call is costed under '<pipeline>#stability'; the run is kept in
    stability_runs, and a drop against the last run is a drift alert (metric stability)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn  # noqa: PLC0415

    from connectors.sources.base import Source, SourceUnavailable  # noqa: PLC0415
    from connectors.sources.files import FileSource, source_for_path  # noqa: PLC0415
    from connectors.sources.kafka import KafkaSource  # noqa: PLC0415
    from etl.pipeline import load_pipeline  # noqa: PLC0415
    from etl.quality.stability import golden_documents, measure, source_documents  # noqa: PLC0415
    from etl.runtime.wiring import default_llm, priced  # noqa: PLC0415

    if not 2 <= samples <= 100 or documents < 1:
        fail(f"--samples {samples} --documents {documents}: give 2 to 100 samples of at least 1 document")
    if max_cost is not None and not (math.isfinite(max_cost) and max_cost > 0):
        fail(f"--max-cost {max_cost}: give a positive number of USD")
    try:
        loaded = load_pipeline(pipeline)
        engine, _ = store_engine(db, loaded)
        settings = Settings()
        if model is not None and model != "default":
            from etl.quality.compare import candidate  # noqa: PLC0415

            llm = candidate(loaded, model, settings)
        else:
            llm = priced(loaded.llm or default_llm(settings), settings)
        if from_ == "golden":
            sample = golden_documents(engine, loaded.name, stage, documents, seed)
            where = "its golden set"
        else:
            # a file pipeline's documents are files (PDF, HTML, ...), read by what its source reads them with
            source: Source = (loaded.source if from_ == "source" else FileSource(from_)
                              if loaded.source.value_format == "file" else source_for_path(from_))
            if isinstance(source, KafkaSource):
                fail(f"--from {from_}: {loaded.name!r} reads {type(source).__name__}, whose documents are not kept; "
                     "give --from golden or a file or directory of documents")
            sample = source_documents(loaded, source, documents, seed)
            where = "the pipeline's source" if from_ == "source" else from_
        if not sample:
            fail(f"no documents in {where} to measure {loaded.name}/{stage} on")
        total = len(sample) * samples
        out.print(f"{loaded.name}/{stage}: {len(sample)} documents from {where} × {samples} samples = up to {total} "
                  "model answers (more with repairs), bypassing the cache")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("answers", total=total)
            runs = asyncio.run(measure(engine, loaded, llm, stage, sample, samples, repairs=settings.repairs,
                                       max_cost=max_cost, progress=lambda n: bar.advance(task, n),
                                       candidate=model not in (None, "default"), source=where))
    except EtlError as exc:
        fail(str(exc))
    except (OSError, SourceUnavailable) as exc:
        fail(f"--from {from_}: {getattr(exc, 'strerror', None) or exc}")
    skipped = [r for r in runs if "skipped" in r]
    runs = [r for r in runs if "skipped" not in r]
    if not runs:
        fail(f"{loaded.name}/{stage} ran on none of the sampled documents (a stage with when= is measured where "
             "its stored results for the same content are): run the pipeline first")
    out.print(table_of(f"Stability of {loaded.name}/{stage}", [
        {"tenant": r["tenant"], "model": r["model"], "documents": r["documents"], "samples": r["samples"],
         "unanimous": r["unanimous"],
         "95% interval": "{:.3f}–{:.3f}".format(*r["details"]["unanimous_ci"]),
         "distinct/doc": r["distinct_answers"], "label_flip_rate": r["label_flip_rate"],
         "reproduced": r["reproduced"], "failed": r["details"]["failed_samples"], "calls": r["calls"],
         "cost": r["cost"],
         "alert": "DROP" if r.get("alert") else ""} for r in runs]))
    for r in runs:
        fields = r["details"]["fields"]
        if len(fields) > 1:
            out.print(f"{r['tenant']}: field agreement " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(fields.items())))
        if r.get("alert"):
            out.print(f"[bold red]{r['tenant']}: stability dropped from {r['previous_unanimous']:.3f} to "
                      f"{r['unanimous']:.3f} (drift alert recorded)[/]")
        if r["details"]["failed_share"] > 0.5:
            out.print(f"[bold red]{r['tenant']}: {r['details']['failed_share']:.0%} of the answers failed: this "
                      "measures failures, not stability; check the model (llm_calls under "
                      f"'{loaded.name}#stability' have the errors)[/]")
    for r in skipped:
        out.print(f"{r['tenant']}: not measured ({r['skipped']})")


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
         "score": a.score, "threshold": a.threshold,
         **({"detail": f"{a.extra['from']} → {a.extra['to']}"} if a.metric == "model_version" else {})}
        for a in alerts]))


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
    app.command("stability")(stability)
    app.command("quality")(quality)
    app.command("report")(report)
