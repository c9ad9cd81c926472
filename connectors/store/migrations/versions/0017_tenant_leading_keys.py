"""Every per-tenant table's primary and unique keys lead with the tenant

Revision ID: 0017
Revises: 0016

So that distributing the store by tenant (Citus: ``create_distributed_table(t, 'tenant')``, which
refuses a primary or unique key without the distribution column) needs no key change. On
PostgreSQL each key is rebuilt as ``(tenant, ...)``: the surrogate ``id`` keys become
``(tenant, id)``, ``llm_cache`` / ``cache_texts`` are keyed ``(tenant, cache_key)``, ``llm_calls``'
attempt ids ``(tenant, call_id)``, a dead letter's position ``(tenant, pipeline, stream, partition,
offset)``, and the natural keys that held the tenant second now hold it first. Plain indexes keep
the look-ups that come without a tenant fast: ``llm_cache(cache_key)``, a dead letter's position
and ``id``, a review item's ``id``. Each rebuild locks its table while it builds the index.

A dead letter of a message whose tenant could not be read had tenant NULL; a key column cannot be
NULL (nor a distribution column), so it is ``''`` now — no login can be granted ``''``.

On SQLite (one file, never distributed) ``id`` stays the primary key (SQLite numbers only an
``INTEGER PRIMARY KEY``) and no table is rebuilt: keys that did not hold the tenant gain a unique
index that does, which the writes' conflict targets name.
"""

import sqlalchemy as sa
from alembic import op

from connectors.store.tables import typed_table_names

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

#: Tables whose primary key is a surrogate ``id``: it becomes ``(tenant, id)`` on PostgreSQL.
_ID_KEYED = ("documents", "stage_results", "llm_calls", "dead_letters", "golden_examples", "eval_runs",
             "eval_results", "drift_alerts", "review_queue", "students", "router_checks", "stability_runs")
#: Other primary keys: table -> columns after the tenant.
_KEYED = {"llm_cache": ("cache_key",), "cache_texts": ("cache_key",),
          "stage_chunks": ("pipeline", "doc_key", "stage", "ordinal"),
          "field_spans": ("pipeline", "doc_key", "stage", "path")}
#: Unique constraints: name -> (table, columns after the tenant, whether the old key lacked it).
_UNIQUE = {"uq_documents_doc": ("documents", ("pipeline", "doc_key"), False),
           "uq_stage_results_doc_stage": ("stage_results", ("pipeline", "doc_key", "stage"), False),
           "uq_golden_examples": ("golden_examples", ("pipeline", "stage", "doc_key"), False),
           "uq_review_queue": ("review_queue", ("pipeline", "doc_key", "stage"), False),
           "uq_dead_letters_position": ("dead_letters", ("pipeline", "stream", "partition", "message_offset"), True),
           "uq_router_checks": ("router_checks", ("student_id", "cache_key"), True)}
#: Unique indexes (not constraints): name -> (table, columns after the tenant).
_UNIQUE_INDEXES = {"uq_llm_calls_call_id": ("llm_calls", ("call_id",)),
                   "uq_students_version": ("students", ("pipeline", "stage", "version"))}
#: PostgreSQL only: the look-ups that come without a tenant (SQLite's old keys still serve them).
_PLAIN_INDEXES = {"ix_llm_cache_key": ("llm_cache", ("cache_key",)),
                  "ix_dead_letters_position": ("dead_letters", ("pipeline", "stream", "partition", "message_offset")),
                  "ix_dead_letters_id": ("dead_letters", ("id",)),
                  "ix_review_queue_id": ("review_queue", ("id",))}


def _primary_key(conn: sa.Connection, table: str) -> str | None:
    """The table's primary key's name; None for a table with none."""
    return sa.inspect(conn).get_pk_constraint(table).get("name")


def upgrade() -> None:
    conn = op.get_bind()
    op.execute("UPDATE dead_letters SET tenant = '' WHERE tenant IS NULL")
    if conn.dialect.name != "postgresql":
        for name, (table, columns, lacked) in _UNIQUE.items():
            if lacked:
                op.create_index(f"{name}_tenant", table, ["tenant", *columns], unique=True)
        for table in ("llm_cache", "cache_texts"):
            op.create_index(f"uq_{table}_tenant_key", table, ["tenant", "cache_key"], unique=True)
        for name, (table, columns) in _UNIQUE_INDEXES.items():
            op.drop_index(name, table_name=table)
            op.create_index(name, table, ["tenant", *columns], unique=True)
        return
    op.execute("SET LOCAL lock_timeout = '30s'")
    op.alter_column("dead_letters", "tenant", nullable=False)
    keys = {table: ("id",) for table in _ID_KEYED} | _KEYED
    keys |= {table: ("pipeline", "doc_key") for table in typed_table_names(conn)}
    for table, columns in keys.items():
        name = _primary_key(conn, table)
        if name is None:  # a table with typed_table's columns but no key: not one idem-etl made
            continue
        op.drop_constraint(name, table, type_="primary")
        # Typed tables keep their name (pk_<table>, made by typed_table); the others get pk_<table>.
        op.create_primary_key(name if name.startswith("pk_") else f"pk_{table}", table, ["tenant", *columns])
    for name, (table, columns, _) in _UNIQUE.items():
        op.drop_constraint(name, table, type_="unique")
        op.create_unique_constraint(name, table, ["tenant", *columns])
    for name, (table, columns) in _UNIQUE_INDEXES.items():
        op.drop_index(name, table_name=table)
        op.create_index(name, table, ["tenant", *columns], unique=True)
    for name, (table, columns) in _PLAIN_INDEXES.items():
        op.create_index(name, table, list(columns))


#: The keys 0001–0016 made, for the downgrade: unique name -> columns; table -> (primary key, columns).
_OLD_UNIQUE = {"uq_documents_doc": ("pipeline", "tenant", "doc_key"),
               "uq_stage_results_doc_stage": ("pipeline", "tenant", "doc_key", "stage"),
               "uq_golden_examples": ("pipeline", "tenant", "stage", "doc_key"),
               "uq_review_queue": ("pipeline", "tenant", "doc_key", "stage"),
               "uq_dead_letters_position": ("pipeline", "stream", "partition", "message_offset"),
               "uq_router_checks": ("student_id", "cache_key"),
               "uq_llm_calls_call_id": ("call_id",),
               "uq_students_version": ("pipeline", "stage", "tenant", "version")}
_OLD_KEYS = {table: (f"{table}_pkey", ("id",)) for table in _ID_KEYED} | {
    "llm_cache": ("llm_cache_pkey", ("cache_key",)), "cache_texts": ("cache_texts_pkey", ("cache_key",)),
    "stage_chunks": ("pk_stage_chunks", ("pipeline", "tenant", "doc_key", "stage", "ordinal")),
    "field_spans": ("pk_field_spans", ("pipeline", "tenant", "doc_key", "stage", "path"))}


def downgrade() -> None:
    conn = op.get_bind()
    for name, (table, _) in _UNIQUE_INDEXES.items():
        op.drop_index(name, table_name=table)
        op.create_index(name, table, list(_OLD_UNIQUE[name]), unique=True)
    if conn.dialect.name != "postgresql":
        for table in ("llm_cache", "cache_texts"):
            op.drop_index(f"uq_{table}_tenant_key", table_name=table)
        for name, (table, _, lacked) in _UNIQUE.items():
            if lacked:
                op.drop_index(f"{name}_tenant", table_name=table)
        op.execute("UPDATE dead_letters SET tenant = NULL WHERE tenant = ''")
        return
    op.execute("SET LOCAL lock_timeout = '30s'")
    for name, (table, _) in _PLAIN_INDEXES.items():
        op.drop_index(name, table_name=table)
    for name, (table, _, _) in _UNIQUE.items():
        op.drop_constraint(name, table, type_="unique")
        op.create_unique_constraint(name, table, list(_OLD_UNIQUE[name]))
    keys = _OLD_KEYS | {table: (f"pk_{table}", ("pipeline", "tenant", "doc_key")) for table in typed_table_names(conn)}
    for table, (name, columns) in keys.items():
        if (now := _primary_key(conn, table)) is None:
            continue
        op.drop_constraint(now, table, type_="primary")
        op.create_primary_key(name, table, list(columns))
    op.alter_column("dead_letters", "tenant", nullable=True)
    op.execute("UPDATE dead_letters SET tenant = NULL WHERE tenant = ''")
