"""Stored dataset reports: a file's validation and PII reports, computed once per content and reused.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dataset_reports",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("parameters_key", sa.String(length=64), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], name=op.f("fk_dataset_reports_project_id_projects")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dataset_reports")),
        sa.UniqueConstraint(
            "project_id",
            "sha256",
            "kind",
            "parameters_key",
            name=op.f("uq_dataset_reports_project_id_sha256_kind_parameters_key"),
        ),
    )


def downgrade() -> None:
    op.drop_table("dataset_reports")
