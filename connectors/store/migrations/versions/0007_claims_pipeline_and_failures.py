"""claims know their pipeline and a holder's terminal failure

Revision ID: 0007
Revises: 0006

``llm_claims.pipeline``: whose claim it is (``etl status`` shows a pipeline's own). ``failure``: the
reason a holder's call for the key ended as a dead letter, kept until its lease ends, so workers
waiting on the key take that outcome instead of paying for the same failure again (a failure is
never cached: a later run may retry it). Leases are timed by the database's clock.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("llm_claims") as batch:
        batch.add_column(sa.Column("pipeline", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("failure", sa.String(length=40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("llm_claims") as batch:
        batch.drop_column("failure")
        batch.drop_column("pipeline")
