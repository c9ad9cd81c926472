"""The SQLAlchemy store: SQLite by default, PostgreSQL (psycopg 3) by URL."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import structlog
from sqlalchemy import (
    Connection,
    Engine,
    MetaData,
    Table,
    create_engine,
    delete,
    event,
    func,
    literal,
    null,
    select,
    text,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from connectors.store.base import Batch, CacheEntry, DocRef, Lookup, Store, TypedTable, Version
from connectors.store.tables import (
    NO_TENANT,
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
from connectors.store.evolve import Change, MigrationNeeded, apply, changes
from connectors.store.security import protect_tenant_table
from connectors.store.write import (
    BatchWriter,
    chunks,
    db_now,
    is_transient,
    lock_claims,
    members,
    rejected_by_value,
    write_apart,
)
from dedup import Claims
from schemas import DeadLetter, Position

MIGRATIONS = Path(__file__).parent / "migrations"
log = structlog.get_logger("connectors.store")

__all__ = ["SqlStore", "is_transient", "make_engine", "migrate", "upgrade"]


def make_engine(url: str, *, transactional_ddl: bool = False) -> Engine:
    """An engine with the pragmas that make SQLite a fair embedded default (WAL, busy timeout).

    ``transactional_ddl``: SQLite's driver commits before every CREATE or ALTER on its own, so a
    migration that fails halfway leaves half a schema (tables without their ``alembic_version``
    row: every later run then fails on "table already exists"). This engine begins its transactions
    itself (``BEGIN IMMEDIATE``: one migrating process at a time), so DDL rolls back with them. It is
    for migrations only: ordinary work keeps the driver's transactions, which read without a
    snapshot until their first write."""
    engine = create_engine(url, pool_pre_ping=True)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()
            if transactional_ddl:
                dbapi_conn.isolation_level = None  # no implicit BEGIN or COMMIT by the driver

        if transactional_ddl:

            @event.listens_for(engine, "begin")
            def _begin(conn: Connection) -> None:
                conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def upgrade(engine: Engine, typed_tables: Sequence[TypedTable] = ()) -> None:
    """Migrates ``engine``'s database to head, typed tables' type changes included (what ``etl db
    upgrade`` does), in one transaction."""
    SqlStore(engine.url.render_as_string(hide_password=False), engine=engine).upgrade(typed_tables)


def behind(engine: Engine) -> str | None:
    """Why this code cannot read the store's tables, and what to do: they are at an older revision
    (upgrade the store) or at one this code does not know (a newer etl migrated them: upgrade etl).
    None when they are at head or were never migrated (then there is nothing to read yet)."""
    from alembic.runtime.migration import MigrationContext  # noqa: PLC0415
    from alembic.script import ScriptDirectory  # noqa: PLC0415

    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    script = ScriptDirectory(str(MIGRATIONS))
    head = script.get_current_head()
    if current is None or current == head:
        return None
    if current not in {revision.revision for revision in script.walk_revisions()}:
        return (f"the store's tables are at revision {current}, newer than this etl's {head}: "
                f"upgrade etl (pip install -U idem-etl) to read them")
    return f"the store's tables are at revision {current}, this etl reads revision {head}: run `etl db upgrade --db URL` first"


def cache_entries(conn: Connection, keys: Sequence[str]) -> dict[str, CacheEntry]:
    """The committed cache entries of ``keys`` (those there are), by key."""
    found: dict[str, CacheEntry] = {}
    for (member,) in members(conn, list(keys), llm_cache.c.cache_key):
        for row in conn.execute(select(llm_cache).where(member)).mappings():
            found[row["cache_key"]] = CacheEntry(**{k: row[k] for k in CacheEntry.__dataclass_fields__})
    return found


#: Any constant: the PostgreSQL advisory lock that serialises workers migrating at the same time.
_MIGRATION_LOCK = 0x1DE3E7


#: Revisions a worker does not apply to an existing store on its own: they rebuild keys under
#: locks, and workers of an earlier version cannot write after them (their conflict targets are
#: gone). ``etl db upgrade``, with the workers stopped, applies them.
EXPLICIT_REVISIONS = {"0017": "0017 rebuilds every tenant table's keys to lead with the tenant"}


def migrate(conn: Connection, *, explicit: bool = True) -> None:
    """Migrates to head inside the caller's transaction (serialised across workers on PostgreSQL).
    Not ``explicit`` (a worker starting): a pending revision of :data:`EXPLICIT_REVISIONS` on a
    store that has tables is refused (ValueError) rather than applied."""
    from alembic import command  # noqa: PLC0415 - alembic is only needed when migrating
    from alembic.config import Config  # noqa: PLC0415

    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
    from alembic.runtime.migration import MigrationContext  # noqa: PLC0415
    from alembic.script import ScriptDirectory  # noqa: PLC0415

    script = ScriptDirectory(str(MIGRATIONS))
    current = MigrationContext.configure(conn).get_current_revision()
    if current is not None and current not in {revision.revision for revision in script.walk_revisions()}:
        raise ValueError(f"the store's tables are at revision {current}, newer than this etl's "
                         f"{script.get_current_head()}: upgrade etl (pip install -U idem-etl) to use them")
    if not explicit and current is not None:
        pending = {r.revision for r in script.iterate_revisions("head", current)}
        if held := sorted(pending & set(EXPLICIT_REVISIONS)):
            raise ValueError(f"the store's tables are at revision {current} and revision "
                             f"{EXPLICIT_REVISIONS[held[0]]} (under table locks; workers of earlier versions "
                             f"cannot write after it): stop the workers, then run `etl db upgrade --db URL`")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    command.upgrade(config, "head")


#: See ``SqlStore.unsettled``: (tenant, doc key, stage, cache key) rows with no stored result for
#: exactly that key; documents whose stored version is not at the message's position, or with an
#: open dead letter (probed once per document, not per stage). Index probes by (pipeline, doc key).
_UNSETTLED = text("""
WITH expected AS (
    SELECT e->>0 AS tenant, e->>1 AS doc_key, e->>2 AS stage, e->>3 AS cache_key
    FROM json_array_elements(CAST(:expected AS json)) AS e
), at AS (
    SELECT a->>0 AS tenant, a->>1 AS doc_key, a->>2 AS stream, CAST(a->>3 AS integer) AS partition,
           CAST(a->>4 AS bigint) AS message_offset
    FROM json_array_elements(CAST(:at AS json)) AS a
)
SELECT e.tenant, e.doc_key FROM expected AS e
LEFT JOIN stage_results AS r
    ON r.pipeline = :pipeline AND r.tenant = e.tenant AND r.doc_key = e.doc_key AND r.stage = e.stage
WHERE r.cache_key IS DISTINCT FROM e.cache_key
UNION
SELECT a.tenant, a.doc_key FROM at AS a
LEFT JOIN documents AS v ON v.pipeline = :pipeline AND v.tenant = a.tenant AND v.doc_key = a.doc_key
WHERE (v.stream, v.partition, v.message_offset) IS DISTINCT FROM (a.stream, a.partition, a.message_offset)
   OR EXISTS (SELECT 1 FROM dead_letters AS d WHERE d.pipeline = :pipeline AND d.status = 'open'
              AND d.tenant = a.tenant AND d.doc_key = a.doc_key)
""")



#: States of a key's claim (besides a failure's reason), as ``claim_many`` returns them.
MINE, HELD = "mine", "held"


def _log_changes(made: list[Change]) -> None:
    if made:
        log.info("typed_tables_changed", changes=[str(change) for change in made])


class SqlStore(Store, Claims):
    """A :class:`Store` (and the workers' shared :class:`Claims`) on any SQLAlchemy URL that SQLite
    or PostgreSQL understands."""

    def __init__(self, url: str, *, engine: Engine | None = None) -> None:
        """``engine``: one already made for ``url`` (``upgrade`` migrates the caller's engine)."""
        self.engine = engine or make_engine(url)
        self._insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        self._typed_meta = MetaData()
        self._typed: dict[str, Table] = {}
        self._writer = BatchWriter(self._typed, {})
        #: Where migrations run: on a SQLite file, an engine whose transactions hold DDL too (an
        #: in-memory database is one per engine: it keeps its own).
        self._ddl = make_engine(url, transactional_ddl=True) \
            if self.engine.dialect.name == "sqlite" and self.engine.url.database not in (None, "", ":memory:") \
            else self.engine

    def dispose(self) -> None:
        """Closes the pooled connections of both engines (the store stays usable: pools refill)."""
        self.engine.dispose()
        if self._ddl is not self.engine:
            self._ddl.dispose()

    def prepare(self, typed_tables: Sequence[TypedTable]) -> None:
        """Migrates, creates the typed tables and makes the changes of theirs that lose nothing
        (see :mod:`connectors.store.evolve`), in one transaction, so workers starting together take
        turns and a failure leaves the store as it was.

        Raises:
            MigrationNeeded: a typed table needs a type change; ``etl db upgrade`` makes it.
            NotATypedTable: a table of a typed table's name exists that idem-etl did not make.
        """
        with self._ddl.begin() as conn:
            made = self._migrate(conn, typed_tables, types=False)
        _log_changes(made)

    def upgrade(self, typed_tables: Sequence[TypedTable] = ()) -> None:
        """``prepare``, type changes of typed tables included."""
        with self._ddl.begin() as conn:
            made = self._migrate(conn, typed_tables, types=True)
        _log_changes(made)

    def plan(self, typed_tables: Sequence[TypedTable] = ()) -> list[str]:
        """The statements ``upgrade`` would run now: it runs them and rolls back."""
        statements: list[str] = []
        with self._ddl.connect() as conn:

            @event.listens_for(conn, "before_cursor_execute")
            def _seen(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
                if not statement.lstrip().upper().startswith(("SELECT", "PRAGMA", "WITH", "SHOW", "BEGIN", "SET")):
                    statements.append(statement.strip())

            with conn.begin() as transaction:
                self._migrate(conn, typed_tables, types=True)
                transaction.rollback()
        return statements

    def _migrate(self, conn: Connection, typed_tables: Sequence[TypedTable], *, types: bool) -> list[Change]:
        """Migrations, typed tables created, their changes made (type changes only if ``types``);
        returns the changes made."""
        migrate(conn, explicit=types)
        if conn.dialect.name == "postgresql":
            # An ALTER waits for readers of the table (an analyst's long query) and every writer
            # queues behind it: give up after a while instead (retried: lock_not_available waits).
            conn.exec_driver_sql("SET LOCAL lock_timeout = '10s'")
        needed: list[Change] = []
        made: list[Change] = []
        for stage, name, schema in typed_tables:
            table = self._typed.get(name)
            if table is None:
                table = self._typed[name] = typed_table(name, schema, self._typed_meta)
            self._writer.stage_tables.setdefault(stage, set()).add(name)
            found = changes(conn, table, schema)
            if found is None:
                table.create(conn)
                if conn.dialect.name == "postgresql":
                    protect_tenant_table(conn, name)  # analysts see typed rows of their tenant only
                continue
            if not types and any(not change.automatic for change in found):
                needed += [change for change in found if not change.automatic]
                continue
            apply(conn, name, found)
            made += found
        if needed:
            raise MigrationNeeded(needed)
        return made

    def lookup(self, pipeline: str, docs: Iterable[DocRef], cache_keys: Iterable[str],
               positions: Iterable[tuple[str, int, int]] = (), *, outputs: bool = True) -> Lookup:
        refs = set(docs)
        found = Lookup(results={}, dead={}, cache={})
        r, d = stage_results.c, dead_letters.c
        with self.engine.connect() as conn:
            for chunk in chunks(sorted(set(positions))):
                rows = conn.execute(select(d.stream, d.partition, d.message_offset).where(
                    d.pipeline == pipeline, tuple_(d.stream, d.partition, d.message_offset).in_(chunk)))
                found.dead_positions.update((stream, partition, offset) for stream, partition, offset in rows)
            # Stored versions, results and open dead letters in one statement, by members of one
            # indexed column (row-value IN lists of hundreds of pairs plan badly); rows of other
            # tenants with the same key are dropped here.
            v = documents.c
            for of_docs, of_results, of_dead in members(conn, list({key for _, key in refs}), v.doc_key, r.doc_key,
                                                        d.doc_key):
                statement = union_all(  # results first: the first select types the columns (JSON output)
                    select(literal("result"), r.tenant, r.doc_key, r.stage, r.cache_key,
                           r.output if outputs else null(), null(), null()).where(r.pipeline == pipeline, of_results),
                    select(literal("doc"), v.tenant, v.doc_key, v.stream, null(), null(), v.partition,
                           v.message_offset).where(v.pipeline == pipeline, of_docs),
                    select(literal("dead"), d.tenant, d.doc_key, d.reason, d.cache_key, null(), null(), null()).where(
                        d.pipeline == pipeline, d.status == "open", of_dead),
                )
                for kind, tenant, key, stage, cache_key, output, partition, offset in conn.execute(statement).all():
                    if (tenant, key) not in refs:
                        continue
                    if kind == "result":
                        found.results[(tenant, key, stage)] = (cache_key, output)
                    elif kind == "doc":
                        found.versions[(tenant, key)] = (stage, partition, offset)
                    else:
                        found.dead.setdefault((tenant, key), set()).add(cache_key)
                        if cache_key is not None:
                            found.dead_reasons[cache_key] = stage
            # A key whose result is already stored needs no cache look-up (every redelivery).
            stored = {cache_key for cache_key, _ in found.results.values()}
            found.cache.update(cache_entries(conn, sorted(set(cache_keys) - stored)))
        return found

    def unsettled(self, pipeline: str, expected: Sequence[tuple[str, str, str, str]],
                  at: Mapping[DocRef, Version]) -> set[DocRef]:
        if self.engine.dialect.name != "postgresql":
            return super().unsettled(pipeline, expected, at)
        # PostgreSQL compares on its side and sends back only what is not settled: a replay's
        # look-up returns no rows at all. The expectations travel as one JSON parameter.
        with self.engine.connect() as conn:
            rows = conn.execute(_UNSETTLED, {"pipeline": pipeline, "expected": json.dumps(expected),
                                             "at": json.dumps([[*ref, *v] for ref, v in at.items()])})
            return {(tenant, key) for tenant, key in rows}

    def write(self, pipeline: str, batch: Batch) -> None:
        def write(conn: Connection, part: Batch) -> None:
            self._writer.write(conn, pipeline, part)

        try:
            with self.engine.begin() as conn:
                write(conn, batch)
        except Exception as exc:
            if not rejected_by_value(exc):
                raise
            # One outcome holds a value the store refuses: write them apart, so only it is lost
            # (as its dead letter), never the batch.
            refused = write_apart(self.engine.begin, write, batch)
            log.warning("store_rejected", pipeline=pipeline, outcomes=len(batch.outcomes), refused=refused,
                        error=type(exc).__name__)

    def publish_pending(self, pipeline: str, publish: Callable[[list[DeadLetter]], None]) -> int:
        c = dead_letters.c
        with self.engine.begin() as conn:
            # Locked while they are published (skipped by other workers doing the same), marked in
            # the same transaction: a crash before the mark republishes, never loses.
            query = select(c.id, c.stream, c.partition, c.message_offset, c.reason, c.detail, c.payload, c.tenant,
                           c.doc_key, c.stage, c.cache_key, c.raw_output).where(
                c.pipeline == pipeline, ~c.published).order_by(c.id).with_for_update(skip_locked=True)
            found = conn.execute(query).all()
            if not found:
                return 0
            publish([DeadLetter(position=Position(stream=r.stream, partition=r.partition, offset=r.message_offset),
                                reason=r.reason, detail=r.detail, payload=bytes(r.payload), tenant=None if r.tenant == NO_TENANT else r.tenant,
                                doc_key=r.doc_key, stage=r.stage, cache_key=r.cache_key, raw_output=r.raw_output)
                     for r in found])
            for (member,) in members(conn, [r.id for r in found], c.id):
                conn.execute(update(dead_letters).where(member).values(published=True))
            return len(found)

    def claim(self, key: str, owner: str, lease_s: float) -> bool:
        return self.claim_many([key], owner, lease_s)[key] == MINE

    def claim_many(self, keys: Sequence[str], owner: str, lease_s: float, pipeline: str | None = None,
                   waiting: Collection[str] = ()) -> dict[str, str]:
        """Claims what it can of ``keys`` in one transaction, for ``lease_s`` of the database's
        clock; returns each key's state: ``MINE``, ``HELD`` by a live claim of another worker, or,
        for keys in ``waiting`` (the caller saw them held), the reason the holder's call failed
        (however long ago). A failed key is free to anyone else (a later run retries it). A key
        already cached is not claimed (whoever asks should read the cache), so a claim never
        outlives its result."""
        if not keys:
            return {}
        c = llm_claims.c
        keys = sorted(set(keys))  # one lock order for every worker: concurrent claims never deadlock
        with self.engine.begin() as conn:
            # The database's clock read once, as a value. Rows as plain parameter sets: with an
            # expression or a fixed value in VALUES, SQLAlchemy cannot batch the rows into one
            # multi-row INSERT and sends one statement per key.
            now = conn.execute(select(db_now(conn))).scalar_one()
            # One statement over every key, in sorted order, then failed keys no one waited on:
            # every worker locks claims in one order (two groups in two orders deadlocked, and
            # the holder's renewal, stuck behind the lock, lapsed).
            stmt = self._insert(llm_claims)
            stmt = stmt.on_conflict_do_update(
                index_elements=["cache_key"],
                set_={"owner": stmt.excluded.owner, "pipeline": stmt.excluded.pipeline,
                      "expires_at": stmt.excluded.expires_at, "failure": stmt.excluded.failure},
                # Free once expired; a worker's own live claim is its own; never a failed one here.
                where=((c.expires_at < now) | (c.owner == owner)) & c.failure.is_(None),
            ).returning(c.cache_key)
            claimed = set(conn.execute(stmt, [
                {"cache_key": k, "owner": owner, "pipeline": pipeline, "expires_at": now + lease_s, "failure": None}
                for k in keys]).scalars())
            retry = [key for key in keys if key not in claimed and key not in waiting]
            if retry:  # a failure is free to anyone who was not waiting on it (a later run retries)
                claimed |= set(conn.execute(update(llm_claims).where(c.cache_key.in_(retry), c.failure.is_not(None))
                                            .values(owner=owner, pipeline=pipeline, expires_at=now + lease_s,
                                                    failure=None).returning(c.cache_key)).scalars())
            # The key may be cached already (the caller looked before this batch), or a holder may
            # have committed its result (and dropped its claim) just before the insert; this later
            # statement sees that commit, so such a claim is given back.
            late = set(conn.execute(select(llm_cache.c.cache_key).where(llm_cache.c.cache_key.in_(claimed))).scalars()) \
                if claimed else set()
            if late:
                conn.execute(delete(llm_claims).where(c.cache_key.in_(late), c.owner == owner))
            others = [key for key in keys if key in waiting and key not in claimed]
            failed = dict(conn.execute(select(c.cache_key, c.failure).where(
                c.cache_key.in_(others), c.failure.is_not(None))).all()) if others else {}
        mine = claimed - late  # once: a set difference per key made a claim of n keys cost n²
        return {key: MINE if key in mine else failed.get(key, HELD) for key in keys}

    def renew_claims(self, keys: Sequence[str], owner: str, lease_s: float) -> set[str]:
        """Extends ``owner``'s claims on ``keys`` by ``lease_s`` from now (the database's clock);
        returns the keys still held. A claim that lapsed but was not taken is still this owner's
        (a late renewal, e.g. behind a lock); one another worker took is not."""
        if not keys:
            return set()
        c = llm_claims.c
        with self.engine.begin() as conn:
            now = db_now(conn)
            lock_claims(conn, sorted(keys))
            return set(conn.execute(update(llm_claims).where(
                c.cache_key.in_(sorted(keys)), c.owner == owner, c.failure.is_(None),
            ).values(expires_at=now + lease_s).returning(c.cache_key)).scalars())

    def tokens_spent(self, tenant: str, since: datetime) -> int:
        """Tokens a tenant's model attempts used since ``since`` (any pipeline's runs): for budgets.
        Measurements (``etl eval``'s ``#eval``, ``etl stability``'s ``#stability``) are not a
        tenant's traffic and have their own caps (``--max-cost``)."""
        c = llm_calls.c
        with self.engine.connect() as conn:
            return int(conn.execute(
                select(func.coalesce(func.sum(c.tokens_in + c.tokens_out), 0)).where(
                    c.tenant == tenant, c.outcome != "cache_hit", c.created_at >= since,
                    c.pipeline.not_like("%#eval"), c.pipeline.not_like("%#stability"))
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
