"""``etl stability``: how often a stage's model gives the same answer when asked again

Revision ID: 0016
Revises: 0015

``stability_runs``: per pipeline × tenant × stage × model (its fingerprint), one row per
measurement: documents, samples per document, the share answered one way, distinct answers per
document, Classify's label flip rate, the share of stored answers reproduced, the calls it cost, and
per-field agreement with confidence intervals (``details``). A tenant table: row-level security for
analysts, like every other.
"""

import sqlalchemy as sa
from alembic import op

from connectors.store.security import analyst_role_exists, grant_reads, protect_tenant_table
from connectors.store.tables import Json

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("stability_runs",
                    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                              autoincrement=True),
                    sa.Column("pipeline", sa.String(length=200), nullable=False),
                    sa.Column("tenant", sa.String(length=200), nullable=False),
                    sa.Column("stage", sa.String(length=200), nullable=False),
                    sa.Column("model", sa.String(length=300), nullable=False),
                    sa.Column("fingerprint", sa.String(length=64), nullable=False),
                    sa.Column("documents", sa.Integer(), nullable=False),
                    sa.Column("samples", sa.Integer(), nullable=False),
                    sa.Column("unanimous", sa.Float(), nullable=False),
                    sa.Column("distinct_answers", sa.Float(), nullable=False),
                    sa.Column("label_flip_rate", sa.Float(), nullable=True),
                    sa.Column("reproduced", sa.Float(), nullable=True),
                    sa.Column("calls", sa.Integer(), nullable=False),
                    sa.Column("cost", sa.Float(), nullable=False),
                    sa.Column("details", Json, nullable=False),
                    sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False))
    op.create_index("ix_stability_runs_stage", "stability_runs", ["pipeline", "tenant", "stage", "model", "created_at"])
    conn = op.get_bind()
    if conn.dialect.name == "postgresql":
        op.execute("SET LOCAL lock_timeout = '10s'")
        protect_tenant_table(conn, "stability_runs")
        if analyst_role_exists(conn):
            grant_reads(conn)


def downgrade() -> None:
    op.drop_index("ix_stability_runs_stage", table_name="stability_runs")
    op.drop_table("stability_runs")
