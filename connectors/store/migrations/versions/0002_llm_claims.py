"""llm claims

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 10:45:40.840373
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('llm_claims',
    sa.Column('cache_key', sa.String(length=64), nullable=False),
    sa.Column('owner', sa.String(length=100), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('cache_key')
    )


def downgrade() -> None:
    op.drop_table('llm_claims')
