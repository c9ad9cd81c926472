"""long documents: the chunks a stage was answered in, and where each extracted value sits

Revision ID: 0012
Revises: 0011

``stage_chunks``: per document × stage, the chunks of a long document (offsets, pages, cache
hit); ``field_spans``: per document × stage × value path, the span of the source text the value
was found at (or ``match = 'none'``: ungrounded). Both have a tenant column: row-level security
for analysts, like every tenant table.
"""

import sqlalchemy as sa
from alembic import op

from connectors.store.security import analyst_role_exists, grant_reads, protect_tenant_table

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

NEW = ("stage_chunks", "field_spans")


def _doc_columns() -> list[sa.Column]:
    return [sa.Column("pipeline", sa.String(length=200), nullable=False),
            sa.Column("tenant", sa.String(length=200), nullable=False),
            sa.Column("doc_key", sa.String(length=500), nullable=False),
            sa.Column("stage", sa.String(length=200), nullable=False)]


def upgrade() -> None:
    op.create_table("stage_chunks", *_doc_columns(),
                    sa.Column("ordinal", sa.Integer(), nullable=False),
                    sa.Column("cache_key", sa.String(length=64), nullable=False),
                    sa.Column("char_start", sa.BigInteger(), nullable=False),
                    sa.Column("char_end", sa.BigInteger(), nullable=False),
                    sa.Column("page_start", sa.Integer(), nullable=False),
                    sa.Column("page_end", sa.Integer(), nullable=False),
                    sa.Column("cache_hit", sa.Boolean(), nullable=False),
                    sa.PrimaryKeyConstraint("pipeline", "tenant", "doc_key", "stage", "ordinal", name="pk_stage_chunks"))
    op.create_table("field_spans", *_doc_columns(),
                    sa.Column("path", sa.String(length=500), nullable=False),
                    sa.Column("value", sa.Text(), nullable=False),
                    sa.Column("char_start", sa.BigInteger(), nullable=True),
                    sa.Column("char_end", sa.BigInteger(), nullable=True),
                    sa.Column("page", sa.Integer(), nullable=True),
                    sa.Column("match", sa.String(length=20), nullable=False),
                    sa.Column("score", sa.Float(), nullable=False),
                    sa.PrimaryKeyConstraint("pipeline", "tenant", "doc_key", "stage", "path", name="pk_field_spans"))
    conn = op.get_bind()
    if conn.dialect.name == "postgresql":
        op.execute("SET LOCAL lock_timeout = '10s'")
        for table in NEW:
            protect_tenant_table(conn, table)
        if analyst_role_exists(conn):
            grant_reads(conn)


def downgrade() -> None:
    for table in reversed(NEW):
        op.drop_table(table)
