"""An index for listing fine-tuning jobs newest first, a page at a time (`created_at`, then `id`).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 17:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_fine_tuning_jobs_created_at_id", "fine_tuning_jobs", ["created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_fine_tuning_jobs_created_at_id", table_name="fine_tuning_jobs")
