"""The tables. Public objects use string ids with OpenAI-style prefixes; append-only logs use integer ids.

Changing a model means adding an Alembic revision in `migrations/versions/` (a test checks that they agree).
"""

from __future__ import annotations

import enum
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from server.db.base import Base, utcnow


def new_id(prefix: str) -> str:
    """An opaque public id such as `file-3f9a...` (24 random hex characters: unguessable, collision-free)."""
    return f"{prefix}{secrets.token_hex(12)}"


class Role(enum.StrEnum):
    analyst = "analyst"
    data = "data"
    admin = "admin"

    @property
    def rank(self) -> int:
        return list(Role).index(self)

    def allows(self, required: Role) -> bool:
        """Roles are nested: admin can do everything data can, data everything analyst can."""
        return self.rank >= required.rank


class JobStatus(enum.StrEnum):
    validating_files = "validating_files"
    queued = "queued"
    running = "running"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


# A job in one of these states still needs its files.
ACTIVE_JOB_STATUSES = (JobStatus.validating_files, JobStatus.queued, JobStatus.running, JobStatus.paused)

# The project every install starts with (made by the migration that introduced projects): where keys go unless told.
DEFAULT_PROJECT_ID = "proj_default"
DEFAULT_PROJECT_NAME = "default"


class Project(Base):
    """A team's space, as OpenAI's projects: every key belongs to one, and the files, jobs, model versions and
    inference records a key creates belong to its project. Keys other than admin keys see their project's only."""

    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("proj_"))
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key_"))
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(16))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    # The first characters of the secret, unique: finds the row without ever storing the secret.
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    # sha256 of the full secret (hex). The secret has 256 bits of entropy, so a fast hash is enough.
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class File(Base):
    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_created_at_id", "created_at", "id"),
        Index("ix_files_project_id_created_at_id", "project_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="processed")
    status_details: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    # Deleted files keep their row (hash, name, size) so model lineage stays readable; the content is removed.
    deleted_at: Mapped[datetime | None]


class FineTuningJob(Base):
    __tablename__ = "fine_tuning_jobs"
    __table_args__ = (
        Index("ix_fine_tuning_jobs_status_created_at", "status", "created_at"),
        # Listing, newest first, a page at a time (`server.services.jobs.list_jobs`), over all projects or one.
        Index("ix_fine_tuning_jobs_created_at_id", "created_at", "id"),
        Index("ix_fine_tuning_jobs_project_id_created_at_id", "project_id", "created_at", "id"),
        # A project's unfinished jobs, counted against its quota.
        Index("ix_fine_tuning_jobs_project_id_status", "project_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ftjob-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    model: Mapped[str] = mapped_column(String(256))
    training_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    validation_file_id: Mapped[str | None] = mapped_column(ForeignKey("files.id"))
    status: Mapped[str] = mapped_column(String(24), default=JobStatus.validating_files)
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int | None] = mapped_column(BigInteger)
    # The request's `method` object as given (type, hyperparameters, adapter and LoRA settings).
    method: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # `metadata` is reserved by SQLAlchemy's declarative API, hence the attribute name.
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(256), unique=True)
    result_model_version_id: Mapped[str | None] = mapped_column(String(40))
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # While running: when training should end at the pace of its steps so far (updated each step); else null.
    estimated_finish: Mapped[datetime | None]
    # Worker lease: a job whose lease runs out without a heartbeat is re-queued (attempts counts the claims).
    worker_id: Mapped[str | None] = mapped_column(String(128))
    heartbeat_at: Mapped[datetime | None]
    lease_expires_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Processes an attempt trains with (`torchrun --nproc-per-node`): one per GPU, or gloo processes on a CPU host.
    devices: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # A fresh random token per claim. Every write a worker makes checks it, so a worker that lost its lease (the job
    # was re-queued after it stopped heartbeating) can no longer change the job: one runner at a time.
    lease_token: Mapped[str | None] = mapped_column(String(64))
    # How often an attempt was lost: its worker stopped heartbeating (crash, kill -9, lost machine) or its training
    # process died (out-of-memory kill, signal, crash); the job fails after the worker's maximum.
    lease_expirations: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The base model version, pinned when the job is created (an alias may move while the job waits). No foreign
    # key, like `result_model_version_id`: model_versions already points here, and a cycle would order nothing.
    base_version_id: Mapped[str | None] = mapped_column(String(40))
    # Cancel/pause are requests the worker honours at its next step.
    requested_action: Mapped[str | None] = mapped_column(String(16))


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("fine_tuning_jobs.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    level: Mapped[str] = mapped_column(String(8), default="info")
    type: Mapped[str] = mapped_column(String(16), default="message")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ftckpt-"))
    job_id: Mapped[str] = mapped_column(ForeignKey("fine_tuning_jobs.id"))
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ModelVersion(Base):
    __tablename__ = "model_versions"
    # A job registers its result at most once.
    __table_args__ = (UniqueConstraint("name", "version"), UniqueConstraint("job_id"))

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("mv-"))
    name: Mapped[str] = mapped_column(String(200))
    version: Mapped[int] = mapped_column(Integer)
    # `full` (a checkpoint from_pretrained reads) or `adapter` (a PEFT adapter on top of `base_version_id`).
    kind: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(Text)
    base_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("fine_tuning_jobs.id"))
    status: Mapped[str] = mapped_column(String(16), default="active")
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The task evaluation of its job's validation file (`finetune.evaluate`): exact match, accuracy per field.
    evaluation: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Hyperparameters, dataset file ids and hashes: whatever the version was made from.
    lineage: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    description: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    archived_at: Mapped[datetime | None]
    # The projects that may use this version; none: every project. A job's result is its job's project's.
    allowed_projects: Mapped[list[ModelVersionProject]] = relationship(cascade="all, delete-orphan")


class ModelVersionProject(Base):
    """A project allowed to use a model version (see `ModelVersion.allowed_projects`)."""

    __tablename__ = "model_version_projects"

    version_id: Mapped[str] = mapped_column(ForeignKey("model_versions.id"), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"), primary_key=True)


class ModelAlias(Base):
    __tablename__ = "model_aliases"
    __table_args__ = (UniqueConstraint("model_name", "alias"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_name: Mapped[str] = mapped_column(String(200))
    alias: Mapped[str] = mapped_column(String(64))
    version_id: Mapped[str] = mapped_column(ForeignKey("model_versions.id"))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_by: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))


class AliasHistory(Base):
    """Immutable record of every alias move: who, when, why, and who approved it."""

    __tablename__ = "alias_history"
    # Each alias's moves are numbered 1, 2, ...: of two concurrent moves from one holder only one can commit.
    __table_args__ = (
        Index("ix_alias_history_model_name_alias", "model_name", "alias"),
        UniqueConstraint("model_name", "alias", "sequence"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_name: Mapped[str] = mapped_column(String(200))
    alias: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(16))
    from_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    to_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    reason: Mapped[str | None] = mapped_column(Text)
    actor_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    approved_by_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Four-eyes moves: the approval request they came from and when it was made (`created_at` is when it applied).
    approval_id: Mapped[str | None] = mapped_column(ForeignKey("alias_approvals.id"))
    requested_at: Mapped[datetime | None]
    # The evaluation gate's inputs for a promotion: both held-out losses and whether `force` was used.
    evaluation: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # This move's number among the alias's moves (1 for its first).
    sequence: Mapped[int] = mapped_column(Integer)


class ApprovalStatus(enum.StrEnum):
    pending = "pending"
    approved = "approved"
    rejected = "rejected"


class AliasApproval(Base):
    """An alias move waiting for a second admin (four-eyes rule). Decided once; the move itself lands in
    `alias_history` with a pointer back here."""

    __tablename__ = "alias_approvals"
    __table_args__ = (Index("ix_alias_approvals_status_created_at", "status", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("aliasreq-"))
    model_name: Mapped[str] = mapped_column(String(200))
    alias: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(16))
    # The holder when requested: approving after the alias moved otherwise is refused (the request is stale).
    from_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    to_version_id: Mapped[str] = mapped_column(ForeignKey("model_versions.id"))
    reason: Mapped[str] = mapped_column(Text)
    force: Mapped[bool] = mapped_column(Boolean, default=False)
    status: Mapped[str] = mapped_column(String(16), default=ApprovalStatus.pending)
    requested_by: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    decided_by: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    decided_at: Mapped[datetime | None]
    decision_reason: Mapped[str | None] = mapped_column(Text)


class AuditLog(Base):
    """Append-only: one row per mutating request, written whatever its outcome."""

    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_created_at", "created_at"),
        Index("ix_audit_log_actor_key_id", "actor_key_id"),
        Index("ix_audit_log_action", "action"),
        Index("ix_audit_log_project_id", "project_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # No foreign key: the log must outlive anything it mentions, and failed logins name no key.
    actor_key_id: Mapped[str | None] = mapped_column(String(40))
    # The actor key's project (none without a key).
    project_id: Mapped[str | None] = mapped_column(String(40))
    action: Mapped[str] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(8))
    path: Mapped[str] = mapped_column(Text)
    target: Mapped[str | None] = mapped_column(String(256))
    status_code: Mapped[int] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(16))
    client_address: Mapped[str | None] = mapped_column(String(64))


class InferenceRecord(Base):
    """One row per inference request, tying it to the key and the model version that answered."""

    __tablename__ = "inference_records"
    __table_args__ = (Index("ix_inference_records_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    endpoint: Mapped[str] = mapped_column(String(64))
    requested_model: Mapped[str] = mapped_column(String(256))
    model_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    latency_ms: Mapped[float | None]
    status_code: Mapped[int] = mapped_column(Integer)


class RegisteredWorker(Base):
    """A fine-tuning worker (`zaya worker`) and the devices one job may train with on its host, as it last said: the
    API refuses a job asking for more devices than any recently seen worker has."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    devices: Mapped[int] = mapped_column(Integer)
    # "gpu" (one process per GPU) or "cpu" (one process per core).
    device_kind: Mapped[str] = mapped_column(String(8))
    seen_at: Mapped[datetime] = mapped_column(default=utcnow)


class ConsoleSessionEnd(Base):
    """A console session signed out before its cookie expired: its cookie is refused from then on. Kept until the
    session's absolute lifetime would have ended it anyway (`expires_at`), then deleted."""

    __tablename__ = "console_session_ends"
    __table_args__ = (Index("ix_console_session_ends_expires_at", "expires_at"),)

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    ended_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


class DatasetReport(Base):
    """A stored file's report (the validator's, for given checks and tokenizer, or the PII scan's), computed once per
    content and reused by the console's dataset page, job estimates and job validation
    (`server.services.dataset_reports`). Kept per project, so one project cannot learn what another uploaded."""

    __tablename__ = "dataset_reports"
    __table_args__ = (UniqueConstraint("project_id", "sha256", "kind", "parameters_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id"))
    sha256: Mapped[str] = mapped_column(String(64))  # of the file's content
    kind: Mapped[str] = mapped_column(String(16))  # "validation" or "pii"
    # sha256 of what else the report depends on (tokenizer, limits, the paired file), as canonical JSON.
    parameters_key: Mapped[str] = mapped_column(String(64))
    report: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
