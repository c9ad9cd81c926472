"""per-field confidence: cached with each answer, stored beside each value's span

Revision ID: 0013
Revises: 0012

``llm_cache.confidence``: per value path, ``[probability, source]`` (``etl.confidence``), so a
cache hit carries the confidence the answer was given with. ``field_spans.confidence`` and
``confidence_from`` (logprob | agreement): the same per stored value, for analysts and the
calibration report. Nullable: answers cached before this, and backends without log-probabilities,
have none.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("SET LOCAL lock_timeout = '10s'")
    with op.batch_alter_table("llm_cache") as batch:
        batch.add_column(sa.Column("confidence", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))
    with op.batch_alter_table("field_spans") as batch:
        batch.add_column(sa.Column("confidence", sa.Float(), nullable=True))
        batch.add_column(sa.Column("confidence_from", sa.String(length=20), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("field_spans") as batch:
        batch.drop_column("confidence_from")
        batch.drop_column("confidence")
    with op.batch_alter_table("llm_cache") as batch:
        batch.drop_column("confidence")
