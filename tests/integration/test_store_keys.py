"""Store keys that lead with the tenant (migration 0017, for a store distributed by tenant): every
primary and unique key of a tenant table starts with the tenant, an existing store moves to them
with its rows, and the promise holds across the move (a redelivery costs no call and writes no row;
one dead letter per message position)."""

from __future__ import annotations

import json
from pathlib import Path

from alembic import command
from alembic.config import Config
import pytest
from pydantic import BaseModel
from sqlalchemy import create_engine, inspect
from typer.testing import CliRunner

from connectors.sources.dead_letters import DeadLetterSource
from connectors.store import make_engine
from connectors.store.base import Batch, DocumentOutcome
from connectors.store.sql import MIGRATIONS, SqlStore
from etl import Classify, Extract, Pipeline, run_pipeline
from etl.cli.app import app
from etl.runtime.decode import Decoder
from etl.runtime.wiring import build_runner
from etl.settings import Settings
from etl.testing import FakeLLM, ListSource
from schemas import DeadLetter, Position
from tests.helpers import counts, rows

LABELS = ["invoice", "receipt"]
TABLES = (*("documents", "stage_results", "llm_cache", "llm_calls", "source_positions", "dead_letters"),
          "totals", "review_queue")


class Total(BaseModel):
    total: float


def _alembic(url: str, revision: str, up: bool) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS))
            config.attributes["connection"] = conn
            (command.upgrade if up else command.downgrade)(config, revision)
    finally:
        engine.dispose()


def _pipeline(source: Path, url: str) -> Pipeline:
    return Pipeline("keys", source, [Classify(LABELS, name="kind"), Extract(Total, "The total.", table="totals")],
                    store=url)


def _input(tmp_path: Path) -> Path:
    lines = [json.dumps({"id": f"d{i}", "tenant": ["acme", "globex"][i % 2], "text": f"receipt {i}"}) for i in range(6)]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join([*lines, "{bad json"]) + "\n")  # a message whose tenant cannot be read
    return f


def _leading_keys(url: str) -> dict[str, list[list[str]]]:
    """Each tenant table's primary key and unique indexes, as PostgreSQL holds them."""
    found: dict[str, list[list[str]]] = {}
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            for table, columns in conn.exec_driver_sql(
                    "SELECT c.relname, array_agg(a.attname ORDER BY k.n) FROM pg_index i "
                    "JOIN pg_class c ON c.oid = i.indrelid AND c.relnamespace = current_schema()::regnamespace "
                    "CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) "
                    "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum "
                    "WHERE i.indisunique AND EXISTS (SELECT 1 FROM pg_attribute t WHERE t.attrelid = c.oid "
                    "AND t.attname = 'tenant' AND NOT t.attisdropped) "
                    "GROUP BY i.indexrelid, c.relname ORDER BY 1, 2").all():
                found.setdefault(table, []).append(list(columns))
    finally:
        engine.dispose()
    return found


async def test_every_key_of_a_tenant_table_leads_with_the_tenant(postgres_url: str, tmp_path: Path) -> None:
    await (run_pipeline(_pipeline(_input(tmp_path), postgres_url), llm=FakeLLM()))
    keys = _leading_keys(postgres_url)
    # every table with a tenant column, the typed table a run made included (analyst_grants is the
    # access table, keyed by login first: replicated to every node, not distributed)
    engine = create_engine(postgres_url)
    found = inspect(engine)
    with_tenant = {t for t in found.get_table_names() if "tenant" in {c["name"] for c in found.get_columns(t)}}
    engine.dispose()
    assert with_tenant - {"analyst_grants"} <= set(keys), with_tenant - set(keys)
    wrong = {t: k for t, ks in keys.items() if t != "analyst_grants" for k in ks if k[0] != "tenant"}
    assert wrong == {}
    assert ["tenant", "cache_key"] in keys["llm_cache"] and ["tenant", "call_id"] in keys["llm_calls"]
    assert ["tenant", "pipeline", "stream", "partition", "message_offset"] in keys["dead_letters"]
    assert ["tenant", "pipeline", "doc_key"] in keys["totals"]
    assert rows(postgres_url, "SELECT tenant, reason FROM dead_letters") == [("", "bad_input")]


async def test_an_existing_store_moves_to_the_new_keys_and_a_redelivery_stays_a_no_op(
        store_url: str, tmp_path: Path) -> None:
    source = _input(tmp_path)
    first = FakeLLM()
    await run_pipeline(_pipeline(source, store_url), llm=first)
    assert len(first.calls) == 12
    _alembic(store_url, "0016", up=False)  # the store as idem-etl before 0017 left it
    old = counts(store_url, TABLES)
    assert rows(store_url, "SELECT tenant FROM dead_letters") == [(None,)]
    if store_url.startswith("postgresql"):
        assert ["tenant", "cache_key"] not in _leading_keys(store_url)["llm_cache"]
        assert all(k[0] != "tenant" for k in _leading_keys(store_url).get("documents", []))
    _alembic(store_url, "head", up=True)
    assert counts(store_url, TABLES) == old and old["documents"] == 6 and old["totals"] == 6
    assert rows(store_url, "SELECT tenant FROM dead_letters") == [("",)]
    if store_url.startswith("postgresql"):
        assert all(k[0] == "tenant" for t, ks in _leading_keys(store_url).items() if t != "analyst_grants"
                   for k in ks)

    again = FakeLLM()
    stats = await run_pipeline(_pipeline(source, store_url), llm=again)
    assert again.calls == [] and stats.llm_calls == 0 and stats.results_written == 0
    assert counts(store_url, TABLES) == old
    # and new documents write through every new conflict target (a target no unique index matches
    # is refused when the statement is prepared, conflict or not)
    source.write_text(source.read_text() + json.dumps({"id": "d9", "tenant": "acme", "text": "receipt 9"}) + "\n{worse\n")
    more = FakeLLM()
    await run_pipeline(_pipeline(source, store_url), llm=more)
    assert len(more.calls) == 2
    assert counts(store_url, TABLES) == {**old, "documents": 7, "stage_results": 14, "llm_cache": 14, "llm_calls": 14,
                                         "totals": 7, "dead_letters": 2}


def test_a_worker_does_not_rebuild_an_existing_store_s_keys_on_its_own(sqlite_url: str, tmp_path: Path) -> None:
    import asyncio

    from etl.errors import ConfigError

    asyncio.run(run_pipeline(_pipeline(_input(tmp_path), sqlite_url), llm=FakeLLM()))
    _alembic(sqlite_url, "0016", up=False)
    with pytest.raises(ConfigError, match="0017 rebuilds.*stop the workers, then run `etl db upgrade"):
        asyncio.run(run_pipeline(_pipeline(_input(tmp_path), sqlite_url), llm=FakeLLM()))
    assert rows(sqlite_url, "SELECT version_num FROM alembic_version") == [("0016",)]
    result = CliRunner().invoke(app, ["db", "upgrade", "--db", sqlite_url])
    assert result.exit_code == 0, result.output
    again = FakeLLM()
    asyncio.run(run_pipeline(_pipeline(_input(tmp_path), sqlite_url), llm=again))
    assert again.calls == []


async def test_a_message_s_letter_moves_to_the_tenant_it_reads_as_now(store_url: str) -> None:
    """Bad input (too big: no tenant, ''), then, with max_bytes raised, the same message decodes
    and its stage fails: still one letter at that position, now under the document's tenant."""
    value = json.dumps({"id": "x", "tenant": "acme", "text": "hello " * 30}).encode()

    def run(max_bytes: int) -> Pipeline:
        return Pipeline("p", ListSource([value]), [Classify(LABELS)], store=store_url,
                        decoder=Decoder(max_bytes=max_bytes))

    await run_pipeline(run(64), llm=FakeLLM())
    assert rows(store_url, "SELECT tenant, reason, message_offset FROM dead_letters") == [("", "bad_input", 0)]
    await run_pipeline(run(4096), llm=FakeLLM(answer=lambda r: "nonsense"))
    assert rows(store_url, "SELECT tenant, reason, message_offset, doc_key FROM dead_letters") == [
        ("acme", "schema_invalid", 0, "x")]
    again = FakeLLM(answer=lambda r: "nonsense")
    await run_pipeline(run(4096), llm=again)
    assert again.calls == [] and rows(store_url, "SELECT count(*) FROM dead_letters") == [(1,)]


async def test_a_moved_letter_keeps_its_id_so_a_replay_meets_it_once(store_url: str) -> None:
    """``etl dlq replay`` reads open letters by id: a letter that moves tenant (bad input that now
    decodes, then fails at its stage) must not come round again in the same replay, paying again.
    Found by review: the moved row took a new id, and 10 letters were replayed 20 times."""
    values = [json.dumps({"id": f"x{i}", "tenant": "acme", "text": f"hello {i} " * 30}).encode() for i in range(10)]

    def pipeline(max_bytes: int) -> Pipeline:
        return Pipeline("p", ListSource(values), [Classify(LABELS)], store=store_url,
                        decoder=Decoder(max_bytes=max_bytes))

    await run_pipeline(pipeline(64), llm=FakeLLM())
    ids = rows(store_url, "SELECT id FROM dead_letters WHERE tenant = '' ORDER BY id")
    replay = pipeline(4096)
    replay.source = DeadLetterSource(make_engine(store_url), "p")
    llm = FakeLLM(answer=lambda r: "nonsense", latency_s=0.02)
    stats = await build_runner(replay, Settings(max_in_flight=2, flush_size=1, flush_interval_s=0.01), llm=llm,
                               replaying_dead_letters=True).run()
    assert stats.messages == 10 and len(llm.calls) == 20  # each asked once, and once repaired
    assert rows(store_url, "SELECT id FROM dead_letters WHERE tenant = 'acme' ORDER BY id") == ids


def test_a_moved_letter_keeps_its_published_mark(store_url: str) -> None:
    """A letter still waiting for the dead-letter topic keeps waiting when it moves tenant, and one
    already sent is not sent again (found by review: the marks were OR-ed, and a letter written
    without the outbox, as every replay writes, was never sent)."""
    store = SqlStore(store_url)
    store.prepare([])

    def letter(tenant: str | None, reason: str, offset: int) -> DocumentOutcome:
        return DocumentOutcome(document=None, dead_letter=DeadLetter(
            position=Position(stream="s", offset=offset), reason=reason, detail="d", payload=b"x", tenant=tenant))

    store.write("o", Batch(outcomes=[letter(None, "bad_input", 1)], outbox=True))  # waiting
    store.write("o", Batch(outcomes=[letter(None, "bad_input", 2)], outbox=False))  # sent
    store.write("o", Batch(outcomes=[letter("acme", "store_rejected", 1), letter("acme", "store_rejected", 2)],
                           outbox=False))
    assert rows(store_url, "SELECT message_offset, tenant, reason, published FROM dead_letters ORDER BY 1") == [
        (1, "acme", "store_rejected", False), (2, "acme", "store_rejected", True)]
    store.dispose()


def test_no_one_names_the_tenant_of_letters_without_one() -> None:
    """'' marks a letter whose message named no tenant: not a tenant to decode into, grant or purge."""
    with pytest.raises(ValueError, match="default_tenant is blank"):
        Decoder(default_tenant=" ")
    for args in (["analyst", "grant", "someone", ""], ["tenant", "purge", " ", "--yes"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code != 0 and "blank" in result.output, (args, result.output)
