"""Tenant isolation the database enforces, tenant deletion, and nothing trusted from edited files.

Analysts are real PostgreSQL logins, each on its own connection through psycopg; what they may read
is decided by grants the owner writes (``etl analyst grant``), never by a setting they can change.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from connectors.store import make_engine, upgrade
from connectors.store import security
from connectors.store.purge import tenant_tables
from etl import Classify, Extract, Pipeline, Receipt, Router, run_pipeline
from etl.cli import app
from etl.quality.golden import evaluate, golden_document, import_golden
from etl.quality.stability import measure
from etl.tenancy import ReviewSampling
from etl.testing import FakeLLM, ListSource
from tests.helpers import rows

LABELS = ["billing", "technical", "account", "other"]
TENANTS = ("acme", "globex")
RECEIPT = {"company": "c", "date": "d", "address": "a", "total": 1}


def _answer(request: Any) -> Any:
    return "oops" if "[fault]" in request.messages[1]["content"] else {"label": "billing", **RECEIPT}


async def populate(url: str, tenants: tuple[str, ...] = TENANTS, *, store_text: bool = True) -> Pipeline:
    """Rows of every tenant in every table with a tenant column: results, typed rows, cache,
    calls, dead letters, review items, golden examples, evals, drift alerts, the router's texts,
    students and shadow checks, stability runs."""
    docs = [{"id": f"{t}{i}", "tenant": t, "text": f"{t} ticket {i}"} for i in range(30) for t in tenants]
    docs += [{"id": f"bad-{t}", "tenant": t, "text": f"{t} [fault]"} for t in tenants]
    p = Pipeline("support", ListSource(docs), [Classify(LABELS, "Route.", router=Router()), Extract(Receipt, "Extract.")],
                 store=url, review=ReviewSampling(rate=0.5, store_text=store_text))
    await run_pipeline(p, llm=FakeLLM(answer=_answer))
    engine = make_engine(url)
    try:
        for tenant in tenants:
            import_golden(engine, "support", "classify", [{"tenant": tenant, "doc_key": "g1", "content": "hi",
                                                           "expected": {"label": "billing"}}])
            await evaluate(engine, p, FakeLLM(), "classify", tenant)
        # a stability measurement per tenant (its rows in stability_runs and llm_calls)
        await measure(engine, p, FakeLLM(), "classify",
                      [golden_document({"tenant": t, "doc_key": "s1", "content": "hi", "id": 0}) for t in tenants], 2)
        with engine.begin() as conn:
            for tenant in tenants:
                conn.execute(text("INSERT INTO drift_alerts (pipeline, tenant, stage, metric, baseline, recent, score, "
                                  "threshold, \"window\") VALUES ('support', :t, 'classify', 'label_shift', 0, 0, 1, 3, 10)"),
                             {"t": tenant})
                sid = conn.execute(text(
                    "INSERT INTO students (pipeline, stage, tenant, fingerprint, version, status, reason, trained_on, "
                    "holdout, target, level, certified_on, covered, correct, lower_bound, agreement, agreement_lb, "
                    "agreement_n, mean_cost, spec, weights) VALUES ('support', 'classify', :t, 'f', 1, 'refused', 'r', "
                    "0, 'llm', 0.9, 0.95, 0, 0, 0, 0, 0, 0, 0, 0, '{}', '') RETURNING id"), {"t": tenant}).scalar_one()
                conn.execute(text("INSERT INTO router_checks (student_id, pipeline, tenant, stage, doc_key, cache_key, "
                                  "student_label, llm_label, agree) VALUES (:s, 'support', :t, 'classify', 'd', 'k', "
                                  "'billing', 'billing', true)"), {"s": sid, "t": tenant})
                # a long document's chunk rows (tests/integration/test_long_documents.py makes real ones)
                conn.execute(text("INSERT INTO stage_chunks (pipeline, tenant, doc_key, stage, ordinal, cache_key, "
                                  "char_start, char_end, page_start, page_end, cache_hit) VALUES ('support', :t, "
                                  "'long', 'receipt', 0, 'k', 0, 10, 1, 1, false)"), {"t": tenant})
    finally:
        engine.dispose()
    return p


def tenants_per_table(url: str, tables: list[str]) -> dict[str, dict[str, int]]:
    """As the owner: rows per tenant in each table."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {t: {tenant: n for tenant, n in conn.execute(text(
                f'SELECT tenant, count(*) FROM "{t}" WHERE tenant IS NOT NULL GROUP BY tenant'))} for t in tables}
    finally:
        engine.dispose()


def head_revision() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from connectors.store.sql import MIGRATIONS

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return str(ScriptDirectory.from_config(config).get_current_head())


def cli(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, list(args), env=env or {})


@pytest.fixture
def logins(postgres_url: str) -> Iterator[dict[str, str]]:
    """Three analyst logins (alice, bob, carol: unique per test; roles are cluster-wide) in the
    analyst group, each with its own URL; dropped afterwards."""
    suffix = uuid.uuid4().hex[:8]
    names = {who: f"{who}_{suffix}" for who in ("alice", "bob", "carol")}
    engine = create_engine(postgres_url)
    try:
        with engine.begin() as conn:
            for role in names.values():
                conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'"))
        yield names
    finally:
        with engine.begin() as conn:
            for role in names.values():
                conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        engine.dispose()


def as_login(url: str, role: str) -> Any:
    return create_engine(make_url(url).set(username=role, password="pw"))


def seen(conn: Any, relation: str) -> set[str]:
    return {t for (t,) in conn.execute(text(f'SELECT DISTINCT tenant FROM "{relation}"'))}


def all_seen(conn: Any, relations: list[str]) -> dict[str, set[str]]:
    return {r: seen(conn, r) for r in relations}


async def test_analysts_read_exactly_the_tenants_granted_to_them(postgres_url: str, logins: dict[str, str]) -> None:
    url = postgres_url
    await populate(url)
    result = cli("analyst", "init", "--db", url)
    assert result.exit_code == 0, result.output
    with make_engine(url).begin() as conn:
        for role in logins.values():
            conn.execute(text(f"GRANT {security.ANALYST_ROLE} TO {role}"))
    alice, bob, carol = logins["alice"], logins["bob"], logins["carol"]
    for role, tenant in ((alice, "acme"), (bob, "acme"), (bob, "globex"), (alice, "acme")):  # twice: a no-op
        result = cli("analyst", "grant", role, tenant, "--db", url)
        assert result.exit_code == 0, result.output
    listed = cli("analyst", "list", "--db", url)
    assert listed.exit_code == 0 and alice in listed.output and bob in listed.output, listed.output
    # every relation with tenant rows: core tables, the typed table, the views
    with make_engine(url).connect() as conn:
        tables = security.protected_tables(conn)
    relations = [*tables, "quality_daily", "eval_trend", "router_daily"]
    assert "receipt" in tables and {"documents", "review_queue", "dead_letters"} <= set(tables)
    owner = {r: set(n) for r, n in tenants_per_table(url, relations).items()}
    assert all(t == set(TENANTS) for t in owner.values()), owner  # both tenants have rows everywhere
    only = lambda tenants: {r: set(tenants) for r in relations}  # noqa: E731
    with make_engine(url).begin() as conn:
        conn.execute(text("ANALYZE"))
        assert conn.execute(text("SELECT count(*) FROM pg_stats WHERE tablename = ANY(:t)"), {"t": tables}).scalar_one()

    reader = as_login(url, alice)
    try:
        with reader.connect() as conn:
            assert all_seen(conn, relations) == only({"acme"})
            # nothing she can set widens it
            for widen in ("SET app.tenant = 'globex'", "SELECT set_config('app.tenant', 'globex', false)",
                          "RESET app.tenant", "RESET ALL", "SET app.tenant = ''", "SET SESSION app.tenant = 'globex'"):
                conn.execute(text(widen))
                assert all(s <= {"acme"} for s in all_seen(conn, relations).values()), widen
            conn.execute(text("SET app.tenant = 'acme'"))  # narrowing to her own tenant
            assert all_seen(conn, relations) == only({"acme"})
            conn.execute(text(f"SET ROLE {security.ANALYST_ROLE}"))  # the group has no grants of its own
            assert all_seen(conn, relations) == only(set())
            conn.execute(text("RESET ROLE"))
            conn.execute(text("SET row_security = off"))
            with pytest.raises(Exception, match="row-level security"):
                conn.execute(text("SELECT count(*) FROM documents"))
            conn.rollback()
            # her own grants only; no writes anywhere (not even a grant to herself)
            assert {tuple(r) for r in conn.execute(text("SELECT role, tenant FROM analyst_grants"))} == {(alice, "acme")}
            for write in (f"INSERT INTO analyst_grants (role, tenant) VALUES ('{alice}', 'globex')",
                          "INSERT INTO stage_results (pipeline) VALUES ('x')", "UPDATE documents SET doc_key = ''",
                          "DELETE FROM llm_cache", "DELETE FROM receipt", "UPDATE dead_letters SET status = 'replayed'",
                          "CREATE TABLE mine (x int)", "CREATE FUNCTION f() RETURNS int AS 'SELECT 1' LANGUAGE sql"):
                with pytest.raises(Exception, match="permission denied"):
                    conn.execute(text(write))
                conn.rollback()
            for relation in ("source_positions", "llm_claims", "alembic_version"):
                with pytest.raises(Exception, match="permission denied"):
                    conn.execute(text(f'SELECT * FROM "{relation}"'))
                conn.rollback()
            # planner statistics of protected tables (most common values...) are hidden from her
            assert conn.execute(text("SELECT count(*) FROM pg_stats WHERE tablename = ANY(:t)"),
                                {"t": tables}).scalar_one() == 0
    finally:
        reader.dispose()

    reader = as_login(url, bob)
    try:
        with reader.connect() as conn:
            assert all_seen(conn, relations) == only(set(TENANTS))
            conn.execute(text("SET app.tenant = 'globex'"))
            assert all_seen(conn, relations) == only({"globex"})
    finally:
        reader.dispose()

    reader = as_login(url, carol)  # in the group, no grant
    try:
        with reader.connect() as conn:
            conn.execute(text("SET app.tenant = 'acme'"))
            assert all_seen(conn, relations) == only(set())
    finally:
        reader.dispose()

    # a typed table created after the grants is covered too
    class Invoice(BaseModel):
        vendor: str
        total: float

    later = Pipeline("invoices", ListSource([{"id": f"{t}-inv", "tenant": t, "text": f"{t} invoice"} for t in TENANTS]),
                     [Extract(Invoice, "Extract.", table="invoice_fields")], store=url)
    await run_pipeline(later, llm=FakeLLM(answer=lambda r: {"vendor": "v", "total": 2.5}))
    reader = as_login(url, alice)
    try:
        with reader.connect() as conn:
            assert seen(conn, "invoice_fields") == {"acme"}
    finally:
        reader.dispose()

    # revoking takes effect for the next query
    assert cli("analyst", "revoke", alice, "acme", "--db", url).exit_code == 0
    reader = as_login(url, alice)
    try:
        with reader.connect() as conn:
            assert all_seen(conn, [*relations, "invoice_fields"]) == {r: set() for r in [*relations, "invoice_fields"]}
    finally:
        reader.dispose()


def test_grants_refuse_what_nobody_could_use(postgres_url: str) -> None:
    assert "does not exist" in cli("analyst", "grant", f"nobody_{uuid.uuid4().hex[:8]}", "acme", "--db",
                                   postgres_url).output
    assert "not to the group role" in cli("analyst", "grant", security.ANALYST_ROLE, "acme", "--db", postgres_url).output


def test_analyst_commands_need_postgres(sqlite_url: str, tmp_path: Path) -> None:
    result = cli("analyst", "list", "--db", sqlite_url)
    assert result.exit_code == 1 and "is not PostgreSQL" in result.output
    assert not (tmp_path / "etl.db").exists()  # refused before a store was made
    missing = cli("tenant", "purge", "globex", "--dry-run", "--db", sqlite_url)
    assert missing.exit_code == 1 and "no store at" in missing.output and not (tmp_path / "etl.db").exists()


def test_grants_refuse_unstorable_tenants_and_group_roles(postgres_url: str) -> None:
    result = cli("analyst", "grant", "etl", "a\x00b", "--db", postgres_url)
    assert result.exit_code == 1 and "NUL" in result.output and "Traceback" not in result.output
    group = f"group_{uuid.uuid4().hex[:8]}"
    with make_engine(postgres_url).begin() as conn:
        conn.execute(text(f"CREATE ROLE {group} NOLOGIN"))
    try:
        result = cli("analyst", "grant", group, "acme", "--db", postgres_url)
        assert result.exit_code == 1 and "cannot log in" in result.output
    finally:
        with make_engine(postgres_url).begin() as conn:
            conn.execute(text(f"DROP ROLE {group}"))


async def test_migrations_need_no_createrole(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An application user with no cluster-wide rights migrates and runs; the analyst group is an
    admin's step, before or after the migrations. (A fresh group name: roles are cluster-wide.)"""
    monkeypatch.setattr(security, "ANALYST_ROLE", f"etl_analyst_{uuid.uuid4().hex[:8]}")
    group = security.ANALYST_ROLE
    app_role, schema = f"app_{uuid.uuid4().hex[:8]}", f"app_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres_url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE ROLE {app_role} LOGIN NOCREATEROLE NOCREATEDB PASSWORD 'pw'"))
        conn.execute(text(f"GRANT {app_role} TO current_user"))  # so the test can clean up after it
        conn.execute(text(f"CREATE SCHEMA {schema} AUTHORIZATION {app_role}"))
    base = make_url(postgres_url)
    app_url = base.set(username=app_role, password="pw", query={"options": f"-csearch_path={schema}"})
    url = app_url.render_as_string(hide_password=False)
    try:
        engine = make_engine(url)
        upgrade(engine)  # without the group
        await populate(url, ("acme",))
        with engine.connect() as conn:
            assert conn.execute(text("SELECT rolcreaterole FROM pg_roles WHERE rolname = current_user")).scalar() is False
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head_revision()
        engine.dispose()
        result = cli("analyst", "init", "--db", url)
        assert result.exit_code == 1 and "may not create roles" in result.output and group in result.output
        with admin.begin() as conn:
            conn.execute(text(f"CREATE ROLE {group} NOLOGIN"))
        result = cli("analyst", "init", "--db", url)  # the owner grants read access on its tables
        assert result.exit_code == 0, result.output
        granted = {t for (t,) in rows(url, "SELECT table_name FROM information_schema.role_table_grants "
                                            f"WHERE grantee = '{group}' AND privilege_type = 'SELECT'")}
        assert granted == {"documents", "stage_results", "llm_cache", "llm_calls", "dead_letters", "golden_examples",
                           "eval_runs", "eval_results", "drift_alerts", "review_queue", "receipt", "analyst_grants",
                           "quality_daily", "eval_trend", "cache_texts", "students", "router_checks", "stage_chunks", "field_spans",
                           "router_daily", "stability_runs"}, granted
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
            conn.execute(text(f"DROP ROLE IF EXISTS {group}"))
            conn.execute(text(f"DROP ROLE {app_role}"))
        admin.dispose()


async def test_purge_deletes_every_row_of_one_tenant_and_nothing_else(store_url: str) -> None:
    p = await populate(store_url)
    if store_url.startswith("postgresql"):
        with make_engine(store_url).begin() as conn:  # a grant is a row of the tenant too
            conn.execute(text("INSERT INTO analyst_grants (role, tenant) VALUES ('someone', 'globex'), "
                              "('someone', 'acme')"))
    with make_engine(store_url).connect() as conn:
        tables = tenant_tables(conn)
    assert {"receipt", "documents", "stage_results", "llm_cache", "llm_calls", "dead_letters", "review_queue",
            "golden_examples", "eval_runs", "eval_results", "drift_alerts"} <= set(tables)
    before = tenants_per_table(store_url, tables)
    assert all(n.get("globex") and n.get("acme") for n in before.values()), before
    env = {"ETL_DATABASE_URL": store_url}

    dry = cli("tenant", "purge", "globex", "--dry-run", env=env)
    assert dry.exit_code == 0 and "nothing deleted" in dry.output, dry.output
    assert tenants_per_table(store_url, tables) == before
    refused = cli("tenant", "purge", "globex", env=env)  # no terminal to confirm on
    assert refused.exit_code == 1 and "--yes" in refused.output
    assert tenants_per_table(store_url, tables) == before

    result = cli("tenant", "purge", "globex", "--yes", env=env)
    assert result.exit_code == 0, result.output
    after = tenants_per_table(store_url, tables)
    print("\npurge figures (table: before -> after):",
          {t: (before[t], after[t]) for t in tables})
    assert all("globex" not in n for n in after.values()), after
    assert {t: n["acme"] for t, n in after.items()} == {t: n["acme"] for t, n in before.items()}
    total = sum(n["globex"] for n in before.values())
    assert f"deleted {total} row(s)" in result.output
    assert "nothing to delete" in cli("tenant", "purge", "globex", "--yes", env=env).output

    # positions are not a tenant's: a re-run of the source is a no-op, and the purge stays
    llm = FakeLLM(answer=_answer)
    await run_pipeline(Pipeline("support", p.source, p.stages, store=store_url, review=ReviewSampling(rate=0.5)),
                       llm=llm)
    assert not llm.calls and tenants_per_table(store_url, tables) == after


async def test_review_text_is_kept_only_if_chosen(sqlite_url: str) -> None:
    await populate(sqlite_url, ("acme",), store_text=False)
    kept = rows(sqlite_url, "SELECT content, count(*) FROM review_queue GROUP BY content")
    assert [c for c, _ in kept] == [""], kept


async def test_an_edited_review_file_cannot_move_data_between_tenants(tmp_path: Path, sqlite_url: str) -> None:
    await populate(sqlite_url)
    env = {"ETL_DATABASE_URL": sqlite_url}
    exported = tmp_path / "review.jsonl"
    assert cli("review", "export", "--out", str(exported), env=env).exit_code == 0
    items = [json.loads(line) for line in exported.read_text().splitlines()]
    acme = next(i for i in items if i["tenant"] == "acme" and i["stage"] == "classify")
    globex = next(i for i in items if i["tenant"] == "globex" and i["stage"] == "classify")
    snapshot = rows(sqlite_url, "SELECT * FROM review_queue ORDER BY id")

    def attempt(lines: list[dict[str, Any]]) -> Any:
        exported.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return cli("review", "import", str(exported), "--promote", env=env)

    edits = [
        {**acme, "tenant": "globex", "verdict": "correct"},  # acme's item relabelled as globex's
        {**acme, "content": globex["content"], "verdict": "correct"},  # another tenant's text
        {**globex, "id": acme["id"], "verdict": "correct"},  # globex's line pointed at acme's item
        {**acme, "pipeline": "other", "verdict": "correct"},
        {**acme, "output": {"label": "technical", "confidence": 1.0}, "verdict": "correct"},
        {**acme, "verdict": "incorrect", "corrected": {"label": "x", "company": "injected"}},
        {**acme, "verdict": "incorrect", "corrected": {"label": float("nan")}},
        {"id": globex["id"], "verdict": "incorrect", "corrected": {"label": "technical"}},  # by id alone
        {**{k: v for k, v in globex.items() if k != "content"}, "verdict": "correct"},
        {**acme, "id": 10**9, "verdict": "correct"},
        {**acme, "id": 2**64, "verdict": "correct"},
        {**acme, "verdict": "maybe"},
    ]
    for edit in edits:
        result = attempt([edit])
        assert result.exit_code == 1 and "line 1:" in result.output and "nothing imported" in result.output, (
            edit, result.output)
    # one bad line among good ones: the whole file is refused, naming the line
    result = attempt([{**acme, "verdict": "correct"}, {**globex, "tenant": "acme", "verdict": "correct"}])
    assert result.exit_code == 1 and "line 2:" in result.output and "tenant differs" in result.output
    assert rows(sqlite_url, "SELECT * FROM review_queue ORDER BY id") == snapshot
    assert rows(sqlite_url, "SELECT count(*) FROM golden_examples WHERE origin = 'review'") == [(0,)]

    # only verdict, corrected and reviewer come from the file: tenant and text come from the store
    result = attempt([{**acme, "verdict": "incorrect", "corrected": {"label": "account"}},
                      {**globex, "verdict": "correct"}])
    assert result.exit_code == 0, result.output
    promoted = rows(sqlite_url, "SELECT tenant, doc_key, content, expected FROM golden_examples "
                                "WHERE origin = 'review' ORDER BY tenant")
    assert [(t, k, c) for t, k, c, _ in promoted] == [("acme", acme["doc_key"], acme["content"]),
                                                       ("globex", globex["doc_key"], globex["content"])]
    assert json.loads(promoted[0][3]) == {"label": "account"}


def test_golden_import_rejects_bad_lines_by_number(tmp_path: Path, sqlite_url: str) -> None:
    upgrade(make_engine(sqlite_url))
    path = tmp_path / "golden.jsonl"
    lines = [
        json.dumps({"id": 1, "text": "fine", "label": "billing"}),
        "{not json",
        json.dumps({"id": 2, "label": "billing"}),
        json.dumps({"id": 3, "text": "t", "tenant": "a\u0000b", "label": "billing"}),
        '{"id": 4, "text": "t", "expected": {"total": NaN}}',
        json.dumps({"id": "1", "text": "same key as line 1", "label": "billing"}),
        json.dumps({"id": True, "text": "t", "label": "billing"}),
        json.dumps({"id": 5, "text": "t", "expected": {"n": 2**70}}),
        json.dumps({"id": 6, "text": "t", "tenant": "x" * 201, "label": "billing"}),
        json.dumps({"id": 7, "text": "t"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    result = cli("golden", "import", str(path), "--pipeline", "p", "--stage", "classify", "--db", sqlite_url)
    assert result.exit_code == 1, result.output
    assert "9 line(s) rejected, nothing imported" in result.output
    for number in range(2, 11):
        assert f"line {number}:" in result.output, (number, result.output)
    assert "line 1:" not in result.output
    assert rows(sqlite_url, "SELECT count(*) FROM golden_examples") == [(0,)]
    path.write_text(lines[0] + "\n")
    result = cli("golden", "import", str(path), "--pipeline", "p", "--stage", "classify", "--db", sqlite_url)
    assert result.exit_code == 0 and rows(sqlite_url, "SELECT doc_key FROM golden_examples") == [("1",)]


def test_an_existing_store_moves_to_grants(postgres_url: str) -> None:
    """A store at 0007 (policies by app.tenant, a typed table from before row security) gets the
    grant policy on every tenant table, the typed one included."""
    from alembic import command
    from alembic.config import Config

    from connectors.store.sql import MIGRATIONS

    engine = make_engine(postgres_url)
    with engine.begin() as conn:
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        config.attributes["connection"] = conn
        command.upgrade(config, "0007")
        conn.execute(text("CREATE POLICY tenant_isolation ON documents FOR SELECT "
                          "USING (tenant = current_setting('app.tenant', true))"))
        conn.execute(text("CREATE TABLE old_fields (pipeline varchar(200), tenant varchar(200), doc_key varchar(500), "
                          "total float, cache_key varchar(64), updated_at timestamptz)"))
    upgrade(engine)
    with engine.connect() as conn:
        policies = dict(conn.execute(text("SELECT tablename, qual FROM pg_policies WHERE schemaname = current_schema() "
                                          "AND policyname = 'tenant_isolation'")).all())
        secured = dict(conn.execute(text("SELECT relname, relrowsecurity FROM pg_class WHERE relname = ANY(:t) AND "
                                         "relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())"),
                                    {"t": list(policies)}).all())
    assert "old_fields" in policies and "documents" in policies
    assert all("analyst_grants" in qual and "current_user" in qual.lower() for qual in policies.values()), policies
    assert all(secured.values()), secured
    engine.dispose()
