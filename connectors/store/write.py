"""One batch into the SQL store: versions first, then what the winning versions keep.

Order inside the transaction, and why:

1. ``documents``: each document's row is upserted only where the stored version is not newer
   (positions compare as (stream, partition, offset)). On PostgreSQL the upsert locks the row, so
   transactions writing the same document take turns and each sees the other's result. The rows
   it returns are the *winners*: outcomes that are now their document's stored version.
2. Winners replace what their document had: results of stages the version does not have are
   deleted with their typed rows, its results and typed rows are upserted.
3. Paid work is kept whoever won: cache entries, every attempt (by its own id, so a retried commit
   adds nothing), and dead letters — a losing version's letter is born ``superseded``.
4. Dead letters settle, by the letters as stored: a winner supersedes its document's letters at
   older positions and resolves the one at its own position when it succeeded (``replayed``); a
   loser supersedes its own.
5. Claims of finished keys go; positions move forward only, last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Float,
    Table,
    any_,
    bindparam,
    cast,
    delete,
    func,
    literal,
    literal_column,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError, SQLAlchemyError, StatementError

from connectors.store.base import Batch, DocRef, DocumentOutcome, Version
from connectors.store.tables import (
    NO_TENANT,
    TYPED_KEY_COLUMNS,
    cache_texts,
    dead_letters,
    documents,
    field_spans,
    llm_cache,
    llm_calls,
    llm_claims,
    review_queue,
    router_checks,
    source_positions,
    stage_chunks,
    stage_results,
)
from schemas import DeadLetter

#: Rows per IN (...) query; keeps statements well under both backends' parameter limits.
CHUNK = 500

#: What a store error means for the run: wait for the database, refuse one outcome, or stop.
TRANSIENT, VALUE, PERMANENT = "transient", "value", "permanent"

#: SQLSTATE classes and codes worth waiting for: connection exceptions, too many connections / out
#: of memory or disk, a shutdown or start-up in progress, serialization failures and deadlocks, a
#: lock not available, a statement cancelled (statement_timeout, pg_cancel_backend), a read-only
#: transaction (a standby during failover), system I/O errors.
_PG_TRANSIENT = ("08", "53", "57P01", "57P02", "57P03", "57014", "40", "55P03", "25006", "58")
#: ... and classes of a value the store refuses: data exceptions, integrity constraint violations.
_PG_VALUE = ("22", "23")
#: A connection refused by the server for good (psycopg gives no SQLSTATE at connect time).
_PG_PERMANENT_AT_CONNECT = ("does not exist", "authentication failed", "no pg_hba.conf entry",
                            "permission denied")
#: SQLite primary result codes: BUSY, LOCKED, IOERR, FULL, PROTOCOL, SCHEMA (changed under the
#: statement) wait; TOOBIG, CONSTRAINT,
#: MISMATCH, RANGE refuse one value; anything else (ERROR: no such table or column, READONLY,
#: CANTOPEN, CORRUPT, NOTADB, PERM, AUTH) will not succeed on retry.
_SQLITE_TRANSIENT = {5, 6, 10, 13, 15, 17}
_SQLITE_VALUE = {18, 19, 20, 25}


def classify(exc: BaseException) -> str:
    """``TRANSIENT`` (the database is restarting, unreachable or busy: retry), ``VALUE`` (it refused
    a value: quarantine the outcome that holds it) or ``PERMANENT`` (a missing table or column, a
    refused login, a read-only file: retrying cannot help; stop with the cause)."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return TRANSIENT
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    if isinstance(exc, StatementError) and not isinstance(exc, DBAPIError):
        orig = exc.orig  # a value the driver could not bind (ValueError, OverflowError...)
    if isinstance(orig, (ValueError, TypeError, OverflowError)):
        return VALUE
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate:
        if sqlstate.startswith(_PG_TRANSIENT):
            return TRANSIENT
        return VALUE if sqlstate.startswith(_PG_VALUE) else PERMANENT
    code = getattr(orig, "sqlite_errorcode", None)
    if code is not None:
        code &= 0xFF  # extended result codes carry the primary one in the low byte
        return TRANSIENT if code in _SQLITE_TRANSIENT else VALUE if code in _SQLITE_VALUE else PERMANENT
    if isinstance(exc, OperationalError):  # psycopg at connect time: refused, or gone for now?
        fatal = str(orig).partition("FATAL:")[2]
        return PERMANENT if any(hint in fatal for hint in _PG_PERMANENT_AT_CONNECT) else TRANSIENT
    if isinstance(exc, (DataError, IntegrityError)):
        return VALUE
    return PERMANENT


def is_transient(exc: BaseException) -> bool:
    """A database that is restarting, unreachable or busy: worth waiting for, not worth crashing over."""
    return isinstance(exc, SQLAlchemyError) and classify(exc) == TRANSIENT


def rejected_by_value(exc: BaseException) -> bool:
    """The store refused a value in the batch (not: the store is away, or broken for every batch)."""
    return isinstance(exc, (SQLAlchemyError, ValueError, TypeError, OverflowError)) and classify(exc) == VALUE


def db_now(conn: Connection) -> ColumnElement[float]:
    """The database's clock in epoch seconds: every worker's leases are timed by one clock, whatever
    each worker's own says (SQLite serves one machine, whose clock it reads)."""
    if conn.dialect.name == "postgresql":
        return cast(func.extract("epoch", func.clock_timestamp()), Float)
    return literal_column("((julianday('now') - 2440587.5) * 86400.0)", Float)


def lock_claims(conn: Connection, keys: list[str]) -> None:
    """Locks the claim rows of ``keys`` in key order, before a transaction changes them: every
    statement that locks claims (claiming, renewing, releasing) takes them in that one order, so two
    workers never deadlock on them (a deadlock's second lost, then a renewal behind it lapsed)."""
    c = llm_claims.c
    for (member,) in members(conn, keys, c.cache_key):
        conn.execute(select(c.cache_key).where(member).order_by(c.cache_key).with_for_update())


def chunks(items: list[Any], size: int = CHUNK) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def members(conn: Connection, values: list[Any], *columns: ColumnElement[Any]) -> Iterator[list[ColumnElement[bool]]]:
    """``column IN values`` for each of ``columns``, in as few statements as it takes: one
    ``= ANY(array)`` on PostgreSQL (one parameter however many values and columns, so the statement
    is planned once and the values sent once), IN lists on SQLite (no arrays, limited parameters)."""
    if not values:
        return
    if conn.dialect.name == "postgresql":
        values_param = bindparam("members", values, type_=postgresql.ARRAY(columns[0].type))
        yield [column == any_(values_param) for column in columns]
        return
    for chunk in chunks(values, CHUNK // len(columns)):
        yield [column.in_(chunk) for column in columns]


def insert(conn: Connection, table: Table) -> Any:
    return (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(table)


def upsert(conn: Connection, table: Table, rows: list[dict[str, Any]], keys: Sequence[str],
           changed_when: str | None, *, in_key_order: bool = True) -> None:
    """Inserts rows; on a key conflict updates the row only where ``changed_when`` differs (so a
    redelivery rewrites nothing), or does nothing when ``changed_when`` is None."""
    if not rows:
        return
    # Rows in key order: two workers writing the same keys lock them in one order (no deadlock).
    if in_key_order:
        rows = sorted(rows, key=lambda row: tuple(str(row[k]) for k in keys))
    stmt = insert(conn, table)
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


def version(outcome: DocumentOutcome) -> Version:
    assert outcome.document is not None  # noqa: S101 - only outcomes with a document have a version
    p = outcome.document.position
    return (p.stream, p.partition, p.offset)


def _letter_row(pipeline: str, letter: DeadLetter, status: str, published: bool) -> dict[str, Any]:
    p = letter.position
    return {"pipeline": pipeline, "stream": p.stream, "partition": p.partition, "message_offset": p.offset,
            **letter.model_dump(exclude={"position"}), "tenant": letter.tenant or NO_TENANT, "status": status,
            "published": published}


class BatchWriter:
    """Writes batches for one pipeline; knows where each Extract stage's typed rows live."""

    def __init__(self, typed: Mapping[str, Table], stage_tables: dict[str, set[str]]) -> None:
        self.typed = typed
        self.stage_tables = stage_tables

    def write(self, conn: Connection, pipeline: str, batch: Batch) -> None:
        latest: dict[DocRef, DocumentOutcome] = {}
        for outcome in batch.outcomes:
            if (doc := outcome.document) is not None:
                held = latest.get((doc.tenant, doc.key))
                if held is None or version(held) <= version(outcome):
                    latest[(doc.tenant, doc.key)] = outcome
        won, inserted = self._claim_versions(conn, pipeline, latest)
        winners = [latest[ref] for ref in won]
        self._replace_results(conn, pipeline, winners, inserted)
        cache = {entry.cache_key: vars(entry) for o in batch.outcomes for entry in o.cache}
        upsert(conn, llm_cache, list(cache.values()), ("tenant", "cache_key"), None)
        texts = {key: {"cache_key": key, "tenant": o.document.tenant, "content": content}
                 for o in batch.outcomes if o.document is not None for key, content in o.texts}
        upsert(conn, cache_texts, list(texts.values()), ("tenant", "cache_key"), None)
        checks = {(sid, key): {"student_id": sid, "pipeline": pipeline, "tenant": o.document.tenant, "stage": stage,
                               "doc_key": o.document.key, "cache_key": key, "student_label": mine,
                               "llm_label": theirs, "agree": mine == theirs}
                  for o in batch.outcomes if o.document is not None for sid, stage, key, mine, theirs in o.checks}
        upsert(conn, router_checks, list(checks.values()), ("tenant", "student_id", "cache_key"), None)
        # Waiters on one failed call share its attempts: each attempt is written once, by its id.
        calls = {c.call_id: {"pipeline": pipeline, **c.model_dump()} for o in batch.outcomes for c in o.calls}
        # Attempts keep their order (ids follow time); their ids are their own, never contended.
        upsert(conn, llm_calls, list(calls.values()), ("tenant", "call_id"), None, in_key_order=False)
        letters = self._dead_letters(conn, pipeline, batch, latest, won)
        reviews = [
            {"pipeline": pipeline, "tenant": o.document.tenant, "stage": stage, "doc_key": o.document.key,
             "content": content, "output": output, "sampled_because": why}
            for o in winners if o.document is not None for stage, output, why, content in o.reviews
        ]
        upsert(conn, review_queue, reviews, ("tenant", "pipeline", "doc_key", "stage"), None)
        # Results are durable now: nobody needs to wait on these keys any more. A failure is not
        # cached (a later run may retry it), but workers waiting on its key take it until the
        # holder's lease ends rather than pay for it again.
        failed = [{"k": key, "r": reason} for key, reason in sorted(letters.items()) if key not in cache]
        answered = set(cache) | {key for o in batch.outcomes for key in o.claimed}
        lock_claims(conn, sorted(answered | {row["k"] for row in failed}))
        for (member,) in members(conn, sorted(answered), llm_claims.c.cache_key):
            conn.execute(delete(llm_claims).where(member))
        if failed:
            conn.execute(update(llm_claims).where(llm_claims.c.cache_key == bindparam("k"))
                         .values(failure=bindparam("r")), failed)
            # Failures a minute past their lease have told every waiter: they go (claims stay few).
            conn.execute(delete(llm_claims).where(llm_claims.c.failure.is_not(None),
                                                  llm_claims.c.expires_at < db_now(conn) - 60))
        self._positions(conn, pipeline, batch.positions)

    @staticmethod
    def _claim_versions(conn: Connection, pipeline: str, latest: dict[DocRef, DocumentOutcome]
                        ) -> tuple[set[DocRef], set[DocRef]]:
        """Upserts each document's row where the stored version is not newer; returns the refs now
        holding this batch's version, and those of them that are new documents (PostgreSQL says
        so: a row inserted rather than updated has ``xmax = 0``; SQLite cannot tell)."""
        if not latest:
            return set(), set()
        rows = []
        for (tenant, key), outcome in sorted(latest.items()):
            doc = outcome.document
            assert doc is not None  # noqa: S101
            rows.append({"pipeline": pipeline, "tenant": tenant, "doc_key": key, "content_hash": doc.content_hash,
                         "stream": doc.position.stream, "partition": doc.position.partition,
                         "message_offset": doc.position.offset, "received_at": doc.received_at})
        stmt = insert(conn, documents)
        d = documents.c
        stmt = stmt.on_conflict_do_update(
            index_elements=["tenant", "pipeline", "doc_key"],
            set_={c: stmt.excluded[c] for c in ("content_hash", "stream", "partition", "message_offset",
                                                  "received_at")},
            where=tuple_(d.stream, d.partition, d.message_offset)
            <= tuple_(stmt.excluded.stream, stmt.excluded.partition, stmt.excluded.message_offset),
        ).returning(d.tenant, d.doc_key, literal_column("xmax = 0") if conn.dialect.name == "postgresql"
                    else literal(False))
        won, inserted = set(), set()
        for tenant, key, new in conn.execute(stmt, rows):
            won.add((tenant, key))
            if new:
                inserted.add((tenant, key))
        return won, inserted

    def _replace_results(self, conn: Connection, pipeline: str, winners: list[DocumentOutcome],
                         inserted: set[DocRef]) -> None:
        """The winners' documents get exactly their version's stages: others' results and typed
        rows are deleted (a document new to the store has none), theirs upserted."""
        if not winners:
            return
        keep = {(o.document.tenant, o.document.key): set(o.stages) for o in winners
                if o.document is not None and (o.document.tenant, o.document.key) not in inserted}
        r = stage_results.c
        stale_ids: list[tuple[str, int]] = []
        stale_typed: dict[str, list[dict[str, Any]]] = {}
        for (member,) in members(conn, sorted({key for _, key in keep}), r.doc_key):
            for row_id, tenant, key, stage in conn.execute(
                    select(r.id, r.tenant, r.doc_key, r.stage).where(r.pipeline == pipeline, member)):
                kept = keep.get((tenant, key))
                if kept is not None and stage not in kept:
                    stale_ids.append((tenant, row_id))
                    for table in self.stage_tables.get(stage, ()):  # a tenant's rows are in one of them
                        stale_typed.setdefault(table, []).append({"p": pipeline, "t": tenant, "k": key})
        if stale_ids:  # by the key, (tenant, id): no index holds id alone
            conn.execute(delete(stage_results).where(r.tenant == bindparam("t"), r.id == bindparam("i")),
                         [{"t": tenant, "i": row_id} for tenant, row_id in sorted(stale_ids)])
        for name, refs in stale_typed.items():
            table = self.typed[name]
            conn.execute(delete(table).where(table.c.pipeline == bindparam("p"), table.c.tenant == bindparam("t"),
                                             table.c.doc_key == bindparam("k")), refs)
        results = [
            {"pipeline": pipeline, "tenant": o.document.tenant, "doc_key": o.document.key, "stage": result.stage,
             "output": result.output, **result.provenance.model_dump()}
            for o in winners if o.document is not None for result in o.results
        ]
        upsert(conn, stage_results, results, ("tenant", "pipeline", "doc_key", "stage"), "cache_key")
        typed: dict[str, list[dict[str, Any]]] = {}
        for o in winners:
            assert o.document is not None  # noqa: S101
            for name, fields in o.typed_rows:
                typed.setdefault(name, []).append(
                    {"pipeline": pipeline, "tenant": o.document.tenant, "doc_key": o.document.key, **fields})
        for name, rows in typed.items():
            upsert(conn, self.typed[name], rows, TYPED_KEY_COLUMNS, "cache_key")
        self._replace_details(conn, pipeline, winners, keep)

    @staticmethod
    def _replace_details(conn: Connection, pipeline: str, winners: list[DocumentOutcome],
                         keep: dict[DocRef, set[str]]) -> None:
        """Chunks and spans go with their result: a winner's rows of every stage it rewrote or no
        longer has are deleted, its new ones written."""
        redone: set[tuple[str, str, str]] = set()
        rows: dict[Any, list[dict[str, Any]]] = {stage_chunks: [], field_spans: []}
        for o in winners:
            assert o.document is not None  # noqa: S101
            ref = (o.document.tenant, o.document.key)
            redone.update((*ref, result.stage) for result in o.results)
            for table, details in ((stage_chunks, o.chunks), (field_spans, o.spans)):
                rows[table] += [{"pipeline": pipeline, "tenant": ref[0], "doc_key": ref[1], **row} for row in details]
        kept = {(tenant, key, stage) for (tenant, key), stages in keep.items() for stage in stages}
        for table in rows:
            c = table.c
            for (member,) in members(conn, sorted({key for _, key in keep}), c.doc_key):
                # The tenants too: the key leads with them (a probe of the index, not a scan).
                for tenant, key, stage in conn.execute(select(c.tenant, c.doc_key, c.stage).distinct().where(
                        c.tenant.in_(sorted({tenant for tenant, _ in keep})), c.pipeline == pipeline,
                        member)).all():
                    if (tenant, key) in keep and ((tenant, key, stage) in redone or (tenant, key, stage) not in kept):
                        conn.execute(delete(table).where(c.pipeline == pipeline, c.tenant == tenant, c.doc_key == key,
                                                         c.stage == stage))
            keys = [k.name for k in table.primary_key.columns]
            upsert(conn, table, rows[table], keys, None)

    @staticmethod
    def _dead_letters(conn: Connection, pipeline: str, batch: Batch, latest: dict[DocRef, DocumentOutcome],
                      won: set[DocRef]) -> dict[str, str]:
        """Settles the open letters of the batch's documents, then writes the batch's own letters;
        returns the reason of each letter that has a cache key (a failed stage), by key. A winner
        supersedes its document's letters at older positions and resolves the one at its own
        position when it succeeded (``replayed``); a losing version's letter is superseded (and
        born so when new). Decided from the letters as stored,
        not from what the look-up saw: a letter committed since (another worker's, or this run's
        earlier commit) is settled too."""
        c = dead_letters.c
        winners = {ref: latest[ref] for ref in won}
        at_winner = {version(o): o for o in winners.values()}
        losers = {version(o) for o in batch.outcomes if o.document is not None
                  and winners.get((o.document.tenant, o.document.key)) is not o} - set(at_winner)
        found: list[Any] = []
        columns = (c.id, c.tenant, c.doc_key, c.stream, c.partition, c.message_offset)
        open_ = (c.pipeline == pipeline) & (c.status == "open")
        keys = sorted({key for _, key in latest})
        # Letters of the batch's documents, and letters of messages that had no document (bad
        # input) at their positions (the same message decoding now: a raised max_bytes), in one
        # statement on PostgreSQL.
        positions = {version(o) for o in batch.outcomes if o.document is not None}
        offsets = sorted({offset for _, _, offset in positions})
        if conn.dialect.name == "postgresql" and keys:
            found += conn.execute(select(*columns).where(open_, (c.doc_key == any_(bindparam(
                "keys", keys, type_=postgresql.ARRAY(c.doc_key.type)))) | (c.doc_key.is_(None) & (
                    c.message_offset == any_(bindparam("offsets", offsets, type_=postgresql.ARRAY(
                        c.message_offset.type)))))))
        else:
            for chunk in chunks(keys):
                found += conn.execute(select(*columns).where(open_, c.doc_key.in_(chunk)))
            for chunk in chunks(offsets):
                found += conn.execute(select(*columns).where(open_, c.doc_key.is_(None), c.message_offset.in_(chunk)))
        settle: dict[str, list[int]] = {"superseded": [], "replayed": []}
        for letter_id, tenant, key, stream, partition, offset in found:
            at = (stream, partition, offset)
            if key is None and at not in positions:
                continue  # bad input at another position with the same offset
            winner = winners.get((tenant, key)) if key is not None else at_winner.get(at)
            if winner is not None and at == version(winner):
                if winner.dead_letter is None and not winner.letter_stands:
                    settle["replayed"].append(letter_id)
            elif at in losers or (winner is not None and at < version(winner)):
                settle["superseded"].append(letter_id)
        for status, ids in settle.items():
            for (member,) in members(conn, ids, c.id):
                conn.execute(update(dead_letters).where(member).values(status=status))
        rows: dict[tuple[str, int, int], dict[str, Any]] = {}
        for outcome in batch.outcomes:
            if (letter := outcome.dead_letter) is None:
                continue
            current = outcome.document is None or (outcome.document.tenant, outcome.document.key) in winners \
                and winners[(outcome.document.tenant, outcome.document.key)] is outcome
            p = letter.position
            rows[(p.stream, p.partition, p.offset)] = _letter_row(
                pipeline, letter, "open" if current else "superseded", published=not batch.outbox)
        if rows:
            _move_letters(conn, pipeline, rows)
            # A message that fails again (a replay) keeps one dead letter, with the latest reason; a
            # letter already published is not published again.
            stmt = insert(conn, dead_letters)
            stmt = stmt.on_conflict_do_update(
                index_elements=["tenant", "pipeline", "stream", "partition", "message_offset"],
                set_={c: stmt.excluded[c] for c in ("doc_key", "stage", "cache_key", "reason", "detail",
                                                    "raw_output", "status")},
            )
            # Moved letters keep their id (a replay reading letters by id must not meet one again):
            # a statement of their own, since the others' ids are the database's to give.
            for kept_id in (False, True):
                group = [rows[p] for p in sorted(rows) if ("id" in rows[p]) is kept_id]
                if group:
                    conn.execute(stmt, group)
        return {row["cache_key"]: row["reason"][:40] for row in rows.values() if row["cache_key"]}

    @staticmethod
    def _positions(conn: Connection, pipeline: str, positions: Mapping[tuple[str, int], int]) -> None:
        if not positions:
            return
        rows = [{"pipeline": pipeline, "stream": stream, "partition": partition, "next_offset": offset}
                for (stream, partition), offset in sorted(positions.items())]
        # Positions only move forward: a deliberate replay from 0 must not rewind them.
        stmt = insert(conn, source_positions)
        stmt = stmt.on_conflict_do_update(
            index_elements=["pipeline", "stream", "partition"],
            set_={"next_offset": stmt.excluded.next_offset, "updated_at": func.now()},
            where=source_positions.c.next_offset < stmt.excluded.next_offset,
        )
        conn.execute(stmt, rows)


def _move_letters(conn: Connection, pipeline: str, rows: Mapping[tuple[str, int, int], dict[str, Any]]) -> None:
    """One letter per position, whatever tenant the message reads as now: a letter stored under
    another tenant (bad input that decodes since, a changed default tenant) is deleted and its row
    written under the new tenant with the old one's id, time and published mark. The tenant leads
    the letter's key, and a key column is not updated in place (a distributed table cannot move a
    row between shards). On PostgreSQL the pipeline's letter writes take turns (a transaction lock)
    so two workers reading one message as two tenants cannot both miss the other's letter: the
    key no longer makes a second letter at a position conflict."""
    c = dead_letters.c
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(f"dead_letters:{pipeline}", 0))))
    moved: list[int] = []
    for (member,) in members(conn, sorted({offset for _, _, offset in rows}), c.message_offset):
        for letter_id, tenant, stream, partition, offset, created_at, published in conn.execute(
                select(c.id, c.tenant, c.stream, c.partition, c.message_offset, c.created_at, c.published).where(
                    c.pipeline == pipeline, c.stream.in_(sorted({s for s, _, _ in rows})),
                    c.partition.in_(sorted({p for _, p, _ in rows})), member).with_for_update()).all():
            row = rows.get((stream, partition, offset))
            if row is not None and row["tenant"] != tenant:
                moved.append(letter_id)
                row.update(id=letter_id, created_at=created_at, published=published)
    for (member,) in members(conn, moved, c.id):
        conn.execute(delete(dead_letters).where(member))


def rejected(outcome: DocumentOutcome, error: BaseException, *, keep_paid_work: bool) -> DocumentOutcome:
    """What is written instead of an outcome the store refused: its dead letter (reason
    ``store_rejected``, the original bytes), and, when they can be stored, its attempts and
    cache entries. The document's older results are superseded like any newer version's."""
    detail = f"the store refused this document: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
    detail = detail.replace("\x00", "")
    doc = outcome.document
    first = outcome.results[0] if outcome.results else None
    if doc is None:
        held = outcome.dead_letter
        assert held is not None  # noqa: S101 - a document-less outcome is a dead letter
        letter = held.model_copy(update={"reason": "store_rejected", "detail": detail, "raw_output": None})
    else:
        letter = DeadLetter(
            position=doc.position, reason="store_rejected", detail=detail, payload=outcome.payload,
            tenant=doc.tenant, doc_key=doc.key,
            stage=first.stage if first else (outcome.dead_letter.stage if outcome.dead_letter else None),
            cache_key=first.provenance.cache_key if first else (
                outcome.dead_letter.cache_key if outcome.dead_letter else None))
    return DocumentOutcome(
        document=doc if keep_paid_work else None, dead_letter=letter, settles_dead_letters=True,
        calls=outcome.calls if keep_paid_work else (), cache=outcome.cache if keep_paid_work else (),
        texts=outcome.texts if keep_paid_work else (),
        payload=outcome.payload)


def write_apart(begin: Callable[[], Any], write: Callable[[Connection, Batch], None], batch: Batch) -> int:
    """Writes a refused batch's outcomes one transaction each, a refused one as its dead letter
    (with its paid work if that can be stored, else alone), then the positions; returns how many
    were refused. Raises if even a bare dead letter cannot be written: the store, not the data,
    is at fault then."""
    refused = 0
    for outcome in batch.outcomes:
        error: BaseException | None = None
        for attempt in (outcome, "with paid work", "alone"):
            if error is not None:
                attempt = rejected(outcome, error, keep_paid_work=attempt == "with paid work")
            assert isinstance(attempt, DocumentOutcome)  # noqa: S101
            try:
                with begin() as conn:
                    write(conn, Batch(outcomes=[attempt], outbox=batch.outbox))
                break
            except Exception as exc:
                if not rejected_by_value(exc) or attempt.document is None and error is not None:
                    raise  # the store is away, or refuses even a bare dead letter
                refused += error is None
                error = error or exc
    with begin() as conn:
        write(conn, Batch(positions=batch.positions))
    return refused
