"""Console sign-outs: the sessions ended before their cookies expired, refused from then on.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "console_session_ends",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_console_session_ends")),
    )
    op.create_index("ix_console_session_ends_expires_at", "console_session_ends", ["expires_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_console_session_ends_expires_at", table_name="console_session_ends")
    op.drop_table("console_session_ends")
