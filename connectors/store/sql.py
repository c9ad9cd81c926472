"""The SQLAlchemy store: SQLite by default, PostgreSQL (psycopg 3) by URL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from sqlalchemy import (
    Connection,
    Engine,
    MetaData,
    ColumnElement,
    Table,
    any_,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    inspect,
    literal,
    null,
    select,
    text,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from connectors.store.base import Batch, CacheEntry, DocRef, Lookup, Store
from connectors.store.tables import (
    TYPED_KEY_COLUMNS,
    dead_letters,
    documents,
    llm_cache,
    llm_calls,
    llm_claims,
    review_queue,
    source_positions,
    stage_results,
    typed_table,
)
from connectors.store.security import protect_tenant_table
from dedup import Claims

MIGRATIONS = Path(__file__).parent / "migrations"
#: Rows per IN (...) query; keeps statements well under both backends' parameter limits.
_CHUNK = 500


def make_engine(url: str) -> Engine:
    """An engine with the pragmas that make SQLite a fair embedded default (WAL, busy timeout)."""
    engine = create_engine(url, pool_pre_ping=True)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

    return engine


def upgrade(engine: Engine) -> None:
    """Runs the Alembic migrations to head on ``engine`` (what ``etl db upgrade`` does)."""
    with engine.begin() as conn:
        migrate(conn)


#: Any constant: the PostgreSQL advisory lock that serialises workers migrating at the same time.
_MIGRATION_LOCK = 0x1DE3E7


def migrate(conn: Connection) -> None:
    """Migrates to head inside the caller's transaction (serialised across workers on PostgreSQL)."""
    from alembic import command  # noqa: PLC0415 - alembic is only needed when migrating
    from alembic.config import Config  # noqa: PLC0415

    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    command.upgrade(config, "head")


def upsert(conn: Connection, table: Table, rows: list[dict[str, Any]], keys: Sequence[str],
           changed_when: str | None) -> None:
    """Inserts rows; on a key conflict updates the row only where ``changed_when`` differs (so a
    redelivery rewrites nothing), or does nothing when ``changed_when`` is None."""
    if not rows:
        return
    stmt = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(table)
    if changed_when is None:
        stmt = stmt.on_conflict_do_nothing(index_elements=list(keys))
    else:
        updates = {c: stmt.excluded[c] for c in rows[0] if c not in keys}
        if "updated_at" in table.c:
            updates["updated_at"] = func.now()
        stmt = stmt.on_conflict_do_update(
            index_elements=list(keys), set_=updates,
            where=table.c[changed_when] != stmt.excluded[changed_when],
        )
    conn.execute(stmt, rows)


def _chunks(items: list[Any], size: int = _CHUNK) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _members(conn: Connection, values: list[Any], *columns: ColumnElement[Any]) -> Iterator[list[ColumnElement[bool]]]:
    """``column IN values`` for each of ``columns``, in as few statements as it takes: one
    ``= ANY(array)`` on PostgreSQL (one parameter however many values and columns, so the statement
    is planned once and the values sent once), IN lists on SQLite (no arrays, limited parameters)."""
    if not values:
        return
    if conn.dialect.name == "postgresql":
        values_param = bindparam("members", values, type_=postgresql.ARRAY(columns[0].type))
        yield [column == any_(values_param) for column in columns]
        return
    for chunk in _chunks(values, _CHUNK // len(columns)):
        yield [column.in_(chunk) for column in columns]


#: See ``SqlStore.unsettled``: (tenant, doc key, stage, cache key) rows with no stored result for
#: exactly that key, and documents with an open dead letter; index probes by (pipeline, doc key).
_UNSETTLED = text("""
WITH expected AS (
    SELECT e->>0 AS tenant, e->>1 AS doc_key, e->>2 AS stage, e->>3 AS cache_key
    FROM json_array_elements(CAST(:expected AS json)) AS e
)
SELECT e.tenant, e.doc_key FROM expected AS e
LEFT JOIN stage_results AS r
    ON r.pipeline = :pipeline AND r.tenant = e.tenant AND r.doc_key = e.doc_key AND r.stage = e.stage
WHERE r.cache_key IS DISTINCT FROM e.cache_key
UNION
SELECT e.tenant, e.doc_key FROM expected AS e
WHERE EXISTS (SELECT 1 FROM dead_letters AS d WHERE d.pipeline = :pipeline AND d.status = 'open'
              AND d.tenant = e.tenant AND d.doc_key = e.doc_key)
""")


class SqlStore(Store, Claims):
    """A :class:`Store` (and the workers' shared :class:`Claims`) on any SQLAlchemy URL that SQLite
    or PostgreSQL understands."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
        self._insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        self._typed_meta = MetaData()
        self._typed: dict[str, Table] = {}

    def prepare(self, typed_tables: Sequence[tuple[str, type[BaseModel]]]) -> None:
        with self.engine.begin() as conn:  # one transaction, so workers starting together take turns
            migrate(conn)
            for name, schema in typed_tables:
                self._prepare_typed(conn, name, schema)

    def _prepare_typed(self, conn: Connection, name: str, schema: type[BaseModel]) -> None:
        table = self._typed.get(name) or typed_table(name, schema, self._typed_meta)
        self._typed[name] = table
        existing = inspect(conn).get_columns(name) if inspect(conn).has_table(name) else None
        if existing is None:
            table.create(conn)
            if conn.dialect.name == "postgresql":
                protect_tenant_table(conn, name)  # analysts see typed rows of their tenant only
            return
        have = {c["name"] for c in existing}
        want = {c.name for c in table.columns}
        if have != want:
            raise ValueError(
                f"table {name!r} has columns {sorted(have)} but schema {schema.__name__} needs "
                f"{sorted(want)}; give the Extract stage a new table= name or migrate the table"
            )

    def lookup(self, pipeline: str, docs: Iterable[DocRef], cache_keys: Iterable[str],
               positions: Iterable[tuple[str, int, int]] = (), *, outputs: bool = True) -> Lookup:
        refs = set(docs)
        found = Lookup(results={}, dead={}, cache={})
        r, d = stage_results.c, dead_letters.c
        with self.engine.connect() as conn:
            for chunk in _chunks(sorted(set(positions))):
                rows = conn.execute(select(d.stream, d.partition, d.message_offset).where(
                    d.pipeline == pipeline, tuple_(d.stream, d.partition, d.message_offset).in_(chunk)))
                found.dead_positions.update((stream, partition, offset) for stream, partition, offset in rows)
            # Stored results and open dead letters in one statement, by members of one indexed column
            # (row-value IN lists of hundreds of pairs plan badly); rows of other tenants with the
            # same key are dropped here.
            for of_results, of_dead in _members(conn, list({key for _, key in refs}), r.doc_key, d.doc_key):
                statement = union_all(
                    select(literal("result"), r.tenant, r.doc_key, r.stage, r.cache_key,
                           r.output if outputs else null()).where(r.pipeline == pipeline, of_results),
                    select(literal("dead"), d.tenant, d.doc_key, null(), d.cache_key, null()).where(
                        d.pipeline == pipeline, d.status == "open", of_dead),
                )
                for kind, tenant, key, stage, cache_key, output in conn.execute(statement).all():
                    if (tenant, key) not in refs:
                        continue
                    if kind == "result":
                        found.results[(tenant, key, stage)] = (cache_key, output)
                    else:
                        found.dead.setdefault((tenant, key), set()).add(cache_key)
            # A key whose result is already stored needs no cache look-up (every redelivery).
            stored = {cache_key for cache_key, _ in found.results.values()}
            for (member,) in _members(conn, sorted(set(cache_keys) - stored), llm_cache.c.cache_key):
                for row in conn.execute(select(llm_cache).where(member)).mappings():
                    found.cache[row["cache_key"]] = CacheEntry(**{k: row[k] for k in CacheEntry.__dataclass_fields__})
        return found

    def unsettled(self, pipeline: str, expected: Sequence[tuple[str, str, str, str]]) -> set[DocRef]:
        if self.engine.dialect.name != "postgresql":
            return super().unsettled(pipeline, expected)
        # PostgreSQL compares on its side and sends back only what is not settled: a replay's
        # look-up returns no rows at all. The expectations travel as one JSON parameter.
        with self.engine.connect() as conn:
            rows = conn.execute(_UNSETTLED, {"pipeline": pipeline, "expected": json.dumps(expected)})
            return {(tenant, key) for tenant, key in rows}

    def write(self, pipeline: str, batch: Batch) -> None:
        with self.engine.begin() as conn:
            self._write(conn, pipeline, batch)

    def claim(self, key: str, owner: str, lease_s: float) -> bool:
        return key in self.claim_many([key], owner, lease_s)

    def claim_many(self, keys: Sequence[str], owner: str, lease_s: float) -> set[str]:
        """Claims what it can of ``keys`` in one transaction; a key already cached is not claimed
        (whoever asks should read the cache), so a claim never outlives its result."""
        now = time.time()
        if not keys:
            return set()
        with self.engine.begin() as conn:
            wanted = [{"cache_key": k, "owner": owner, "expires_at": now + lease_s} for k in keys]
            stmt = self._insert(llm_claims)
            stmt = stmt.on_conflict_do_update(
                index_elements=["cache_key"],
                set_={"owner": stmt.excluded.owner, "expires_at": stmt.excluded.expires_at},
                where=(llm_claims.c.expires_at < now) | (llm_claims.c.owner == owner),
            ).returning(llm_claims.c.cache_key)
            claimed = set(conn.execute(stmt, wanted).scalars())
            # The key may be cached already (the caller looked before this batch), or a holder may
            # have committed its result (and dropped its claim) just before the insert; this later
            # statement sees that commit, so such a claim is given back.
            late = set(conn.execute(select(llm_cache.c.cache_key).where(llm_cache.c.cache_key.in_(claimed))).scalars()) \
                if claimed else set()
            if late:
                conn.execute(delete(llm_claims).where(llm_claims.c.cache_key.in_(late), llm_claims.c.owner == owner))
            return claimed - late

    def tokens_spent(self, tenant: str, since: datetime) -> int:
        """Tokens a tenant's model attempts used since ``since`` (any pipeline): for budgets."""
        with self.engine.connect() as conn:
            return int(conn.execute(
                select(func.coalesce(func.sum(llm_calls.c.tokens_in + llm_calls.c.tokens_out), 0)).where(
                    llm_calls.c.tenant == tenant, llm_calls.c.outcome != "cache_hit", llm_calls.c.created_at >= since)
            ).scalar_one())

    def sampled_labels(self, pipeline: str) -> set[tuple[str, str, str]]:
        """(tenant, stage, label) already queued for review as first sightings."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(review_queue.c.tenant, review_queue.c.stage, review_queue.c.output).where(
                review_queue.c.pipeline == pipeline, review_queue.c.sampled_because == "first_label"))
            return {(t, s, (json.loads(o) if isinstance(o, str) else o).get("label")) for t, s, o in rows}

    def stored_position(self, pipeline: str, stream: str, partition: int) -> int | None:
        with self.engine.connect() as conn:
            return conn.execute(
                select(source_positions.c.next_offset).where(
                    source_positions.c.pipeline == pipeline,
                    source_positions.c.stream == stream,
                    source_positions.c.partition == partition,
                )
            ).scalar_one_or_none()

    # -- one transaction ---------------------------------------------------------------------

    def _write(self, conn: Connection, pipeline: str, batch: Batch) -> None:
        docs: dict[DocRef, dict[str, Any]] = {}
        results: dict[tuple[str, str, str], dict[str, Any]] = {}
        typed: dict[str, dict[DocRef, dict[str, Any]]] = {}
        cache: dict[str, dict[str, Any]] = {}
        calls: list[dict[str, Any]] = []
        dead: list[dict[str, Any]] = []
        # Later outcomes for the same document win (the newest content); rows are de-duplicated
        # here because one statement may not touch the same row twice on PostgreSQL.
        for outcome in batch.outcomes:
            doc = outcome.document
            if doc is not None:
                ref = (doc.tenant, doc.key)
                docs[ref] = {
                    "pipeline": pipeline, "tenant": doc.tenant, "doc_key": doc.key,
                    "content_hash": doc.content_hash, "stream": doc.position.stream,
                    "partition": doc.position.partition, "message_offset": doc.position.offset,
                    "received_at": doc.received_at,
                }
                for result in outcome.results:
                    p = result.provenance
                    results[(*ref, result.stage)] = {
                        "pipeline": pipeline, "tenant": doc.tenant, "doc_key": doc.key, "stage": result.stage,
                        "output": result.output, **p.model_dump(),
                    }
                for table, fields in outcome.typed_rows:
                    typed.setdefault(table, {})[ref] = {
                        "pipeline": pipeline, "tenant": doc.tenant, "doc_key": doc.key, **fields,
                    }
            for entry in outcome.cache:
                cache[entry.cache_key] = vars(entry)
            calls.extend({"pipeline": pipeline, **c.model_dump()} for c in outcome.calls)
            if (letter := outcome.dead_letter) is not None:
                dead.append({
                    "pipeline": pipeline, "stream": letter.position.stream,
                    "partition": letter.position.partition, "message_offset": letter.position.offset,
                    **letter.model_dump(exclude={"position"}),
                })
        upsert(conn, documents, list(docs.values()), ("pipeline", "tenant", "doc_key"), "content_hash")
        upsert(conn, stage_results, list(results.values()),
                     ("pipeline", "tenant", "doc_key", "stage"), "cache_key")
        for name, rows in typed.items():
            upsert(conn, self._typed[name], list(rows.values()), TYPED_KEY_COLUMNS, "cache_key")
        upsert(conn, llm_cache, list(cache.values()), ("cache_key",), None)
        if dead:
            # A message that fails again (a replay) keeps one dead letter, with the latest reason.
            stmt = self._insert(dead_letters)
            stmt = stmt.on_conflict_do_update(
                index_elements=["pipeline", "stream", "partition", "message_offset"],
                set_={c: stmt.excluded[c] for c in ("tenant", "doc_key", "stage", "cache_key", "reason", "detail",
                                                    "raw_output", "status")},
            )
            conn.execute(stmt, dead)
        resolved = [
            {"p": pipeline, "t": o.document.tenant, "k": o.document.key, "s": o.document.position.stream,
             "pa": o.document.position.partition, "o": o.document.position.offset}
            for o in batch.outcomes if o.resolves_dead_letter and o.document is not None and o.dead_letter is None
        ]
        if resolved:
            c = dead_letters.c
            conn.execute(
                update(dead_letters).where(
                    c.pipeline == bindparam("p"), c.status == "open",
                    ((c.tenant == bindparam("t")) & (c.doc_key == bindparam("k")))
                    | ((c.stream == bindparam("s")) & (c.partition == bindparam("pa"))
                       & (c.message_offset == bindparam("o"))),
                ).values(status="replayed"),
                resolved,
            )
        if calls:
            conn.execute(llm_calls.insert(), calls)
        reviews = [
            {"pipeline": pipeline, "tenant": o.document.tenant, "stage": stage, "doc_key": o.document.key,
             "content": o.document.content, "output": output, "sampled_because": why}
            for o in batch.outcomes if o.document is not None for stage, output, why in o.reviews
        ]
        upsert(conn, review_queue, reviews, ("pipeline", "tenant", "doc_key", "stage"), None)
        # Results and failures are durable now: nobody needs to wait on these keys any more.
        done = sorted(set(cache) | {d["cache_key"] for d in dead if d["cache_key"]})
        for (member,) in _members(conn, done, llm_claims.c.cache_key):
            conn.execute(delete(llm_claims).where(member))
        positions = [
            {"pipeline": pipeline, "stream": stream, "partition": partition, "next_offset": offset}
            for (stream, partition), offset in batch.positions.items()
        ]
        if positions:
            # Positions only move forward: a deliberate replay from 0 must not rewind them.
            stmt = self._insert(source_positions)
            stmt = stmt.on_conflict_do_update(
                index_elements=["pipeline", "stream", "partition"],
                set_={"next_offset": stmt.excluded.next_offset, "updated_at": func.now()},
                where=source_positions.c.next_offset < stmt.excluded.next_offset,
            )
            conn.execute(stmt, positions)
