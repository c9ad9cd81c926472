"""one version number per student, one active student per pipeline × stage × tenant

Revision ID: 0011
Revises: 0010

Two ``etl distill`` runs at once could both take the next version number and both activate a
student (workers would then pick one of the two at random). A unique index on the version makes
the second commit fail instead (``etl distill`` says to run it again); rows stored before it are
renumbered in id order, and of several active students only the newest stays active.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

SAME = "s2.pipeline = students.pipeline AND s2.stage = students.stage AND s2.tenant = students.tenant"


def upgrade() -> None:
    op.execute(sa.text(
        f"UPDATE students SET status = 'retired', closed_at = CURRENT_TIMESTAMP, reason = 'replaced by a newer active "
        f"student (two distills at once)' WHERE status = 'active' AND id < (SELECT max(s2.id) FROM students AS s2 "
        f"WHERE {SAME} AND s2.status = 'active')"))
    op.execute(sa.text(f"UPDATE students SET version = (SELECT count(*) FROM students AS s2 WHERE {SAME} "
                       "AND s2.id <= students.id)"))
    op.create_index("uq_students_version", "students", ["pipeline", "stage", "tenant", "version"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_students_version", table_name="students")
