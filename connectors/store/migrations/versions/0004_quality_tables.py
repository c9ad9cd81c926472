"""quality tables

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 11:19:59.133889
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('drift_alerts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('stage', sa.String(length=200), nullable=False),
    sa.Column('metric', sa.String(length=50), nullable=False),
    sa.Column('baseline', sa.Float(), nullable=False),
    sa.Column('recent', sa.Float(), nullable=False),
    sa.Column('score', sa.Float(), nullable=False),
    sa.Column('threshold', sa.Float(), nullable=False),
    sa.Column('window', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('eval_results',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('doc_key', sa.String(length=500), nullable=False),
    sa.Column('expected', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('predicted', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('correct', sa.Boolean(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('eval_results', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_eval_results_run_id'), ['run_id'], unique=False)

    op.create_table('eval_runs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('stage', sa.String(length=200), nullable=False),
    sa.Column('model', sa.String(length=300), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('examples', sa.Integer(), nullable=False),
    sa.Column('failed', sa.Integer(), nullable=False),
    sa.Column('accuracy', sa.Float(), nullable=False),
    sa.Column('macro_f1', sa.Float(), nullable=True),
    sa.Column('details', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('golden_examples',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('stage', sa.String(length=200), nullable=False),
    sa.Column('doc_key', sa.String(length=500), nullable=False),
    sa.Column('content', sa.Text(), nullable=False),
    sa.Column('expected', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('origin', sa.String(length=20), server_default='import', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('pipeline', 'tenant', 'stage', 'doc_key', name='uq_golden_examples')
    )
    op.create_table('review_queue',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('stage', sa.String(length=200), nullable=False),
    sa.Column('doc_key', sa.String(length=500), nullable=False),
    sa.Column('content', sa.Text(), nullable=False),
    sa.Column('output', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('sampled_because', sa.String(length=20), nullable=False),
    sa.Column('status', sa.String(length=20), server_default='pending', nullable=False),
    sa.Column('verdict', sa.String(length=20), nullable=True),
    sa.Column('corrected', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('reviewer', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('reviewed_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('pipeline', 'tenant', 'doc_key', 'stage', name='uq_review_queue')
    )


def downgrade() -> None:
    op.drop_table('review_queue')
    op.drop_table('golden_examples')
    op.drop_table('eval_runs')
    with op.batch_alter_table('eval_results', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_eval_results_run_id'))

    op.drop_table('eval_results')
    op.drop_table('drift_alerts')
