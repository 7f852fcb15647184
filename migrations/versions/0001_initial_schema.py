"""Initial schema: keys, files, fine-tuning jobs, events, checkpoints, model versions, aliases, audit, inference.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 06:13:49.164483
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("prefix", sa.String(length=32), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=40), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["created_by"], ["api_keys.id"], name=op.f("fk_api_keys_created_by_api_keys")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor_key_id", sa.String(length=40), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("method", sa.String(length=8), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("client_address", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index("ix_audit_log_action", "audit_log", ["action"], unique=False)
    op.create_index("ix_audit_log_actor_key_id", "audit_log", ["actor_key_id"], unique=False)
    op.create_index("ix_audit_log_created_at", "audit_log", ["created_at"], unique=False)

    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_details", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=40), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["created_by"], ["api_keys.id"], name=op.f("fk_files_created_by_api_keys")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
    )
    op.create_index("ix_files_created_at_id", "files", ["created_at", "id"], unique=False)

    op.create_table(
        "fine_tuning_jobs",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("training_file_id", sa.String(length=40), nullable=False),
        sa.Column("validation_file_id", sa.String(length=40), nullable=True),
        sa.Column("status", sa.String(length=24), nullable=False),
        sa.Column("suffix", sa.String(length=64), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("method", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("fine_tuned_model", sa.String(length=256), nullable=True),
        sa.Column("result_model_version_id", sa.String(length=40), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("trained_tokens", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=40), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("worker_id", sa.String(length=128), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("requested_action", sa.String(length=16), nullable=True),
        sa.ForeignKeyConstraint(["created_by"], ["api_keys.id"], name=op.f("fk_fine_tuning_jobs_created_by_api_keys")),
        sa.ForeignKeyConstraint(
            ["training_file_id"], ["files.id"], name=op.f("fk_fine_tuning_jobs_training_file_id_files")
        ),
        sa.ForeignKeyConstraint(
            ["validation_file_id"], ["files.id"], name=op.f("fk_fine_tuning_jobs_validation_file_id_files")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fine_tuning_jobs")),
        sa.UniqueConstraint("fine_tuned_model", name=op.f("uq_fine_tuning_jobs_fine_tuned_model")),
    )
    op.create_index("ix_fine_tuning_jobs_status_created_at", "fine_tuning_jobs", ["status", "created_at"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["fine_tuning_jobs.id"], name=op.f("fk_checkpoints_job_id_fine_tuning_jobs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_checkpoints_job_id_step")),
    )
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("level", sa.String(length=8), nullable=False),
        sa.Column("type", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["fine_tuning_jobs.id"], name=op.f("fk_job_events_job_id_fine_tuning_jobs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_events")),
    )
    op.create_index("ix_job_events_job_id_id", "job_events", ["job_id", "id"], unique=False)

    op.create_table(
        "model_versions",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("base_version_id", sa.String(length=40), nullable=True),
        sa.Column("job_id", sa.String(length=40), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("lineage", sa.JSON(), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=40), nullable=True),
        sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["base_version_id"], ["model_versions.id"], name=op.f("fk_model_versions_base_version_id_model_versions")
        ),
        sa.ForeignKeyConstraint(["created_by"], ["api_keys.id"], name=op.f("fk_model_versions_created_by_api_keys")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["fine_tuning_jobs.id"], name=op.f("fk_model_versions_job_id_fine_tuning_jobs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_versions")),
        sa.UniqueConstraint("name", "version", name=op.f("uq_model_versions_name_version")),
    )
    op.create_table(
        "alias_history",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_name", sa.String(length=200), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("from_version_id", sa.String(length=40), nullable=True),
        sa.Column("to_version_id", sa.String(length=40), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("actor_key_id", sa.String(length=40), nullable=True),
        sa.Column("approved_by_key_id", sa.String(length=40), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["actor_key_id"], ["api_keys.id"], name=op.f("fk_alias_history_actor_key_id_api_keys")),
        sa.ForeignKeyConstraint(
            ["approved_by_key_id"], ["api_keys.id"], name=op.f("fk_alias_history_approved_by_key_id_api_keys")
        ),
        sa.ForeignKeyConstraint(
            ["from_version_id"], ["model_versions.id"], name=op.f("fk_alias_history_from_version_id_model_versions")
        ),
        sa.ForeignKeyConstraint(
            ["to_version_id"], ["model_versions.id"], name=op.f("fk_alias_history_to_version_id_model_versions")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alias_history")),
    )
    op.create_index("ix_alias_history_model_name_alias", "alias_history", ["model_name", "alias"], unique=False)

    op.create_table(
        "inference_records",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("api_key_id", sa.String(length=40), nullable=True),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("requested_model", sa.String(length=256), nullable=False),
        sa.Column("model_version_id", sa.String(length=40), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("latency_ms", sa.Double(), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"], name=op.f("fk_inference_records_api_key_id_api_keys")),
        sa.ForeignKeyConstraint(
            ["model_version_id"],
            ["model_versions.id"],
            name=op.f("fk_inference_records_model_version_id_model_versions"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_inference_records")),
    )
    op.create_index("ix_inference_records_created_at", "inference_records", ["created_at"], unique=False)

    op.create_table(
        "model_aliases",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_name", sa.String(length=200), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("version_id", sa.String(length=40), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=40), nullable=True),
        sa.ForeignKeyConstraint(["updated_by"], ["api_keys.id"], name=op.f("fk_model_aliases_updated_by_api_keys")),
        sa.ForeignKeyConstraint(
            ["version_id"], ["model_versions.id"], name=op.f("fk_model_aliases_version_id_model_versions")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_model_aliases")),
        sa.UniqueConstraint("model_name", "alias", name=op.f("uq_model_aliases_model_name_alias")),
    )


def downgrade() -> None:
    op.drop_table("model_aliases")
    op.drop_index("ix_inference_records_created_at", table_name="inference_records")

    op.drop_table("inference_records")
    op.drop_index("ix_alias_history_model_name_alias", table_name="alias_history")

    op.drop_table("alias_history")
    op.drop_table("model_versions")
    op.drop_index("ix_job_events_job_id_id", table_name="job_events")

    op.drop_table("job_events")
    op.drop_table("checkpoints")
    op.drop_index("ix_fine_tuning_jobs_status_created_at", table_name="fine_tuning_jobs")

    op.drop_table("fine_tuning_jobs")
    op.drop_index("ix_files_created_at_id", table_name="files")

    op.drop_table("files")
    op.drop_index("ix_audit_log_created_at", table_name="audit_log")
    op.drop_index("ix_audit_log_actor_key_id", table_name="audit_log")
    op.drop_index("ix_audit_log_action", table_name="audit_log")

    op.drop_table("audit_log")
    op.drop_table("api_keys")
