"""Store keys that lead with the tenant (migration 0017, for a store distributed by tenant): every
primary and unique key of a tenant table starts with the tenant, an existing store moves to them
with its rows, and the promise holds across the move (a redelivery costs no call and writes no row;
one dead letter per message position)."""

from __future__ import annotations

import json
from pathlib import Path

from alembic import command
from alembic.config import Config
from pydantic import BaseModel
from sqlalchemy import create_engine, inspect

from connectors.store.sql import MIGRATIONS
from etl import Classify, Extract, Pipeline, run_pipeline
from etl.runtime.decode import Decoder
from etl.testing import FakeLLM, ListSource
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


async def test_a_message_s_letter_moves_to_the_tenant_it_reads_as_now(store_url: str) -> None:
    """Bad input (too big: no tenant, ''), then, with max_bytes raised, the same message decodes
    and its stage fails: still one letter at that position, now under the document's tenant,
    published once (the mark moves with it)."""
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
