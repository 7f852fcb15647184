"""Alias history entries carry their move number, unique per alias: two concurrent moves of one alias cannot both
commit.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("alias_history") as batch:
        batch.add_column(sa.Column("sequence", sa.Integer(), nullable=True))
    # Existing entries are numbered in the order they were made.
    op.execute(
        "UPDATE alias_history SET sequence = (SELECT count(*) FROM alias_history AS earlier"
        " WHERE earlier.model_name = alias_history.model_name AND earlier.alias = alias_history.alias"
        " AND earlier.id <= alias_history.id)"
    )
    with op.batch_alter_table("alias_history") as batch:
        batch.alter_column("sequence", existing_type=sa.Integer(), nullable=False)
        batch.create_unique_constraint(
            op.f("uq_alias_history_model_name_alias_sequence"), ["model_name", "alias", "sequence"]
        )


def downgrade() -> None:
    with op.batch_alter_table("alias_history") as batch:
        batch.drop_constraint(op.f("uq_alias_history_model_name_alias_sequence"), type_="unique")
        batch.drop_column("sequence")
