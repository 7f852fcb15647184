"""Job leases (token, lost-lease count), the pinned base version of a job, one model version per job.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 06:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.add_column(sa.Column("lease_token", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("lease_expirations", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("base_version_id", sa.String(length=40), nullable=True))
    with op.batch_alter_table("model_versions") as batch:
        batch.create_unique_constraint(op.f("uq_model_versions_job_id"), ["job_id"])


def downgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_constraint(op.f("uq_model_versions_job_id"), type_="unique")
    with op.batch_alter_table("fine_tuning_jobs") as batch:
        batch.drop_column("base_version_id")
        batch.drop_column("lease_expirations")
        batch.drop_column("lease_token")
