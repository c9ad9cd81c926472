"""the router: texts of routed stages' answers, students as plain data, shadow checks

Revision ID: 0010
Revises: 0009

``stage_results.answered_by``: NULL for the model's answers, ``student:<id>`` for a student's.
The three new tables carry a tenant: on PostgreSQL they get the tenant policy of 0008.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from connectors.store.security import analyst_role_exists, grant_reads, protect_tenant_table

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

Json = sa.JSON().with_variant(JSONB(), "postgresql")
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
NEW = ("cache_texts", "students", "router_checks")

#: Per tenant × stage × day: what the students answered (calls avoided) and what that saved (each
#: answer at its student's mean LLM cost per answer), and the shadow checks with their agreement.
ROUTER_DAILY = """
SELECT a.pipeline, a.tenant, a.stage, a.day, sum(a.answers) AS student_answers, sum(a.saved) AS saved,
       sum(a.checks) AS shadow_checks, sum(a.agreed) AS shadow_agreed
FROM (
  SELECT r.pipeline, r.tenant, r.stage, date(r.created_at) AS day, count(*) AS answers, sum(s.mean_cost) AS saved,
         0 AS checks, 0 AS agreed
  FROM stage_results AS r JOIN students AS s ON r.answered_by = 'student:' || CAST(s.id AS TEXT)
  GROUP BY r.pipeline, r.tenant, r.stage, date(r.created_at)
  UNION ALL
  SELECT c.pipeline, c.tenant, c.stage, date(c.created_at) AS day, 0, 0, count(*), sum(CASE WHEN c.agree THEN 1 ELSE 0 END)
  FROM router_checks AS c
  GROUP BY c.pipeline, c.tenant, c.stage, date(c.created_at)
) AS a
GROUP BY a.pipeline, a.tenant, a.stage, a.day
"""


def _created() -> sa.Column:
    return sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)


def upgrade() -> None:
    op.add_column("stage_results", sa.Column("answered_by", sa.String(length=64), nullable=True))
    op.create_table("cache_texts",
                    sa.Column("cache_key", sa.String(length=64), primary_key=True),
                    sa.Column("tenant", sa.String(length=200), nullable=False),
                    sa.Column("content", sa.Text(), nullable=False),
                    _created())
    op.create_table("students",
                    sa.Column("id", Id, primary_key=True, autoincrement=True),
                    sa.Column("pipeline", sa.String(length=200), nullable=False),
                    sa.Column("stage", sa.String(length=200), nullable=False),
                    sa.Column("tenant", sa.String(length=200), nullable=False),
                    sa.Column("fingerprint", sa.String(length=64), nullable=False),
                    sa.Column("version", sa.Integer(), nullable=False),
                    sa.Column("status", sa.String(length=20), nullable=False),
                    sa.Column("reason", sa.Text(), nullable=False),
                    sa.Column("trained_on", sa.Integer(), nullable=False),
                    sa.Column("holdout", sa.String(length=20), nullable=False),
                    sa.Column("threshold", sa.Float(), nullable=True),
                    sa.Column("target", sa.Float(), nullable=False),
                    sa.Column("level", sa.Float(), nullable=False),
                    sa.Column("certified_on", sa.Integer(), nullable=False),
                    sa.Column("covered", sa.Integer(), nullable=False),
                    sa.Column("correct", sa.Integer(), nullable=False),
                    sa.Column("lower_bound", sa.Float(), nullable=False),
                    sa.Column("agreement", sa.Float(), nullable=False),
                    sa.Column("agreement_lb", sa.Float(), nullable=False),
                    sa.Column("agreement_n", sa.Integer(), nullable=False),
                    sa.Column("mean_cost", sa.Float(), nullable=False),
                    sa.Column("spec", Json, nullable=False),
                    sa.Column("weights", sa.LargeBinary(), nullable=False),
                    _created(),
                    sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_students_live", "students", ["pipeline", "status"])
    op.create_table("router_checks",
                    sa.Column("id", Id, primary_key=True, autoincrement=True),
                    sa.Column("student_id", sa.BigInteger(), nullable=False),
                    sa.Column("pipeline", sa.String(length=200), nullable=False),
                    sa.Column("tenant", sa.String(length=200), nullable=False),
                    sa.Column("stage", sa.String(length=200), nullable=False),
                    sa.Column("doc_key", sa.String(length=500), nullable=False),
                    sa.Column("cache_key", sa.String(length=64), nullable=False),
                    sa.Column("student_label", sa.Text(), nullable=False),
                    sa.Column("llm_label", sa.Text(), nullable=False),
                    sa.Column("agree", sa.Boolean(), nullable=False),
                    _created(),
                    sa.UniqueConstraint("student_id", "cache_key", name="uq_router_checks"))
    conn = op.get_bind()
    if conn.dialect.name == "postgresql":
        op.execute(f"CREATE VIEW router_daily WITH (security_invoker = true) AS {ROUTER_DAILY}")
        op.execute("SET LOCAL lock_timeout = '10s'")
        for table in NEW:
            protect_tenant_table(conn, table)
        if analyst_role_exists(conn):
            grant_reads(conn)
    else:
        op.execute(f"CREATE VIEW router_daily AS {ROUTER_DAILY}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS router_daily")
    for table in reversed(NEW):
        op.drop_table(table)
    with op.batch_alter_table("stage_results") as batch:
        batch.drop_column("answered_by")
