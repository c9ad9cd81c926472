"""an answer without confidence is SQL NULL in ``llm_cache.confidence``, also in rows written before

Revision ID: 0015
Revises: 0014

Revision 0013's code stored "no confidence" as the JSON value ``null``, which ``confidence IS NULL``
does not find; the code since writes SQL NULL (``NullableJson``). This turns the older rows into
the same. Data only: the downgrade has nothing to undo.
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("SET LOCAL lock_timeout = '10s'")
        op.execute("UPDATE llm_cache SET confidence = NULL WHERE confidence = 'null'::jsonb")
    else:
        op.execute("UPDATE llm_cache SET confidence = NULL WHERE confidence = 'null'")


def downgrade() -> None:
    pass
