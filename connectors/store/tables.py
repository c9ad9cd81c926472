"""The store's tables (SQLAlchemy Core). Alembic migrations create them; see ``migrations/``.

Typed extraction tables are not here: they are made from each ``Extract`` schema at run time by
:func:`typed_table`, since their columns are the user's pydantic fields.

Every primary and unique key of a table with a tenant column leads with the tenant (migration
0017), so distributing the tables by tenant (Citus) needs no key change: docs/SCALING.md. These are
the keys PostgreSQL holds. A SQLite store is one file, never distributed: there ``id`` alone stays
the primary key (SQLite numbers only an ``INTEGER PRIMARY KEY``), and keys that did not hold the
tenant gained a unique index that does, which is what the writes' conflict targets name.
"""

from __future__ import annotations

import datetime as dt
import decimal
import types
import typing
from typing import Any

from pydantic import BaseModel
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Date,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

#: JSON on SQLite, JSONB on PostgreSQL (indexable, and what analysts expect).
Json = JSON().with_variant(JSONB(), "postgresql")
#: JSON where Python's None is SQL NULL (``WHERE confidence IS NULL`` finds it), not JSON ``null``.
NullableJson = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
Id = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only


def _now() -> Column[Any]:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


documents = Table(
    "documents",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("content_hash", String(64), nullable=False),
    Column("stream", String(500), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("message_offset", BigInteger, nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False),
    UniqueConstraint("tenant", "pipeline", "doc_key", name="uq_documents_doc"),
    Index("ix_documents_doc_key", "pipeline", "doc_key"),  # the look-up of stored versions
    PrimaryKeyConstraint("tenant", "id", name="pk_documents"),
)

stage_results = Table(
    "stage_results",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("output", Json, nullable=False),
    Column("cache_key", String(64), nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("model", String(300), nullable=False),
    Column("prompt_hash", String(64), nullable=False),
    Column("schema_hash", String(64), nullable=False),
    Column("cache_hit", Boolean, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("tokens_in", Integer, nullable=False),
    Column("tokens_out", Integer, nullable=False),
    Column("cost", Float, nullable=False),
    Column("latency_ms", Float, nullable=False),
    Column("structured", String(20)),
    Column("system_fingerprint", String(200)),
    _now(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: NULL: the model's answer (or its cache's); "student:<id>": a router's student answered.
    Column("answered_by", String(64)),
    UniqueConstraint("tenant", "pipeline", "doc_key", "stage", name="uq_stage_results_doc_stage"),
    Index("ix_stage_results_doc_key", "pipeline", "doc_key"),  # the redelivery look-up
    PrimaryKeyConstraint("tenant", "id", name="pk_stage_results"),
)

llm_cache = Table(
    "llm_cache",
    metadata,
    Column("cache_key", String(64), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("output", Json, nullable=False),
    Column("model", String(300), nullable=False),
    Column("tokens_in", Integer, nullable=False),
    Column("tokens_out", Integer, nullable=False),
    Column("cost", Float, nullable=False),
    Column("structured", String(20)),
    Column("system_fingerprint", String(200)),
    Column("confidence", NullableJson),
    _now(),
    PrimaryKeyConstraint("tenant", "cache_key", name="pk_llm_cache"),
    Index("ix_llm_cache_key", "cache_key"),  # a claim's "cached meanwhile?" and the router come by key alone
)

llm_calls = Table(
    "llm_calls",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("cache_key", String(64), nullable=False),
    Column("model", String(300), nullable=False),
    Column("outcome", String(20), nullable=False),
    Column("tokens_in", Integer, nullable=False),
    Column("tokens_out", Integer, nullable=False),
    Column("cost", Float, nullable=False),
    Column("latency_ms", Float, nullable=False),
    Column("error", Text),
    _now(),
    #: The attempt's own id: a commit retried after a lost acknowledgement adds no second row.
    Column("call_id", String(32)),
    Index("ix_llm_calls_tenant_stage", "tenant", "stage", "created_at"),
    Index("uq_llm_calls_call_id", "tenant", "call_id", unique=True),
    PrimaryKeyConstraint("tenant", "id", name="pk_llm_calls"),
)

source_positions = Table(
    "source_positions",
    metadata,
    Column("pipeline", String(200), nullable=False),
    Column("stream", String(500), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("next_offset", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("pipeline", "stream", "partition", name="pk_source_positions"),
)

#: The tenant of a dead letter whose message named none (bad input): a key column is never NULL,
#: and no login can be granted it (``etl analyst grant`` refuses a blank tenant).
NO_TENANT = ""

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("stream", String(500), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("message_offset", BigInteger, nullable=False),
    Column("tenant", String(200), nullable=False),  # NO_TENANT where the message named none
    Column("doc_key", String(500)),
    Column("stage", String(200)),
    Column("cache_key", String(64)),
    Column("reason", String(50), nullable=False),
    Column("detail", Text, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Column("raw_output", Text),
    #: open: the document's current version failed here. replayed: that version later succeeded.
    #: superseded: a newer version of the document was stored.
    Column("status", String(20), nullable=False, server_default="open"),
    _now(),
    #: Whether the letter reached the source's dead-letter channel (see ``SqlStore.publish_pending``).
    Column("published", Boolean, nullable=False, server_default=true()),
    UniqueConstraint("tenant", "pipeline", "stream", "partition", "message_offset", name="uq_dead_letters_position"),
    Index("ix_dead_letters_position", "pipeline", "stream", "partition", "message_offset"),
    Index("ix_dead_letters_id", "id"),
    Index("ix_dead_letters_doc", "pipeline", "doc_key"),
    Index("ix_dead_letters_unpublished", "pipeline", postgresql_where=text("NOT published"),
          sqlite_where=text("NOT published")),
    PrimaryKeyConstraint("tenant", "id", name="pk_dead_letters"),
)

llm_claims = Table(
    "llm_claims",
    metadata,
    Column("cache_key", String(64), primary_key=True),
    Column("owner", String(100), nullable=False),
    Column("expires_at", Float, nullable=False),  # epoch seconds of the database's clock (see db_now)
    Column("pipeline", String(200)),
    #: The reason the holder's call ended as a dead letter; waiters take it until the lease ends.
    Column("failure", String(40)),
)

# -- quality -------------------------------------------------------------------------------------

golden_examples = Table(
    "golden_examples",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("content", Text, nullable=False),
    Column("expected", Json, nullable=False),
    Column("origin", String(20), nullable=False, server_default="import"),  # import | review
    Column("reviewer", String(200)),  # who confirmed or corrected it (review), null when imported
    Column("reviewed_at", DateTime(timezone=True)),
    _now(),
    UniqueConstraint("tenant", "pipeline", "stage", "doc_key", name="uq_golden_examples"),
    PrimaryKeyConstraint("tenant", "id", name="pk_golden_examples"),
)

eval_runs = Table(
    "eval_runs",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("model", String(300), nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("examples", Integer, nullable=False),
    Column("failed", Integer, nullable=False),
    Column("accuracy", Float, nullable=False),
    Column("macro_f1", Float),
    Column("details", Json, nullable=False),  # confusion pairs, or per-field match rates
    _now(),
    PrimaryKeyConstraint("tenant", "id", name="pk_eval_runs"),
)

eval_results = Table(
    "eval_results",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("run_id", BigInteger, nullable=False, index=True),
    Column("tenant", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("expected", Json, nullable=False),
    Column("predicted", Json),
    Column("correct", Boolean, nullable=False),
    Column("error", Text),
    PrimaryKeyConstraint("tenant", "id", name="pk_eval_results"),
)

#: ``etl stability``: one measurement of a stage's model asked K times about the same documents.
stability_runs = Table(
    "stability_runs",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("model", String(300), nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("documents", Integer, nullable=False),
    Column("samples", Integer, nullable=False),
    Column("unanimous", Float, nullable=False),  # share of documents given one distinct answer
    Column("distinct_answers", Float, nullable=False),  # mean distinct answers per document
    Column("label_flip_rate", Float),  # Classify: chance that two answers to a document differ in label
    Column("reproduced", Float),  # share of stored answers the model gives again (its most common answer)
    Column("calls", Integer, nullable=False),
    Column("cost", Float, nullable=False),
    Column("details", Json, nullable=False),  # per-field agreement, confidence intervals, failures
    _now(),
    Index("ix_stability_runs_stage", "pipeline", "tenant", "stage", "model", "created_at"),
    PrimaryKeyConstraint("tenant", "id", name="pk_stability_runs"),
)

drift_alerts = Table(
    "drift_alerts",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("metric", String(50), nullable=False),
    Column("baseline", Float, nullable=False),
    Column("recent", Float, nullable=False),
    Column("score", Float, nullable=False),
    Column("threshold", Float, nullable=False),
    Column("window", Integer, nullable=False),
    _now(),
    PrimaryKeyConstraint("tenant", "id", name="pk_drift_alerts"),
)

review_queue = Table(
    "review_queue",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("content", Text, nullable=False),
    Column("output", Json, nullable=False),
    Column("sampled_because", String(20), nullable=False),  # uniform | low_confidence | first_label
    Column("status", String(20), nullable=False, server_default="pending"),  # pending | exported | reviewed
    Column("verdict", String(20)),  # correct | incorrect
    Column("corrected", Json),
    Column("reviewer", String(200)),
    _now(),
    Column("reviewed_at", DateTime(timezone=True)),
    UniqueConstraint("tenant", "pipeline", "doc_key", "stage", name="uq_review_queue"),
    Index("ix_review_queue_id", "id"),
    PrimaryKeyConstraint("tenant", "id", name="pk_review_queue"),
)

# -- provider batches --------------------------------------------------------------------------

#: A provider batch, recorded before the provider is asked to create it (``id`` is ours and goes
#: into the batch's metadata, so a restart finds the batch instead of creating it again).
llm_batches = Table(
    "llm_batches",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("pipeline", String(200), nullable=False),
    Column("provider", String(500), nullable=False),
    Column("provider_id", String(200)),
    #: recorded | submitted | completed | expired | cancelled | failed | abandoned (never created)
    Column("status", String(20), nullable=False, server_default="recorded"),
    Column("lines", Integer, nullable=False),
    Column("output_file_id", String(200)),
    Column("error_file_id", String(200)),
    _now(),
    Column("closed_at", DateTime(timezone=True)),
    Index("ix_llm_batches_live", "pipeline", "status"),
)

#: The requests of each batch, by ``custom_id`` (a stage's cache key, or a repair's own id).
llm_batch_items = Table(
    "llm_batch_items",
    metadata,
    Column("batch_id", String(32), nullable=False),
    Column("custom_id", String(64), nullable=False),
    PrimaryKeyConstraint("batch_id", "custom_id", name="pk_llm_batch_items"),
    Index("ix_llm_batch_items_custom_id", "custom_id"),
)

# -- the router (etl.quality.router) ----------------------------------------------------------

#: The text behind each cached answer of a routed Classify stage: with ``llm_cache`` (by key) the
#: stage's training set. Written only for stages with a router (the text is the user's data).
cache_texts = Table(
    "cache_texts",
    metadata,
    Column("cache_key", String(64), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("content", Text, nullable=False),
    _now(),
    PrimaryKeyConstraint("tenant", "cache_key", name="pk_cache_texts"),
)

#: Students distilled from a stage's answers: one tenant's, one fingerprint's, as plain data.
students = Table(
    "students",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("pipeline", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("fingerprint", String(64), nullable=False),
    Column("version", Integer, nullable=False),  # 1, 2, ... per pipeline × stage × tenant
    #: active | refused (the gate said no) | off (shadow checks switched it off) | retired (replaced)
    Column("status", String(20), nullable=False),
    Column("reason", Text, nullable=False),
    Column("trained_on", Integer, nullable=False),  # LLM answers it learned from
    Column("holdout", String(20), nullable=False),  # golden | llm: what certified the threshold
    Column("threshold", Float),
    Column("target", Float, nullable=False),
    Column("level", Float, nullable=False),
    Column("certified_on", Integer, nullable=False),  # documents in the holdout
    Column("covered", Integer, nullable=False),
    Column("correct", Integer, nullable=False),
    Column("lower_bound", Float, nullable=False),
    #: Agreement with the LLM above the threshold on held-out LLM answers: what shadow checks hold it to.
    Column("agreement", Float, nullable=False),
    Column("agreement_lb", Float, nullable=False),
    Column("agreement_n", Integer, nullable=False),
    Column("mean_cost", Float, nullable=False),  # the LLM's mean cost per answer: what an answer saves
    Column("spec", Json, nullable=False),  # classes, features, vocabularies, array layout
    Column("weights", LargeBinary, nullable=False),  # little-endian floats, as ``spec`` lays them out
    _now(),
    Column("closed_at", DateTime(timezone=True)),
    Index("ix_students_live", "pipeline", "status"),
    #: Two distills at once: the second commit fails rather than making two active students.
    Index("uq_students_version", "tenant", "pipeline", "stage", "version", unique=True),
    PrimaryKeyConstraint("tenant", "id", name="pk_students"),
)

#: The chunks a long document's stage was answered in (its merged answer is the stage result):
#: where each sits in the text and whether the cache answered it. Replaced with the result.
stage_chunks = Table(
    "stage_chunks",
    metadata,
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("ordinal", Integer, nullable=False),
    Column("cache_key", String(64), nullable=False),
    Column("char_start", BigInteger, nullable=False),
    Column("char_end", BigInteger, nullable=False),
    Column("page_start", Integer, nullable=False),
    Column("page_end", Integer, nullable=False),
    Column("cache_hit", Boolean, nullable=False),
    PrimaryKeyConstraint("tenant", "pipeline", "doc_key", "stage", "ordinal", name="pk_stage_chunks"),
)

#: Where each extracted value sits in its document (``etl.grounding``): one row per value of an
#: Extract result, ``match = 'none'`` for a value the text does not hold. Replaced with the result.
field_spans = Table(
    "field_spans",
    metadata,
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("path", String(500), nullable=False),
    Column("value", Text, nullable=False),
    Column("char_start", BigInteger),
    Column("char_end", BigInteger),
    Column("page", Integer),
    Column("match", String(20), nullable=False),
    Column("score", Float, nullable=False),
    Column("confidence", Float),  # etl.confidence: the model's probability of this value, where known
    Column("confidence_from", String(20)),  # logprob | agreement
    PrimaryKeyConstraint("tenant", "pipeline", "doc_key", "stage", "path", name="pk_field_spans"),
)

#: Shadow checks: a student-answered document also asked of the LLM, and whether they agreed.
router_checks = Table(
    "router_checks",
    metadata,
    Column("id", Id, autoincrement=True),
    Column("student_id", BigInteger, nullable=False),
    Column("pipeline", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    Column("stage", String(200), nullable=False),
    Column("doc_key", String(500), nullable=False),
    Column("cache_key", String(64), nullable=False),
    Column("student_label", Text, nullable=False),
    Column("llm_label", Text, nullable=False),
    Column("agree", Boolean, nullable=False),
    _now(),
    UniqueConstraint("tenant", "student_id", "cache_key", name="uq_router_checks"),
    PrimaryKeyConstraint("tenant", "id", name="pk_router_checks"),
)

# -- access ----------------------------------------------------------------------------------

#: Which tenants each analyst login may read (PostgreSQL only; see ``connectors.store.security``).
analyst_grants = Table(
    "analyst_grants",
    metadata,
    Column("role", String(200), nullable=False),
    Column("tenant", String(200), nullable=False),
    _now(),
    PrimaryKeyConstraint("role", "tenant", name="pk_analyst_grants"),
)

#: Tables with a tenant column: row-level security for analysts applies to each (PostgreSQL).
TENANT_TABLES = ("documents", "stage_results", "llm_cache", "llm_calls", "dead_letters", "golden_examples",
                 "eval_runs", "eval_results", "drift_alerts", "review_queue", "cache_texts", "students",
                 "router_checks", "stage_chunks", "field_spans", "stability_runs")

_SCALARS: dict[Any, Any] = {
    str: Text,
    int: BigInteger,
    float: Float,
    bool: Boolean,
    dt.date: Date,
    dt.datetime: lambda: DateTime(timezone=True),
    decimal.Decimal: Numeric,
}
#: Columns every typed table has before the schema's own fields.
TYPED_KEY_COLUMNS = ("tenant", "pipeline", "doc_key")


def _column_type(annotation: Any) -> tuple[Any, bool]:
    """(SQL type, nullable) for a pydantic field annotation; anything not scalar is stored as JSON."""
    nullable = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else None
    sql = _SCALARS.get(annotation)
    return (sql() if sql is not None else Json), nullable


#: PostgreSQL cuts identifiers at 63 bytes: two longer names could become one column.
MAX_IDENTIFIER_BYTES = 63


def typed_table_names(conn: Any) -> list[str]:
    """The typed tables in the store's schema, found by the columns idem-etl gives each (so tables
    of pipelines this process never loaded count too)."""
    from sqlalchemy import inspect  # noqa: PLC0415

    inspector = inspect(conn)
    mark = {*TYPED_KEY_COLUMNS, "cache_key", "updated_at"}
    return sorted(n for n in inspector.get_table_names() if n not in metadata.tables
                  and mark <= {c["name"] for c in inspector.get_columns(n)})


def typed_table_problem(name: str, schema: type[BaseModel]) -> str | None:
    """Why ``schema`` cannot have a typed table called ``name`` on every store, or None. Names
    compare case-insensitively: SQLite's columns do (a field ``Tenant`` is the ``tenant`` column)."""
    if len(f"pk_{name}".encode()) > MAX_IDENTIFIER_BYTES:  # its primary key's name must fit too
        return f"table name {name!r} is longer than {MAX_IDENTIFIER_BYTES - 3} bytes; pass a shorter table="
    seen = {column: f"the column {column!r} idem-etl adds" for column in (*TYPED_KEY_COLUMNS, "cache_key", "updated_at")}
    for field in schema.model_fields:
        if len(field.encode()) > MAX_IDENTIFIER_BYTES:
            return f"field {field!r} of {schema.__name__} is longer than {MAX_IDENTIFIER_BYTES} bytes; shorten it"
        clash = seen.get(field.casefold())
        if clash is not None:
            return f"field {field!r} of {schema.__name__} clashes with {clash} (names ignore case); rename it"
        seen[field.casefold()] = f"field {field!r}"
    return None


def typed_table(name: str, schema: type[BaseModel], meta: MetaData) -> Table:
    """A table with one column per field of ``schema``, keyed like ``stage_results``."""
    problem = typed_table_problem(name, schema)
    if problem is not None:
        raise ValueError(problem)
    columns = []
    for field, info in schema.model_fields.items():
        sql_type, nullable = _column_type(info.annotation)
        columns.append(Column(field, sql_type, nullable=nullable or not info.is_required()))
    return Table(
        name,
        meta,
        Column("pipeline", String(200), nullable=False),
        Column("tenant", String(200), nullable=False),
        Column("doc_key", String(500), nullable=False),
        *columns,
        Column("cache_key", String(64), nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        PrimaryKeyConstraint(*TYPED_KEY_COLUMNS, name=f"pk_{name}"),
    )


def same_columns(a: type[BaseModel], b: type[BaseModel]) -> bool:
    """Whether two schemas make the same typed table (column names, types and nullability)."""
    def spec(schema: type[BaseModel]) -> list[tuple[str, str, bool]]:
        return [(c.name, repr(c.type), bool(c.nullable)) for c in typed_table("t", schema, MetaData()).columns]

    return a is b or spec(a) == spec(b)
