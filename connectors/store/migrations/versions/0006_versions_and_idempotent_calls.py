"""document versions looked up by key, idempotent attempt rows, dead letters through an outbox

Revision ID: 0006
Revises: 0005

``llm_calls.call_id``: each attempt's own id, unique, so a commit retried after a lost acknowledgement
adds no second row. ``dead_letters.published``: whether the letter has reached the source's
dead-letter channel (written false in the results' transaction, set once published), so a crash
between the two never republishes it; letters that existed before this revision count as published.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Stored versions are looked up by doc key alone, like results and dead letters.
    op.create_index("ix_documents_doc_key", "documents", ["pipeline", "doc_key"])
    with op.batch_alter_table("llm_calls") as batch:
        batch.add_column(sa.Column("call_id", sa.String(length=32), nullable=True))
        batch.create_index("uq_llm_calls_call_id", ["call_id"], unique=True)
    with op.batch_alter_table("dead_letters") as batch:
        batch.add_column(sa.Column("published", sa.Boolean(), nullable=False, server_default=sa.true()))
    op.create_index("ix_dead_letters_unpublished", "dead_letters", ["pipeline"],
                    postgresql_where=sa.text("NOT published"), sqlite_where=sa.text("NOT published"))


def downgrade() -> None:
    op.drop_index("ix_documents_doc_key", table_name="documents")
    op.drop_index("ix_dead_letters_unpublished", table_name="dead_letters")
    with op.batch_alter_table("dead_letters") as batch:
        batch.drop_column("published")
    with op.batch_alter_table("llm_calls") as batch:
        batch.drop_index("uq_llm_calls_call_id")
        batch.drop_column("call_id")
