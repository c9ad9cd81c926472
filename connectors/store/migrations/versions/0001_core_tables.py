"""core tables

Revision ID: 0001
Revises: 
Create Date: 2026-12-02 10:32:11.918230
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('dead_letters',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('stream', sa.String(length=500), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('message_offset', sa.BigInteger(), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=True),
    sa.Column('doc_key', sa.String(length=500), nullable=True),
    sa.Column('stage', sa.String(length=200), nullable=True),
    sa.Column('cache_key', sa.String(length=64), nullable=True),
    sa.Column('reason', sa.String(length=50), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('payload', sa.LargeBinary(), nullable=False),
    sa.Column('raw_output', sa.Text(), nullable=True),
    sa.Column('status', sa.String(length=20), server_default='open', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('pipeline', 'stream', 'partition', 'message_offset', name='uq_dead_letters_position')
    )
    with op.batch_alter_table('dead_letters', schema=None) as batch_op:
        batch_op.create_index('ix_dead_letters_doc', ['pipeline', 'doc_key'], unique=False)

    op.create_table('documents',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('doc_key', sa.String(length=500), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('stream', sa.String(length=500), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('message_offset', sa.BigInteger(), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('pipeline', 'tenant', 'doc_key', name='uq_documents_doc')
    )
    op.create_table('llm_cache',
    sa.Column('cache_key', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('stage', sa.String(length=200), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('output', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('model', sa.String(length=300), nullable=False),
    sa.Column('tokens_in', sa.Integer(), nullable=False),
    sa.Column('tokens_out', sa.Integer(), nullable=False),
    sa.Column('cost', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('cache_key')
    )
    op.create_table('llm_calls',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('stage', sa.String(length=200), nullable=False),
    sa.Column('doc_key', sa.String(length=500), nullable=False),
    sa.Column('cache_key', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=300), nullable=False),
    sa.Column('outcome', sa.String(length=20), nullable=False),
    sa.Column('tokens_in', sa.Integer(), nullable=False),
    sa.Column('tokens_out', sa.Integer(), nullable=False),
    sa.Column('cost', sa.Float(), nullable=False),
    sa.Column('latency_ms', sa.Float(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('llm_calls', schema=None) as batch_op:
        batch_op.create_index('ix_llm_calls_tenant_stage', ['tenant', 'stage', 'created_at'], unique=False)

    op.create_table('source_positions',
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('stream', sa.String(length=500), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('next_offset', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('pipeline', 'stream', 'partition', name='pk_source_positions')
    )
    op.create_table('stage_results',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pipeline', sa.String(length=200), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('doc_key', sa.String(length=500), nullable=False),
    sa.Column('stage', sa.String(length=200), nullable=False),
    sa.Column('output', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('cache_key', sa.String(length=64), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=300), nullable=False),
    sa.Column('prompt_hash', sa.String(length=64), nullable=False),
    sa.Column('schema_hash', sa.String(length=64), nullable=False),
    sa.Column('cache_hit', sa.Boolean(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('tokens_in', sa.Integer(), nullable=False),
    sa.Column('tokens_out', sa.Integer(), nullable=False),
    sa.Column('cost', sa.Float(), nullable=False),
    sa.Column('latency_ms', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('pipeline', 'tenant', 'doc_key', 'stage', name='uq_stage_results_doc_stage')
    )
    with op.batch_alter_table('stage_results', schema=None) as batch_op:
        batch_op.create_index('ix_stage_results_doc_key', ['pipeline', 'doc_key'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('stage_results', schema=None) as batch_op:
        batch_op.drop_index('ix_stage_results_doc_key')

    op.drop_table('stage_results')
    op.drop_table('source_positions')
    with op.batch_alter_table('llm_calls', schema=None) as batch_op:
        batch_op.drop_index('ix_llm_calls_tenant_stage')

    op.drop_table('llm_calls')
    op.drop_table('llm_cache')
    op.drop_table('documents')
    with op.batch_alter_table('dead_letters', schema=None) as batch_op:
        batch_op.drop_index('ix_dead_letters_doc')

    op.drop_table('dead_letters')
