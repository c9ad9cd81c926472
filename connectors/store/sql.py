"""The SQLAlchemy store: SQLite by default, PostgreSQL (psycopg 3) by URL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from sqlalchemy import (
    Connection,
    Engine,
    MetaData,
    Table,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    inspect,
    select,
    tuple_,
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


def _chunks(items: list[Any]) -> Iterable[list[Any]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]


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
               positions: Iterable[tuple[str, int, int]] = ()) -> Lookup:
        refs = set(docs)
        found = Lookup(results={}, dead={}, cache={})
        # Plain IN lists on one indexed column: row-value IN lists of hundreds of pairs plan badly.
        # Rows of other tenants with the same key are filtered out here.
        doc_keys = sorted({key for _, key in refs})
        with self.engine.connect() as conn:
            for chunk in _chunks(sorted(set(positions))):
                at = tuple_(dead_letters.c.stream, dead_letters.c.partition, dead_letters.c.message_offset)
                rows = conn.execute(select(dead_letters.c.stream, dead_letters.c.partition,
                                           dead_letters.c.message_offset)
                                    .where(dead_letters.c.pipeline == pipeline, at.in_(chunk)))
                found.dead_positions.update((stream, partition, offset) for stream, partition, offset in rows)
            for chunk in _chunks(doc_keys):
                rows = conn.execute(
                    select(stage_results.c.tenant, stage_results.c.doc_key, stage_results.c.stage,
                           stage_results.c.cache_key, stage_results.c.output)
                    .where(stage_results.c.pipeline == pipeline, stage_results.c.doc_key.in_(chunk))
                )
                for tenant, key, stage, cache_key, output in rows:
                    if (tenant, key) in refs:
                        found.results[(tenant, key, stage)] = (cache_key, output)
                rows = conn.execute(
                    select(dead_letters.c.tenant, dead_letters.c.doc_key, dead_letters.c.cache_key).where(
                        dead_letters.c.pipeline == pipeline, dead_letters.c.status == "open",
                        dead_letters.c.doc_key.in_(chunk))
                )
                for tenant, key, cache_key in rows:
                    if (tenant, key) in refs:
                        found.dead.setdefault((tenant, key), set()).add(cache_key)
            # A key whose result is already stored needs no cache look-up (every redelivery).
            stored = {cache_key for cache_key, _ in found.results.values()}
            for chunk in _chunks(sorted(set(cache_keys) - stored)):
                for row in conn.execute(select(llm_cache).where(llm_cache.c.cache_key.in_(chunk))).mappings():
                    found.cache[row["cache_key"]] = CacheEntry(**{k: row[k] for k in CacheEntry.__dataclass_fields__})
        return found

    def write(self, pipeline: str, batch: Batch) -> None:
        with self.engine.begin() as conn:
            self._write(conn, pipeline, batch)

    def claim(self, key: str, owner: str, lease_s: float) -> bool:
        return key in self.claim_many([key], owner, lease_s)

    def claim_many(self, keys: Sequence[str], owner: str, lease_s: float) -> set[str]:
        """Claims what it can of ``keys`` in one transaction; a key already cached is not claimed
        (whoever asks should read the cache), so a claim never outlives its result."""
        now = time.time()
        with self.engine.begin() as conn:
            cached = set(conn.execute(select(llm_cache.c.cache_key).where(llm_cache.c.cache_key.in_(keys))).scalars())
            wanted = [{"cache_key": k, "owner": owner, "expires_at": now + lease_s} for k in keys if k not in cached]
            if not wanted:
                return set()
            stmt = self._insert(llm_claims)
            stmt = stmt.on_conflict_do_update(
                index_elements=["cache_key"],
                set_={"owner": stmt.excluded.owner, "expires_at": stmt.excluded.expires_at},
                where=(llm_claims.c.expires_at < now) | (llm_claims.c.owner == owner),
            ).returning(llm_claims.c.cache_key)
            claimed = set(conn.execute(stmt, wanted).scalars())
            # A holder may have committed its result (and dropped its claim) between the first look
            # and the insert; this statement sees that commit, so such a claim is given back.
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
        for chunk in _chunks(done):
            conn.execute(delete(llm_claims).where(llm_claims.c.cache_key.in_(chunk)))
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
