"""A pipeline that changes: typed tables follow their schema (a new field re-runs only its stage,
optional fields become nullable, a type change is shown and applied on request), tenant overrides
get their own tables, a failed first run leaves a usable SQLite file, a store that refuses for good
stops the run at once, and `etl eval` scores a tenant as its documents run."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from etl import Classify, ConfigError, Extract, Pipeline, run_pipeline
from etl.cli import app
from etl.llm.base import LLMRequest
from etl.testing import FakeLLM, ListSource, schema_answer
from tests.helpers import counts, rows

LABELS = ["receipt", "other"]


class ReceiptV1(BaseModel):
    vendor: str
    total: float


class ReceiptV2(BaseModel):  # one field more
    vendor: str
    total: float
    city: str


class ReceiptOptional(BaseModel):  # total optional now
    vendor: str
    total: float | None = None


def docs(n: int = 40) -> list[dict[str, str]]:
    """``n`` documents, a quarter of them repeating an earlier text: fewer contents than documents."""
    return [{"id": f"d{i}", "tenant": ["acme", "globex"][i % 2], "text": f"receipt {i % 30} total {i % 30}.50"}
            for i in range(n)]


def unique_contents(items: list[dict[str, str]]) -> int:
    return len({(d["tenant"], d["text"]) for d in items})


def receipts(schema: type[BaseModel], url: str, items: list[dict[str, str]], **kw: Any) -> Pipeline:
    return Pipeline("evolve", ListSource(items), [Classify(LABELS, "Kind?", name="kind"),
                                                   Extract(schema, "Extract.", table="receipt")], store=url, **kw)


def columns(url: str, table: str) -> dict[str, tuple[str, bool]]:
    engine = create_engine(url)
    try:
        return {c["name"]: (str(c["type"]).upper(), c["nullable"]) for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def by_stage(llm: FakeLLM) -> dict[str, int]:
    """Calls per stage, told apart by the schema each request asks for."""
    found: dict[str, int] = {}
    for request in llm.calls:
        stage = "kind" if "label" in request.json_schema.get("properties", {}) else "receipt"
        found[stage] = found.get(stage, 0) + 1
    return found


async def test_a_new_field_adds_a_nullable_column_and_reruns_only_its_stage(store_url: str) -> None:
    items = docs()
    await run_pipeline(receipts(ReceiptV1, store_url, items), llm=FakeLLM())
    assert "city" not in columns(store_url, "receipt")

    second = FakeLLM()
    stats = await run_pipeline(receipts(ReceiptV2, store_url, items), llm=second)
    # Only the Extract stage re-runs, once per content; Classify is served from what is stored.
    assert by_stage(second) == {"receipt": unique_contents(items)}
    assert stats.dead_letters == 0
    assert columns(store_url, "receipt")["city"][1] is True  # nullable: rows stored before have none
    assert rows(store_url, "SELECT count(*) FROM receipt WHERE city IS NOT NULL") == [(len(items),)]

    third = FakeLLM()
    await run_pipeline(receipts(ReceiptV2, store_url, items), llm=third)
    assert third.calls == []  # and once migrated, a re-run is a no-op again


async def test_an_optional_field_makes_its_column_nullable(store_url: str) -> None:
    items = docs(10)
    await run_pipeline(receipts(ReceiptV1, store_url, items), llm=FakeLLM())
    assert columns(store_url, "receipt")["total"][1] is False

    def no_total(request: LLMRequest) -> dict[str, Any]:
        answer = schema_answer(request)
        return {**answer, "total": None} if "vendor" in answer else answer

    stats = await run_pipeline(receipts(ReceiptOptional, store_url, items), llm=FakeLLM(no_total))
    assert stats.dead_letters == 0
    assert columns(store_url, "receipt")["total"][1] is True
    assert rows(store_url, "SELECT count(*) FROM receipt WHERE total IS NULL") == [(len(items),)]


PIPELINE_FILE = '''
import datetime
from pydantic import BaseModel
from etl import Classify, Extract, Pipeline
from etl.testing import FakeLLM, schema_answer

class Receipt(BaseModel):
    vendor: str
    total: {total_type}

def answer(request):
    found = schema_answer(request)
    return {{**found, "total": {total_value!r}}} if "vendor" in found else found

pipeline = Pipeline("typed", {source!r}, [Classify(["receipt", "other"], "Kind?"), Extract(Receipt)],
                    llm=FakeLLM(answer))
'''


def write_pipeline(path: Path, source: Path, total_type: str, total_value: Any) -> Path:
    path.write_text(PIPELINE_FILE.format(total_type=total_type, total_value=total_value, source=str(source)))
    return path


def test_a_type_change_is_refused_then_planned_then_applied(tmp_path: Path, store_url: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"id": "{i}", "text": "receipt {i}"}}\n' for i in range(6)))
    as_text = write_pipeline(tmp_path / "as_text.py", source, "str", "12.50")
    as_float = write_pipeline(tmp_path / "as_float.py", source, "float", 12.5)
    cli = CliRunner()
    env = {"ETL_DATABASE_URL": store_url, "ETL_STORE_RETRY_S": "5"}
    first = cli.invoke(app, ["run", str(as_text)], env=env)
    assert first.exit_code == 0, first.output
    assert columns(store_url, "receipt")["total"][0] == "TEXT"
    before = counts(store_url)

    refused = cli.invoke(app, ["run", str(as_float)], env=env)
    assert refused.exit_code == 1
    message = " ".join(refused.output.split())
    assert "receipt.total: type TEXT → FLOAT" in message
    assert f"etl db plan {as_float}" in message and f"etl db upgrade {as_float}" in message
    assert "Traceback" not in refused.output
    assert counts(store_url) == before  # nothing ran

    plan = cli.invoke(app, ["db", "plan", str(as_float)], env=env)
    assert plan.exit_code == 0, plan.output
    statements = " ".join(plan.output.split())
    assert "UPDATE receipt SET total" in statements and ("FLOAT" in statements or "DOUBLE" in statements), statements
    assert columns(store_url, "receipt")["total"][0] == "TEXT"  # a plan changes nothing

    upgraded = cli.invoke(app, ["db", "upgrade", str(as_float)], env=env)
    assert upgraded.exit_code == 0, upgraded.output
    kind = columns(store_url, "receipt")["total"][0]
    assert kind in ("FLOAT", "DOUBLE PRECISION"), kind
    assert {float(v) for (v,) in rows(store_url, "SELECT total FROM receipt")} == {12.5}  # cast in place
    assert "nothing to do" in cli.invoke(app, ["db", "plan", str(as_float)], env=env).output

    rerun = cli.invoke(app, ["run", str(as_float)], env=env)
    assert rerun.exit_code == 0, rerun.output
    assert rows(store_url, "SELECT count(*) FROM receipt") == [(6,)]


def test_a_type_change_that_stored_values_do_not_survive_is_refused(tmp_path: Path, store_url: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "1", "text": "receipt one"}\n')
    cli = CliRunner()
    env = {"ETL_DATABASE_URL": store_url}
    assert cli.invoke(app, ["run", str(write_pipeline(tmp_path / "a.py", source, "str", "n/a"))], env=env).exit_code == 0
    to_float = write_pipeline(tmp_path / "b.py", source, "float", 1.0)
    for command in ("plan", "upgrade"):
        result = cli.invoke(app, ["db", command, str(to_float)], env=env)
        assert result.exit_code == 1
        assert "receipt.total" in result.output and "'n/a'" in result.output, result.output
    # SQLite would have cast 'n/a' to 0.0 and PostgreSQL refused the batch: the value stays as it was.
    assert rows(store_url, "SELECT total FROM receipt") == [("n/a",)]


@pytest.mark.parametrize(("old", "value", "new", "expected"), [
    ("str", "2024-01-05", "datetime.date", "2024-01-05"),  # SQLite's CAST made it 2024
    ("str", "yes", "bool", True),  # ... and 0 (false)
    ("int", 7, "str", "7"),  # pydantic itself would not make an int a str
])
def test_a_type_change_rewrites_each_value_as_the_field_validates_it(tmp_path: Path, store_url: str, old: str,
                                                                      value: Any, new: str, expected: Any) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "1", "text": "receipt one"}\n')
    cli = CliRunner()
    env = {"ETL_DATABASE_URL": store_url}
    assert cli.invoke(app, ["run", str(write_pipeline(tmp_path / "a.py", source, old, value))], env=env).exit_code == 0
    upgraded = cli.invoke(app, ["db", "upgrade", str(write_pipeline(tmp_path / "b.py", source, new, expected))], env=env)
    assert upgraded.exit_code == 0, upgraded.output
    [(stored,)] = rows(store_url, "SELECT total FROM receipt")
    assert (str(stored) if new == "datetime.date" else stored) == expected


class Invoice(BaseModel):
    number: str
    amount: float


async def test_tenant_overrides_of_schema_and_table_get_their_own_tables(store_url: str) -> None:
    items = [{"id": f"{t}-{i}", "tenant": t, "text": f"{t} paper {i}"} for t in ("acme", "globex", "initech")
             for i in range(5)]
    p = Pipeline("overrides", ListSource(items), [Extract(ReceiptV1, "Extract.", name="paper")], store=store_url,
                 tenant_overrides={"acme": {"paper": {"schema": Invoice}},
                                   "globex": {"paper": {"table": "globex_receipts"}}})
    stats = await run_pipeline(p, llm=FakeLLM())
    assert stats.dead_letters == 0
    assert rows(store_url, "SELECT DISTINCT tenant FROM receipt_v1") == [("initech",)]
    assert rows(store_url, "SELECT DISTINCT tenant FROM invoice") == [("acme",)]
    assert rows(store_url, "SELECT DISTINCT tenant FROM globex_receipts") == [("globex",)]
    assert set(columns(store_url, "invoice")) >= {"number", "amount"}


def test_a_tenant_override_that_would_share_a_table_with_another_schema_is_refused() -> None:
    with pytest.raises(ConfigError, match="give the override its own table="):
        Pipeline("clash", ListSource([]), [Extract(ReceiptV1, table="paper")],
                 tenant_overrides={"acme": {"receipt_v1": {"schema": Invoice, "table": "paper"}}})


def test_a_field_that_clashes_with_a_column_ignoring_case_is_refused_before_the_store_is_touched(
        tmp_path: Path) -> None:
    class Shouting(BaseModel):
        Tenant: str

    class Twice(BaseModel):
        total: float
        Total: float

    for schema, match in ((Shouting, "'Tenant' .* clashes with the column 'tenant'"),
                          (Twice, "'Total' .* clashes with field 'total'")):
        with pytest.raises(ConfigError, match=match):
            Extract(schema)
    assert not list(tmp_path.iterdir())


def test_a_failed_first_run_leaves_a_sqlite_file_every_pipeline_can_use(tmp_path: Path) -> None:
    """A first run whose typed table cannot be made (here a table of that name that is not one)
    rolls back its migrations too: the file is as it was, and other pipelines run on it. Before,
    SQLite's driver committed each CREATE on its own: tables without their alembic_version row,
    and every later run failed on "table dead_letters already exists"."""
    path = tmp_path / "etl.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE receipt (note TEXT)")  # the user's own table
    conn.close()
    url = f"sqlite:///{path}"
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "1", "text": "receipt one"}\n')
    (tmp_path / "extract.py").write_text(
        "from pydantic import BaseModel\nfrom etl import Extract, Pipeline\nfrom etl.testing import FakeLLM\n"
        "class Receipt(BaseModel):\n    total: float\n"
        f"pipeline = Pipeline('x', {str(source)!r}, [Extract(Receipt)], llm=FakeLLM())\n")
    (tmp_path / "classify.py").write_text(
        "from etl import Classify, Pipeline\nfrom etl.testing import FakeLLM\n"
        f"pipeline = Pipeline('y', {str(source)!r}, [Classify(['a', 'b'], 'Pick.')], llm=FakeLLM())\n")
    cli = CliRunner()
    failed = cli.invoke(app, ["run", str(tmp_path / "extract.py")], env={"ETL_DATABASE_URL": url})
    assert failed.exit_code == 1
    other = cli.invoke(app, ["run", str(tmp_path / "classify.py")], env={"ETL_DATABASE_URL": url})
    assert other.exit_code == 0, other.output
    assert counts(url)["stage_results"] == 1
    assert "is not an idem-etl typed table" in failed.output, failed.output


def test_a_store_that_refuses_for_good_stops_the_run_at_once(tmp_path: Path, postgres_server: str) -> None:
    """A database that does not exist, a SQLite path that cannot be opened: the run stops with the
    cause and says that retrying cannot help, instead of retrying for ETL_STORE_RETRY_S as if the
    database were restarting."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "1", "text": "one"}\n')
    (tmp_path / "p.py").write_text(
        "from etl import Classify, Pipeline\nfrom etl.testing import FakeLLM\n"
        f"pipeline = Pipeline('p', {str(source)!r}, [Classify(['a', 'b'], 'Pick.')], llm=FakeLLM())\n")
    (tmp_path / "a_file").write_text("")
    missing_db = create_engine(postgres_server).url.set(database=f"nope_{uuid.uuid4().hex[:8]}")
    for url, cause in ((missing_db.render_as_string(hide_password=False), "does not exist"),
                       (f"sqlite:///{tmp_path / 'a_file' / 'etl.db'}", "unable to open database file")):
        result = CliRunner().invoke(app, ["run", str(tmp_path / "p.py")],
                                    env={"ETL_DATABASE_URL": url, "ETL_STORE_RETRY_S": "120"})
        assert result.exit_code == 1
        assert "retrying cannot help" in result.output and cause in result.output, result.output
        assert "store_unavailable" not in result.output


async def test_eval_scores_a_tenant_with_its_own_stage_and_model(sqlite_url: str) -> None:
    from connectors.store import make_engine  # noqa: PLC0415
    from etl.quality.golden import evaluate, import_golden  # noqa: PLC0415
    from etl.runtime.execute import StagePlan  # noqa: PLC0415

    default, globex_model = FakeLLM(model_id="default-model"), FakeLLM(model_id="globex-model")
    p = Pipeline("scored", ListSource([]), [Classify(LABELS, "Kind?", name="kind")], store=sqlite_url,
                 tenant_overrides={"acme": {"kind": {"instructions": "Acme's own question?"}}},
                 tenant_llms={"globex": globex_model})
    engine = make_engine(sqlite_url)
    from connectors.store import upgrade  # noqa: PLC0415

    upgrade(engine)
    for tenant in ("acme", "globex", "initech"):
        import_golden(engine, "scored", "kind", [{"tenant": tenant, "doc_key": "g1", "content": f"{tenant} hi",
                                                  "expected": {"label": "receipt"}}])
    runs = {run["tenant"]: run for run in await evaluate(engine, p, default, "kind")}
    for tenant, model in (("acme", default), ("globex", globex_model), ("initech", default)):
        plan = StagePlan.of(p.stages_for(tenant)[0], model, 1)
        assert runs[tenant]["fingerprint"] == plan.fingerprint, tenant
        assert runs[tenant]["model"] == model.model_id, tenant
    assert len(globex_model.calls) == 1
    assert ["Acme's own question?" in r.messages[0]["content"] for r in default.calls].count(True) == 1


async def test_tenants_from_messages_share_one_plan(sqlite_url: str) -> None:
    """Tenants without overrides share the default plans: a stream of new tenants costs no memory
    per tenant in the executor (its per-plan facts stay one entry)."""
    from etl.runtime.wiring import build_runner  # noqa: PLC0415

    items = [{"id": "1", "tenant": f"tenant-{i}", "text": "same"} for i in range(300)]
    p = Pipeline("many", ListSource(items), [Classify(LABELS, "Kind?")], store=sqlite_url,
                 tenant_overrides={"vip": {"classify": {"instructions": "VIP?"}}})
    runner = build_runner(p, llm=FakeLLM())
    await runner.run()
    assert runner.executor.plans_for("tenant-1") is runner.executor.plans_for("tenant-299")
    assert runner.executor.plans_for("vip") is not runner.executor.plans_for("tenant-1")
    assert len(runner.executor._about_plans) == 1  # noqa: SLF001 - the cache under test


async def test_a_run_leaves_no_pooled_connection_open(sqlite_url: str) -> None:
    """Both engines of a SQLite store (ordinary work, migrations) are disposed at the end of a run:
    a process that runs pipelines again and again (a notebook, the property test) kept one open
    migration connection, and its page cache, per run."""
    from etl.runtime.wiring import build_runner  # noqa: PLC0415

    runner = build_runner(receipts(ReceiptV1, sqlite_url, docs(4)), llm=FakeLLM())
    await runner.run()
    store = runner.store
    assert store._ddl is not store.engine  # noqa: SLF001 - a file: migrations on their own engine
    assert store.engine.pool.checkedin() == 0 and store._ddl.pool.checkedin() == 0  # noqa: SLF001
