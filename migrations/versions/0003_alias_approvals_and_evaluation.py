"""Four-eyes alias approvals; alias history records the approval and the evaluation gate's inputs.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 09:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "alias_approvals",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("model_name", sa.String(length=200), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("from_version_id", sa.String(length=40), nullable=True),
        sa.Column("to_version_id", sa.String(length=40), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("force", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("requested_by", sa.String(length=40), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decided_by", sa.String(length=40), nullable=True),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("decision_reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["from_version_id"], ["model_versions.id"], name=op.f("fk_alias_approvals_from_version_id_model_versions")
        ),
        sa.ForeignKeyConstraint(
            ["to_version_id"], ["model_versions.id"], name=op.f("fk_alias_approvals_to_version_id_model_versions")
        ),
        sa.ForeignKeyConstraint(
            ["requested_by"], ["api_keys.id"], name=op.f("fk_alias_approvals_requested_by_api_keys")
        ),
        sa.ForeignKeyConstraint(["decided_by"], ["api_keys.id"], name=op.f("fk_alias_approvals_decided_by_api_keys")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alias_approvals")),
    )
    op.create_index("ix_alias_approvals_status_created_at", "alias_approvals", ["status", "created_at"], unique=False)
    with op.batch_alter_table("alias_history") as batch:
        batch.add_column(sa.Column("approval_id", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("requested_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("evaluation", sa.JSON(), nullable=True))
        batch.create_foreign_key(
            op.f("fk_alias_history_approval_id_alias_approvals"), "alias_approvals", ["approval_id"], ["id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("alias_history") as batch:
        batch.drop_constraint(op.f("fk_alias_history_approval_id_alias_approvals"), type_="foreignkey")
        batch.drop_column("evaluation")
        batch.drop_column("requested_at")
        batch.drop_column("approval_id")
    op.drop_index("ix_alias_approvals_status_created_at", table_name="alias_approvals")
    op.drop_table("alias_approvals")
