"""Fine-tuning jobs: creation and the user's controls (cancel, pause, resume), and the worker's side of the queue.

The worker's side is built on leases. A claim moves a queued job to `running` and gives it a fresh random
`lease_token` and an expiry; the worker renews the expiry with heartbeats. Every write a worker makes (heartbeat,
event, checkpoint, final state) is an UPDATE guarded by `id = :job AND lease_token = :token AND status = 'running'`
in the same transaction, so once a lease has been taken away (the job re-queued after its worker went silent) the
old worker cannot change anything: a job never has two effective runners and registers its result exactly once.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, delete, exists, func, select, tuple_, update
from sqlalchemy.orm import Session

from server.db.base import utcnow
from server.db.models import Checkpoint, File, FineTuningJob, JobEvent, JobStatus, ModelVersion, new_id
from server.db.session import matched_rows
from server.errors import Conflict, InvalidRequest, NotFound
from server.services import registry
from server.services.access import Principal, Scope
from server.services.model_resolution import find_version, fine_tuned_model_name
from server.services.quotas import check_jobs

# The hyperparameters OpenAI's job object shows; "auto" until a run has chosen them.
OPENAI_HYPERPARAMETERS = ("batch_size", "learning_rate_multiplier", "n_epochs")
FINISHED_STATUSES = (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class LeaseLost(Exception):
    """The job is no longer this worker's: it was re-queued, cancelled or finished by someone else."""


# --- creation and the user's controls -------------------------------------------------------------------------------


def usable_file(session: Session, scope: Scope, file_id: str, param: str) -> File:
    file = scope.get(session, File, file_id)
    if file is None or file.deleted_at is not None:
        raise InvalidRequest(f"No such File object: {file_id}", param=param, code="file_not_found")
    if file.purpose != "fine-tune":
        raise InvalidRequest(
            f"File {file_id} has purpose {file.purpose!r}; fine-tuning needs purpose 'fine-tune'.",
            param=param,
            code="invalid_file_purpose",
        )
    return file


def trainable_base(
    session: Session, scope: Scope, *, model: str, training_file: str, validation_file: str | None
) -> ModelVersion:
    """The base model version a job on `model` trains, once its files are usable fine-tuning files (all within
    `scope`); 4xx naming the field otherwise."""
    usable_file(session, scope, training_file, "training_file")
    if validation_file is not None:
        usable_file(session, scope, validation_file, "validation_file")
    base = find_version(session, scope, model)
    if base.kind != "full":
        raise InvalidRequest(
            f"'{model}' is a LoRA adapter ({base.id}); fine-tune its base or a merged full version instead.",
            param="model",
            code="model_not_trainable",
        )
    return base


def create_job(
    session: Session,
    owner: Principal,
    *,
    model: str,
    training_file: str,
    validation_file: str | None,
    method: dict[str, Any],
    suffix: str | None,
    seed: int | None,
    metadata: dict[str, str] | None,
    devices: int = 1,
    max_jobs: int = 0,
) -> FineTuningJob:
    """Check the files and the base model (as `owner` sees them), then store the job in `owner`'s project in
    `validating_files`: a worker validates its files against the base model (`finish_validation`) and queues it.
    The project may hold `max_jobs` unfinished jobs (0: any number). Commits."""
    base = trainable_base(
        session, owner.scope, model=model, training_file=training_file, validation_file=validation_file
    )
    check_jobs(session, owner.project_id, max_jobs)
    job = FineTuningJob(
        id=new_id("ftjob-"),
        project_id=owner.project_id,
        model=model,
        base_version_id=base.id,
        training_file_id=training_file,
        validation_file_id=validation_file,
        status=JobStatus.validating_files,
        suffix=suffix,
        seed=seed if seed is not None else secrets.randbelow(2**31),
        method=method,
        user_metadata=metadata,
        created_by=owner.key_id,
        devices=devices,
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, f"Created fine-tuning job {job.id} on {base.name} v{base.version} ({base.id}).")
    add_event(session, job.id, "Validating the training and validation files.")
    session.commit()
    return job


def jobs_to_validate(session: Session, *, limit: int = 10) -> list[str]:
    """The oldest jobs waiting in `validating_files`."""
    query = (
        select(FineTuningJob.id)
        .where(FineTuningJob.status == JobStatus.validating_files)
        .order_by(FineTuningJob.created_at, FineTuningJob.id)
        .limit(limit)
    )
    return list(session.scalars(query))


def finish_validation(session: Session, job_id: str, error: dict[str, Any] | None) -> bool:
    """Queue a job whose files passed validation, or fail it with `error` (naming the file and its lines). Commits.

    A guarded UPDATE: False when the job left `validating_files` meanwhile (cancelled, or another worker finished
    validating it first), and then nothing changes.
    """
    status = JobStatus.failed if error is not None else JobStatus.queued
    moved = session.execute(
        update(FineTuningJob)
        .where(FineTuningJob.id == job_id, FineTuningJob.status == JobStatus.validating_files)
        .values(status=status, error=_public_error(error), finished_at=utcnow() if error is not None else None)
        .execution_options(synchronize_session=False)
    )
    if matched_rows(moved) != 1:
        session.rollback()
        return False
    if error is None:
        add_event(session, job_id, "Files validated; job queued.")
    else:
        add_event(session, job_id, f"File validation failed: {error['message']}", level="error")
    session.commit()
    return True


def get_job(session: Session, scope: Scope, job_id: str) -> FineTuningJob:
    job = scope.get(session, FineTuningJob, job_id)
    if job is None:
        raise NotFound(f"No such fine-tuning job: {job_id}", param="fine_tuning_job_id", code="job_not_found")
    return job


def list_jobs(
    session: Session, scope: Scope, *, after: str | None, limit: int, metadata: dict[str, str] | None = None
) -> tuple[list[FineTuningJob], bool]:
    """A page of the scope's jobs, newest first, and whether more follow; OpenAI-style: `after` is the last job id of
    the previous page, `metadata` keeps jobs with all of these key-value pairs. Filtered and cut in the query."""
    columns = (FineTuningJob.created_at, FineTuningJob.id)
    query = select(FineTuningJob).order_by(*(column.desc() for column in columns)).limit(limit + 1)
    query = scope.owned(query, FineTuningJob.project_id)
    if after is not None:
        cursor = scope.get(session, FineTuningJob, after)
        if cursor is None:
            raise InvalidRequest(f"No such fine-tuning job for 'after': {after}", param="after")
        query = query.where(tuple_(*columns) < (cursor.created_at, cursor.id))
    for key, value in (metadata or {}).items():
        query = query.where(_has_metadata(session.get_bind().dialect.name, key, value))
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def _has_metadata(dialect: str, key: str, value: str) -> ColumnElement[bool]:
    """`metadata[key] == value`, for any key: PostgreSQL's `->>` takes the key as a parameter; SQLite's JSON paths
    cannot name a key with a double quote, so there the object's entries are searched."""
    if dialect == "postgresql":
        matches: ColumnElement[bool] = FineTuningJob.user_metadata[key].as_string() == value
        return matches
    entries = func.json_each(FineTuningJob.user_metadata).table_valued("key", "value")
    return exists().where(entries.c.key == key, entries.c.value == value)


def _refuse(job: FineTuningJob, action: str) -> Conflict:
    return Conflict(f"Cannot {action} job {job.id}: it is {job.status}.", code=f"job_not_{action}able")


def cancel_job(session: Session, job: FineTuningJob) -> FineTuningJob:
    """Queued or paused jobs stop at once; a running one at the worker's next step."""
    if job.status in (JobStatus.validating_files, JobStatus.queued, JobStatus.paused):
        job.status = JobStatus.cancelled
        job.finished_at = utcnow()
        job.requested_action = None
        add_event(session, job.id, "Job cancelled.")
    elif job.status == JobStatus.running and job.requested_action != "cancel":
        job.requested_action = "cancel"
        add_event(session, job.id, "Cancellation requested; the worker stops at its next step.")
    else:
        raise Conflict(f"Cannot cancel job {job.id}: it is {job.status}.", code="job_not_cancellable")
    session.commit()
    return job


def pause_job(session: Session, job: FineTuningJob) -> FineTuningJob:
    """A queued job is held at once; a running one checkpoints and stops at the worker's next step."""
    if job.status == JobStatus.queued:
        job.status = JobStatus.paused
        add_event(session, job.id, "Job paused.")
    elif job.status == JobStatus.running and job.requested_action is None:
        job.requested_action = "pause"
        add_event(session, job.id, "Pause requested; the worker checkpoints and stops at its next step.")
    else:
        raise _refuse(job, "paus")
    session.commit()
    return job


def resume_job(session: Session, job: FineTuningJob) -> FineTuningJob:
    if job.status != JobStatus.paused:
        raise _refuse(job, "resum")
    job.status = JobStatus.queued
    job.requested_action = None
    add_event(session, job.id, "Job resumed; queued to continue from its last checkpoint.")
    session.commit()
    return job


def list_events(session: Session, job: FineTuningJob, *, after: int | None, limit: int) -> tuple[list[JobEvent], bool]:
    """Newest first; `after` is the id of the last event of the previous page."""
    query = select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id.desc()).limit(limit + 1)
    if after is not None:
        query = query.where(JobEvent.id < after)
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def list_checkpoints(
    session: Session, job: FineTuningJob, *, after: str | None, limit: int
) -> tuple[list[Checkpoint], bool]:
    """Newest (highest step) first; `after` is the last checkpoint id of the previous page."""
    query = select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step.desc()).limit(limit + 1)
    if after is not None:
        cursor = session.get(Checkpoint, after)
        if cursor is None or cursor.job_id != job.id:
            raise InvalidRequest(f"No such checkpoint for 'after': {after}", param="after")
        query = query.where(Checkpoint.step < cursor.step)
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def latest_checkpoint(session: Session, job_id: str) -> Checkpoint | None:
    query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()).limit(1)
    return session.scalars(query).first()


# A job's events and error are shown to every key of its project: they name no host path and no process id.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])(?:/[\w.@+~-]+)+/?")
_PROCESS_ID = re.compile(r"\b(process|pid)(\s*[=:#]?\s*)\d+\b", re.IGNORECASE)
_PROCESS_ID_KEYS = frozenset({"pid", "worker_pid"})


def public_text(text: str) -> str:
    """`text` without host paths (each cut to its last part: "checkpoint-20") and process ids."""
    text = _ABSOLUTE_PATH.sub(lambda match: match.group().rstrip("/").rsplit("/", 1)[-1], text)
    return _PROCESS_ID.sub(lambda match: match.group(1), text)


def _public_data(value: Any) -> Any:
    if isinstance(value, str):
        return public_text(value)
    if isinstance(value, dict):
        return {key: _public_data(item) for key, item in value.items() if key not in _PROCESS_ID_KEYS}
    if isinstance(value, list):
        return [_public_data(item) for item in value]
    return value


def _public_error(error: dict[str, Any] | None) -> dict[str, Any] | None:
    if error is None or not isinstance(error.get("message"), str):
        return error
    return {**error, "message": public_text(error["message"])}


def add_event(
    session: Session,
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type_: str = "message",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    """Add an event to the job, its message and data without host paths and process ids."""
    event = JobEvent(job_id=job_id, message=public_text(message), level=level, type=type_, data=_public_data(data))
    session.add(event)
    return event


# --- the worker's side: claims and leases ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    job_id: str
    token: str
    worker_id: str
    attempt: int


def claim_next_job(
    session: Session, *, worker_id: str, lease_seconds: float, max_devices: int | None = None
) -> Lease | None:
    """Atomically take the oldest queued job (of those on at most `max_devices` devices), or None. Commits.

    PostgreSQL: the candidate row is locked with FOR UPDATE SKIP LOCKED, so concurrent workers pick different jobs
    without waiting. SQLite: one UPDATE whose WHERE re-checks `status = 'queued'`; SQLite runs writes one at a
    time, so exactly one claimant's UPDATE matches.
    """
    now = utcnow()
    token = secrets.token_hex(16)
    oldest_queued = (
        select(FineTuningJob.id)
        .where(FineTuningJob.status == JobStatus.queued)
        .order_by(FineTuningJob.created_at, FineTuningJob.id)
        .limit(1)
    )
    if max_devices is not None:
        oldest_queued = oldest_queued.where(FineTuningJob.devices <= max_devices)
    if session.get_bind().dialect.name == "postgresql":
        job_id = session.scalar(oldest_queued.with_for_update(skip_locked=True))
        if job_id is None:
            session.rollback()
            return None
        target = FineTuningJob.id == job_id
    else:
        target = FineTuningJob.id == oldest_queued.scalar_subquery()
    claimed = session.execute(
        update(FineTuningJob)
        .where(target, FineTuningJob.status == JobStatus.queued)
        .values(
            status=JobStatus.running,
            worker_id=worker_id,
            lease_token=token,
            heartbeat_at=now,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
            attempts=FineTuningJob.attempts + 1,
            started_at=now,
            estimated_finish=None,
        )
        .returning(FineTuningJob.id, FineTuningJob.attempts)
        .execution_options(synchronize_session=False)
    ).first()
    if claimed is None:
        session.rollback()
        return None
    lease = Lease(job_id=claimed.id, token=token, worker_id=worker_id, attempt=claimed.attempts)
    add_event(session, lease.job_id, f"A worker started the job (attempt {lease.attempt}).")
    session.commit()
    return lease


def _guard(session: Session, lease: Lease, lease_seconds: float | None = None) -> str | None:
    """Check (and optionally extend) the lease inside the caller's transaction; returns the requested action.

    The UPDATE takes the row's write lock, so a concurrent re-queue either happens before (and this raises) or
    waits for this transaction.
    """
    values: dict[str, Any] = {"heartbeat_at": utcnow()}
    if lease_seconds is not None:
        values["lease_expires_at"] = values["heartbeat_at"] + timedelta(seconds=lease_seconds)
    row = session.execute(
        update(FineTuningJob)
        .where(
            FineTuningJob.id == lease.job_id,
            FineTuningJob.lease_token == lease.token,
            FineTuningJob.status == JobStatus.running,
        )
        .values(**values)
        .returning(FineTuningJob.requested_action)
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:
        session.rollback()
        raise LeaseLost(f"worker {lease.worker_id} no longer holds job {lease.job_id}")
    action: str | None = row.requested_action
    return action


def heartbeat(session: Session, lease: Lease, *, lease_seconds: float) -> str | None:
    """Extend the lease; returns the user's pending request ('cancel', 'pause' or None). Commits."""
    action = _guard(session, lease, lease_seconds)
    session.commit()
    return action


def record_event(
    session: Session,
    lease: Lease,
    message: str,
    *,
    level: str = "info",
    type_: str = "message",
    data: dict[str, Any] | None = None,
    estimated_finish: datetime | None = None,
) -> None:
    """Add an event to the running job; with `estimated_finish`, also move the job's estimated finish. Commits."""
    _guard(session, lease)
    add_event(session, lease.job_id, message, level=level, type_=type_, data=data)
    if estimated_finish is not None:
        session.execute(
            update(FineTuningJob)
            .where(FineTuningJob.id == lease.job_id)
            .values(estimated_finish=estimated_finish)
            .execution_options(synchronize_session=False)
        )
    session.commit()


def record_chosen_hyperparameters(session: Session, lease: Lease, chosen: dict[str, Any]) -> None:
    """Write the values a run chose for OpenAI's hyperparameters left on "auto" into the job's `method`, as OpenAI
    shows them once a job starts; later attempts then read the same numbers. Values the user gave stay. Commits."""
    _guard(session, lease)
    job = session.get_one(FineTuningJob, lease.job_id)  # `_guard` found it
    method = dict(job.method or {})
    kind = method.get("type", "supervised")
    block = dict(method.get(kind) or {})
    hyperparameters = dict(block.get("hyperparameters") or {})
    for key in OPENAI_HYPERPARAMETERS:
        if hyperparameters.get(key, "auto") == "auto" and key in chosen:
            hyperparameters[key] = chosen[key]
    block["hyperparameters"] = hyperparameters
    job.method = {**method, "type": kind, kind: block}
    session.commit()


def record_checkpoint(
    session: Session, lease: Lease, *, step: int, path: str, metrics: dict[str, Any] | None
) -> Checkpoint:
    """One row per (job, step): a resumed run that saves the same step again replaces the row's path."""
    _guard(session, lease)
    checkpoint = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == lease.job_id, Checkpoint.step == step)
    ).first()
    if checkpoint is None:
        checkpoint = Checkpoint(id=new_id("ftckpt-"), job_id=lease.job_id, step=step)
        session.add(checkpoint)
    checkpoint.path = path
    checkpoint.metrics = metrics
    checkpoint.created_at = utcnow()
    add_event(session, lease.job_id, f"Checkpoint saved at step {step}.", data={"step": step, **(metrics or {})})
    session.commit()
    return checkpoint


def delete_checkpoint(session: Session, lease: Lease, *, step: int, path: str) -> bool:
    """The trainer's rotation removed the checkpoint directory `path` of `step`: drop its row, so the API never lists
    a checkpoint that is gone. Only a row that names that directory goes (a row for the same step written by another
    attempt points at a directory that still exists). Commits; True when a row was deleted."""
    _guard(session, lease)
    deleted = matched_rows(
        session.execute(
            delete(Checkpoint)
            .where(Checkpoint.job_id == lease.job_id, Checkpoint.step == step, Checkpoint.path == path)
            .execution_options(synchronize_session=False)
        )
    )
    add_event(session, lease.job_id, f"Checkpoint at step {step} deleted (rotation).", data={"step": step})
    session.commit()
    return deleted == 1


def _end_lease(job: FineTuningJob, status: JobStatus) -> None:
    job.status = status
    job.worker_id = None
    job.lease_token = None
    job.lease_expires_at = None
    job.requested_action = None
    job.estimated_finish = None
    if status in FINISHED_STATUSES:
        job.finished_at = utcnow()


def finish_succeeded(
    session: Session,
    lease: Lease,
    *,
    output_dir: str,
    metrics: dict[str, Any] | None,
    trained_tokens: int | None,
) -> ModelVersion:
    """Mark the job succeeded and register its result as a model version, in one transaction. Commits."""
    _guard(session, lease)
    job = session.get_one(FineTuningJob, lease.job_id)  # `_guard` found it
    base = registry.get_version(session, job.base_version_id)
    name = fine_tuned_model_name(job, base)
    version = registry.register_version(
        session,
        name=name,
        path=Path(output_dir),
        base_version_id=base.id,
        job_id=job.id,
        metrics=metrics,
        projects=[job.project_id],
        lineage={
            "job_id": job.id,
            "base_version_id": base.id,
            "training_file": job.training_file_id,
            "validation_file": job.validation_file_id,
            "method": job.method,
            "seed": job.seed,
        },
        created_by=job.created_by,
    )
    job.fine_tuned_model = name
    job.result_model_version_id = version.id
    job.trained_tokens = trained_tokens
    _end_lease(job, JobStatus.succeeded)
    add_event(session, job.id, f"Job succeeded: registered {name} as model version {version.id}.")
    session.commit()
    return version


def finish_stopped(
    session: Session, lease: Lease, status: JobStatus, message: str, *, error: dict[str, Any] | None = None
) -> None:
    """End a run that did not succeed: cancelled, paused, failed, or queued again (worker shutting down). Commits."""
    _guard(session, lease)
    job = session.get_one(FineTuningJob, lease.job_id)  # `_guard` found it
    _end_lease(job, status)
    job.error = _public_error(error)
    add_event(session, job.id, message, level="error" if status == JobStatus.failed else "info")
    session.commit()


def end_lost_attempt(session: Session, lease: Lease, reason: str, *, max_attempts: int) -> JobStatus:
    """The attempt's training process died without a result (`reason`: its exit code or signal): re-queue the job to
    resume from its last checkpoint, or fail it after `max_attempts` lost attempts, counted with the lost leases of
    `requeue_expired`. A pending cancel or pause is honoured instead. Commits; returns the job's new status."""
    action = _guard(session, lease)
    job = session.get_one(FineTuningJob, lease.job_id)  # `_guard` found it
    lost = job.lease_expirations + 1
    job.lease_expirations = lost
    error = None
    if action == "cancel":
        status, level, message = JobStatus.cancelled, "warn", f"{reason}; the requested cancellation is done."
    elif action == "pause":
        status, level, message = JobStatus.paused, "warn", f"{reason}; the job is paused as requested."
    elif lost >= max_attempts:
        status, level = JobStatus.failed, "error"
        message = f"{reason}. Gave up after {lost} lost attempts."
        error = {"code": "training_process_died", "message": message, "param": None}
    else:
        status, level = JobStatus.queued, "warn"
        message = (
            f"{reason}; re-queued to resume from the last checkpoint (lost {lost} of at most {max_attempts} times)."
        )
    _end_lease(job, status)
    job.error = _public_error(error)
    add_event(session, job.id, message, level=level, data={"lost_attempts": lost})
    session.commit()
    return status


def requeue_expired(session: Session, *, max_attempts: int) -> list[str]:
    """Take jobs back from workers that stopped heartbeating; re-queue them, or fail them after `max_attempts`
    lost leases. A pending cancel or pause is honoured instead of re-queueing. Commits; returns the job ids.

    Each take-back is an UPDATE guarded by the expired lease's token, so two workers reaping at once (or a reaper
    racing a fresh claim) change a job at most once.
    """
    now = utcnow()
    expired = (
        select(FineTuningJob)
        .where(FineTuningJob.status == JobStatus.running, FineTuningJob.lease_expires_at < now)
        .order_by(FineTuningJob.lease_expires_at)
    )
    if session.get_bind().dialect.name == "postgresql":
        expired = expired.with_for_update(skip_locked=True)
    handled = []
    for job in session.scalars(expired).all():
        lost = job.lease_expirations + 1
        if job.requested_action == "cancel":
            status, level = JobStatus.cancelled, "warn"
            message = "The worker stopped responding; the requested cancellation is done."
        elif job.requested_action == "pause":
            status, level = JobStatus.paused, "warn"
            message = "The worker stopped responding; the job is paused as requested."
        elif lost >= max_attempts:
            status, level = JobStatus.failed, "error"
            message = f"Gave up after {lost} attempts: the worker stopped responding each time."
        else:
            status, level = JobStatus.queued, "warn"
            message = (
                "The worker stopped responding (lease expired); re-queued to resume from the last "
                f"checkpoint (lost {lost} of at most {max_attempts} times)."
            )
        error = {"code": "worker_lost", "message": message, "param": None} if status == JobStatus.failed else None
        taken = session.execute(
            update(FineTuningJob)
            .where(
                FineTuningJob.id == job.id,
                FineTuningJob.lease_token == job.lease_token,
                FineTuningJob.status == JobStatus.running,
            )
            .values(
                status=status,
                lease_expirations=lost,
                worker_id=None,
                lease_token=None,
                lease_expires_at=None,
                requested_action=None,
                estimated_finish=None,
                finished_at=now if status in FINISHED_STATUSES else None,
                error=error,
            )
            .execution_options(synchronize_session=False)
        )
        if matched_rows(taken) == 1:
            add_event(session, job.id, message, level=level)
            handled.append(job.id)
    session.commit()
    return handled
