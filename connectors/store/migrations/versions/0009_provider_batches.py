"""provider batches and their requests, recorded before the provider creates them

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("llm_batches",
                    sa.Column("id", sa.String(length=32), primary_key=True),
                    sa.Column("pipeline", sa.String(length=200), nullable=False),
                    sa.Column("provider", sa.String(length=500), nullable=False),
                    sa.Column("provider_id", sa.String(length=200), nullable=True),
                    sa.Column("status", sa.String(length=20), server_default="recorded", nullable=False),
                    sa.Column("lines", sa.Integer(), nullable=False),
                    sa.Column("output_file_id", sa.String(length=200), nullable=True),
                    sa.Column("error_file_id", sa.String(length=200), nullable=True),
                    sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
                    sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_llm_batches_live", "llm_batches", ["pipeline", "status"])
    op.create_table("llm_batch_items",
                    sa.Column("batch_id", sa.String(length=32), nullable=False),
                    sa.Column("custom_id", sa.String(length=64), nullable=False),
                    sa.PrimaryKeyConstraint("batch_id", "custom_id", name="pk_llm_batch_items"))
    op.create_index("ix_llm_batch_items_custom_id", "llm_batch_items", ["custom_id"])


def downgrade() -> None:
    op.drop_table("llm_batch_items")
    op.drop_table("llm_batches")
