"""reviewers write verdicts and golden examples in their own name (``etl review serve``)

Revision ID: 0014
Revises: 0013

``golden_examples.reviewer`` and ``reviewed_at``: who confirmed or corrected an example, and when
(null for imported ones). On PostgreSQL, write policies let a login in ``etl_reviewer`` update a
review item's verdict and add or correct a golden example, only for the tenants granted to it and
only with ``reviewer = current_user`` (``etl.store.security.protect_review_writes``); the role and
its column grants are an owner's step (``etl review init``).
"""

import sqlalchemy as sa
from alembic import op

from connectors.store.security import REVIEWER_ROLE, grant_review_writes, protect_review_writes, role_exists

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        op.execute("SET LOCAL lock_timeout = '10s'")
    with op.batch_alter_table("golden_examples") as batch:
        batch.add_column(sa.Column("reviewer", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("reviewed_at", sa.DateTime(timezone=True), nullable=True))
    if postgres:
        protect_review_writes(op.get_bind())
        if role_exists(op.get_bind(), REVIEWER_ROLE):
            grant_review_writes(op.get_bind())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for policy, table in (("review_verdicts", "review_queue"), ("review_golden_insert", "golden_examples"),
                              ("review_golden_update", "golden_examples")):
            op.execute(f"DROP POLICY IF EXISTS {policy} ON {table}")
    with op.batch_alter_table("golden_examples") as batch:
        batch.drop_column("reviewed_at")
        batch.drop_column("reviewer")
