"""Projects: every key belongs to one, and files, fine-tuning jobs and inference records to their key's project; model
versions may be limited to named projects; workers say how many devices a job may train with on their host.

Existing keys and objects go to the `default` project, and the fine-tuned model versions of existing jobs are limited
to it (their jobs' project), so an install with one team sees no change.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_PROJECT_ID = "proj_default"
# The tables whose rows belong to a project, each row to exactly one.
OWNED_TABLES = ("api_keys", "files", "fine_tuning_jobs", "inference_records")


def upgrade() -> None:
    op.create_table(
        "projects",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects")),
        sa.UniqueConstraint("name", name=op.f("uq_projects_name")),
    )
    insert_default = "INSERT INTO projects (id, name, created_at) VALUES (:project, 'default', CURRENT_TIMESTAMP)"
    op.execute(sa.text(insert_default).bindparams(project=DEFAULT_PROJECT_ID))

    for table in OWNED_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("project_id", sa.String(length=40), nullable=True))
        op.execute(sa.text(f"UPDATE {table} SET project_id = :project").bindparams(project=DEFAULT_PROJECT_ID))
        with op.batch_alter_table(table) as batch:
            batch.alter_column("project_id", existing_type=sa.String(length=40), nullable=False)
            batch.create_foreign_key(op.f(f"fk_{table}_project_id_projects"), "projects", ["project_id"], ["id"])
    op.create_index("ix_files_project_id_created_at_id", "files", ["project_id", "created_at", "id"], unique=False)
    op.create_index(
        "ix_fine_tuning_jobs_project_id_created_at_id",
        "fine_tuning_jobs",
        ["project_id", "created_at", "id"],
        unique=False,
    )
    op.create_index("ix_fine_tuning_jobs_project_id_status", "fine_tuning_jobs", ["project_id", "status"], unique=False)

    with op.batch_alter_table("audit_log") as batch:
        batch.add_column(sa.Column("project_id", sa.String(length=40), nullable=True))
    op.execute(
        sa.text("UPDATE audit_log SET project_id = :project WHERE actor_key_id IS NOT NULL").bindparams(
            project=DEFAULT_PROJECT_ID
        )
    )
    op.create_index("ix_audit_log_project_id", "audit_log", ["project_id"], unique=False)

    op.create_table(
        "model_version_projects",
        sa.Column("version_id", sa.String(length=40), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_model_version_projects_project_id_projects")
        ),
        sa.ForeignKeyConstraint(
            ["version_id"], ["model_versions.id"], name=op.f("fk_model_version_projects_version_id_model_versions")
        ),
        sa.PrimaryKeyConstraint("version_id", "project_id", name=op.f("pk_model_version_projects")),
    )
    # A job's result belongs to its job's project.
    op.execute(
        sa.text(
            "INSERT INTO model_version_projects (version_id, project_id)"
            " SELECT id, :project FROM model_versions WHERE job_id IS NOT NULL"
        ).bindparams(project=DEFAULT_PROJECT_ID)
    )

    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("devices", sa.Integer(), nullable=False),
        sa.Column("device_kind", sa.String(length=8), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )


def downgrade() -> None:
    op.drop_table("workers")
    op.drop_table("model_version_projects")
    op.drop_index("ix_audit_log_project_id", table_name="audit_log")
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_column("project_id")
    op.drop_index("ix_fine_tuning_jobs_project_id_status", table_name="fine_tuning_jobs")
    op.drop_index("ix_fine_tuning_jobs_project_id_created_at_id", table_name="fine_tuning_jobs")
    op.drop_index("ix_files_project_id_created_at_id", table_name="files")
    for table in reversed(OWNED_TABLES):
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(op.f(f"fk_{table}_project_id_projects"), type_="foreignkey")
            batch.drop_column("project_id")
    op.drop_table("projects")
