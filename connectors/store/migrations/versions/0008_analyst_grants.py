"""analyst grants: which tenants each login may read, enforced by row-level security (PostgreSQL)

Revision ID: 0008
Revises: 0007

Before this revision a reader chose its tenant with ``SET app.tenant``, a setting the session it
restricts can change. Now every policy checks ``current_user`` against ``analyst_grants``, rows
only the owner writes (``etl analyst grant``); ``app.tenant`` only narrows. Existing analysts see
nothing until granted. Needs no cluster-wide rights: the analyst role is granted read access
only if an admin has created it.
"""

import sqlalchemy as sa
from alembic import op

from connectors.store.security import GRANTS_TABLE, analyst_role_exists, grant_reads, protect_grants, \
    protect_tenant_table, protected_tables
from connectors.store.tables import typed_table_names

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

#: Tables with a tenant column at this revision (typed tables are found by their columns: those
#: created before 0005 had no row-level security yet).
TENANT_TABLES = ("documents", "stage_results", "llm_cache", "llm_calls", "dead_letters", "golden_examples",
                 "eval_runs", "eval_results", "drift_alerts", "review_queue")


def upgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != "postgresql":
        return  # SQLite has no logins: the file's readers read all of it
    # Each policy change locks its table: behind an analyst's long query, give up (and retry)
    # rather than queue every writer behind the migration.
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.create_table(GRANTS_TABLE,
                    sa.Column("role", sa.String(length=200), nullable=False),
                    sa.Column("tenant", sa.String(length=200), nullable=False),
                    sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
                    sa.PrimaryKeyConstraint("role", "tenant", name="pk_analyst_grants"))
    protect_grants(conn)
    for table in sorted({*TENANT_TABLES, *typed_table_names(conn), *protected_tables(conn)}):
        protect_tenant_table(conn, table)
    if analyst_role_exists(conn):
        grant_reads(conn)


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != "postgresql":
        return
    for table in protected_tables(conn):
        op.execute(f'DROP POLICY tenant_isolation ON "{table}"')
    op.drop_table(GRANTS_TABLE)
