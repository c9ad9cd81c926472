"""structured output provenance

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 11:09:06.944310
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('llm_cache', schema=None) as batch_op:
        batch_op.add_column(sa.Column('structured', sa.String(length=20), nullable=True))
        batch_op.add_column(sa.Column('system_fingerprint', sa.String(length=200), nullable=True))

    with op.batch_alter_table('stage_results', schema=None) as batch_op:
        batch_op.add_column(sa.Column('structured', sa.String(length=20), nullable=True))
        batch_op.add_column(sa.Column('system_fingerprint', sa.String(length=200), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('stage_results', schema=None) as batch_op:
        batch_op.drop_column('system_fingerprint')
        batch_op.drop_column('structured')

    with op.batch_alter_table('llm_cache', schema=None) as batch_op:
        batch_op.drop_column('system_fingerprint')
        batch_op.drop_column('structured')

