"""`zaya worker`: claims fine-tuning jobs from the database and runs them with the fine-tuning core.

One job at a time per worker; run several workers (processes or machines) against one PostgreSQL database to run
several jobs. While a job runs, a heartbeat thread extends its lease and picks up the user's cancel or pause. If a
worker dies, its lease runs out and any worker re-queues the job (`requeue_expired`), which then resumes from its
last checkpoint; after `max_attempts` lost leases the job fails with a clear error. Every write a worker makes is
checked against its lease token (see `server.services.jobs`), so a worker presumed dead can no longer touch the job.

Each attempt trains in a child process (`server.jobs.attempt`), so an out-of-memory kill or a crash in training ends
that process, not the worker, and the memory goes back with it. The worker keeps every database write: it records the
events and checkpoints the child reports, passes cancel and pause on to it, and registers its result. A child that
dies without a result (its exit code or signal named in the job's events) costs the job one attempt: it is re-queued
to resume from its last checkpoint, or fails after `max_attempts` lost attempts, as a lost lease does.

What a job does (its files' validation, its run) is `server.services.training`'s. Each attempt trains into its own
directory (`<data dir>/jobs/<job-id>/attempt-<n>/`), so a presumed-dead worker that is in fact still running never
writes into the directory of the attempt that replaced it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from server.db.base import utcnow
from server.db.models import FineTuningJob, JobStatus
from server.errors import APIError
from server.jobs.attempt import AttemptFiles, EventReader, exit_description, write_control
from server.services import jobs, training, workers
from server.settings import Settings
from zaya_model.training.atomic_io import write_json_atomic

if TYPE_CHECKING:
    from finetune.run import FineTuneRun

P = ParamSpec("P")
T = TypeVar("T")

logger = logging.getLogger(__name__)

MAX_ERROR_MESSAGE = 2000


@dataclass(frozen=True)
class WorkerConfig:
    lease_seconds: float = 60.0
    heartbeat_seconds: float = 10.0
    max_attempts: int = 3
    poll_seconds: float = 2.0
    # How long a child asked to stop (the job's lease lost, the worker failing) gets before it is killed.
    stop_grace_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_seconds < self.lease_seconds:
            raise ValueError("heartbeat interval must be positive and shorter than the lease")
        if self.max_attempts < 1 or self.poll_seconds <= 0:
            raise ValueError("max attempts must be at least 1 and the poll interval positive")


class JobRun:
    """The state one claimed job shares between the training thread (hooks) and the heartbeat thread."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        lease: jobs.Lease,
        config: WorkerConfig,
        shutdown: threading.Event,
        announce: Callable[[], None] = lambda: None,
    ) -> None:
        """`announce` is called with each heartbeat: the worker saying it is still there (`Worker.announce`)."""
        self.sessions = sessions
        self.lease = lease
        self.config = config
        self.shutdown = shutdown
        self.announce = announce
        self.requested_action: str | None = None
        self.lost = threading.Event()
        self._stop_heartbeat = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{lease.job_id}", daemon=True)

    def __enter__(self) -> JobRun:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_heartbeat.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop_heartbeat.wait(self.config.heartbeat_seconds):
            try:
                with self.sessions() as session:
                    self.requested_action = jobs.heartbeat(session, self.lease, lease_seconds=self.config.lease_seconds)
                self.announce()
            except jobs.LeaseLost:
                logger.warning("lost the lease on %s; stopping it", self.lease.job_id)
                self.lost.set()
                return
            except Exception:
                # A database hiccup: keep trying until the lease would have run out anyway.
                logger.exception("heartbeat for %s failed", self.lease.job_id)

    def stop_reason(self) -> str | None:
        """What the trainer should do at its next step: None, "cancel" or "pause"."""
        if self.lost.is_set() or self.requested_action == "cancel":
            return "cancel"
        if self.requested_action == "pause" or self.shutdown.is_set():
            return "pause"
        return None

    def write(self, action: Callable[Concatenate[Session, jobs.Lease, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        with self.sessions() as session:
            return action(session, self.lease, *args, **kwargs)


def json_safe(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """NaN and infinities are not JSON (PostgreSQL refuses them): store them as null."""
    if metrics is None:
        return None
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value for key, value in metrics.items()
    }


# Named in a metrics event's message as OpenAI words them ("Step 12/100: training loss=1.2345"): a step's training
# record and its validation record are separate events, and the message says which is which.
METRIC_LABELS = {
    "train_loss": "training loss",
    "valid_loss": "validation loss",
    "valid_mean_token_accuracy": "validation token accuracy",
}


def metrics_message(step: int, total_steps: int | None, metrics: dict[str, Any]) -> str:
    where = f"Step {step}/{total_steps}" if total_steps else f"Step {step}"
    values = [
        f"{label}={metrics[name]:.4f}"
        for name, label in METRIC_LABELS.items()
        if isinstance(metrics.get(name), int | float) and math.isfinite(metrics[name])
    ]
    return f"{where}: {', '.join(values)}" if values else where


class Pace:
    """When training should end, at the pace of this attempt's steps so far (from the trainer's start, so the time
    of the first step, compilation included, counts)."""

    def __init__(self, first_step: int, total_steps: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.first_step, self.total_steps, self.clock = first_step, total_steps, clock
        self.started = clock()

    def estimated_finish(self, step: int) -> datetime | None:
        done = step - self.first_step
        if done <= 0 or not self.total_steps:
            return None
        seconds_per_step = (self.clock() - self.started) / done
        return utcnow() + timedelta(seconds=max(self.total_steps - step, 0) * seconds_per_step)


class JobHooks:
    """What the trainer's hooks report, written as events, metrics and checkpoints under the job's lease, moving the
    job's estimated finish after each training step."""

    def __init__(self, run: JobRun) -> None:
        self.run = run
        self.total_steps: int | None = None  # from the trainer's "training from step ... of ..." event
        self.pace: Pace | None = None

    def on_event(self, level: str, message: str, data: dict[str, Any] | None = None) -> None:
        run = self.run
        if data and "max_steps" in data:
            self.total_steps = data["max_steps"]
            self.pace = Pace(data.get("step") or 0, data["max_steps"])
        run.write(jobs.record_event, message, level=training.LEVELS.get(level, "info"), data=json_safe(data))
        if data and all(key in data for key in jobs.OPENAI_HYPERPARAMETERS):  # the numbers the run chose
            run.write(jobs.record_chosen_hyperparameters, data)

    def on_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        data = json_safe({"step": step, "total_steps": self.total_steps, **metrics})
        message = metrics_message(step, self.total_steps, metrics)
        finish = self.pace.estimated_finish(step) if self.pace and "train_loss" in metrics else None
        self.run.write(jobs.record_event, message, type_="metrics", data=data, estimated_finish=finish)

    def on_checkpoint(self, step: int, path: str, metrics: dict[str, Any] | None) -> None:
        self.run.write(jobs.record_checkpoint, step=step, path=str(path), metrics=json_safe(metrics))

    def on_checkpoint_deleted(self, step: int, path: str) -> None:
        self.run.write(jobs.delete_checkpoint, step=step, path=str(path))


def report(hooks: JobHooks, record: dict[str, Any]) -> None:
    """One line of the attempt's events file (`server.jobs.attempt`) to the matching hook."""
    kind = record["kind"]
    if kind == "event":
        hooks.on_event(record["level"], record["message"], record.get("data"))
    elif kind == "metrics":
        hooks.on_metrics(record["step"], record["metrics"])
    elif kind == "checkpoint":
        hooks.on_checkpoint(record["step"], record["path"], record.get("metrics"))
    elif kind == "checkpoint_deleted":
        hooks.on_checkpoint_deleted(record["step"], record["path"])
    else:
        logger.warning("unknown event from a training process: %r", record)


class AttemptDied(Exception):
    """The attempt's training process ended without a result: killed or crashed."""


class Worker:
    def __init__(
        self, settings: Settings, sessions: sessionmaker[Session], config: WorkerConfig, worker_id: str | None = None
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.config = config
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.shutdown = threading.Event()
        # The processes one job may train with here: its GPUs, else its CPU cores, or fewer if the settings say so.
        detected, self.device_kind = workers.host_devices()
        self.devices = settings.worker_devices or detected
        self._announced_at: float | None = None

    def announce(self) -> None:
        """Tell the API this worker runs and how many devices it has, at most every `workers.REFRESH`."""
        now = time.monotonic()
        if self._announced_at is not None and now - self._announced_at < workers.REFRESH.total_seconds():
            return
        with self.sessions() as session:
            workers.announce(session, self.worker_id, devices=self.devices, device_kind=self.device_kind)
        self._announced_at = now

    def requeue_expired(self) -> list[str]:
        with self.sessions() as session:
            requeued = jobs.requeue_expired(session, max_attempts=self.config.max_attempts)
        for job_id in requeued:
            logger.warning("took back job %s from a worker that stopped heartbeating", job_id)
        return requeued

    def validate_pending(self) -> list[str]:
        """Validate the jobs waiting in `validating_files`: their devices (some worker seen lately must have that
        many) and files; queue them, or fail them naming `devices`, or the file and line."""
        with self.sessions() as session:
            job_ids = jobs.jobs_to_validate(session)
        for job_id in job_ids:
            with self.sessions() as session:
                job = session.get_one(FineTuningJob, job_id)
                problem = workers.devices_problem(session, job.devices)
                error = (
                    {"code": "devices_unavailable", "message": problem, "param": "devices"}
                    if problem is not None
                    else training.file_error(session, self.settings, job)
                )
                if jobs.finish_validation(session, job_id, error) and error is not None:
                    logger.warning("job %s failed file validation: %s", job_id, error["message"])
        return job_ids

    def run_once(self) -> bool:
        """Re-queue abandoned jobs, validate new jobs' files, then claim and run one job; False when there was
        nothing to do."""
        self.announce()
        self.requeue_expired()
        validated = self.validate_pending()
        with self.sessions() as session:
            lease = jobs.claim_next_job(
                session, worker_id=self.worker_id, lease_seconds=self.config.lease_seconds, max_devices=self.devices
            )
        if lease is None:
            return bool(validated)
        logger.info("claimed job %s (attempt %d)", lease.job_id, lease.attempt)
        try:
            self.run_job(lease)
        except jobs.LeaseLost:
            logger.warning("job %s was taken away from this worker; its result is discarded", lease.job_id)
        return True

    def run_forever(self, *, exit_when_idle: bool = False) -> None:
        while not self.shutdown.is_set():
            try:
                busy = self.run_once()
            except Exception:
                logger.exception("worker loop error; retrying")
                busy = False
            if not busy:
                if exit_when_idle:
                    return
                self.shutdown.wait(self.config.poll_seconds)

    def run_job(self, lease: jobs.Lease) -> None:
        with JobRun(self.sessions, lease, self.config, self.shutdown, self.announce) as run:
            try:
                with self.sessions() as session:
                    fine_tune_run, resume_from = training.job_run(session, self.settings, lease.job_id, lease.attempt)
                    devices = session.get_one(FineTuningJob, lease.job_id).devices
                if resume_from is not None:
                    run.write(jobs.record_event, f"Resuming from checkpoint {Path(resume_from).name}.")
                result = self.run_attempt(run, fine_tune_run, resume_from, devices)
            except (jobs.LeaseLost, SQLAlchemyError):
                # The database is away: not the job's fault. The worker loop retries; the lease runs out and an
                # attempt resumes from the last recorded checkpoint.
                raise
            except AttemptDied as died:
                if run.lost.is_set():
                    raise jobs.LeaseLost(str(died)) from died
                logger.error("job %s: %s", lease.job_id, died)
                run.write(jobs.end_lost_attempt, str(died), max_attempts=self.config.max_attempts)
                return
            except Exception as error:
                if run.lost.is_set():
                    raise jobs.LeaseLost(str(error)) from error
                logger.exception("job %s failed", lease.job_id)
                code = "invalid_training_data" if training.is_training_error(error) else "training_error"
                self._fail(run, code, f"{type(error).__name__}: {error}")
                return
            if result["status"] == "error":
                if run.lost.is_set():
                    raise jobs.LeaseLost(result["message"])
                code = "invalid_training_data" if result["training_error"] else "training_error"
                self._fail(run, code, f"{result['error_type']}: {result['message']}")
                return
        self._finish(run, result)

    def _fail(self, run: JobRun, code: str, message: str) -> None:
        message = message[:MAX_ERROR_MESSAGE]
        error = {"code": code, "message": message, "param": None}
        run.write(jobs.finish_stopped, JobStatus.failed, f"Job failed: {message}", error=error)

    def run_attempt(
        self, run: JobRun, fine_tune_run: FineTuneRun, resume_from: str | None, devices: int = 1
    ) -> dict[str, Any]:
        """Train in a child process (`server.jobs.attempt`; with several devices, `torchrun` starting one per device)
        while recording what it reports and passing on stop requests; returns its result file. AttemptDied when it ends
        without one."""
        files = AttemptFiles(Path(tempfile.mkdtemp(prefix=f"zaya-{run.lease.job_id}-attempt-{run.lease.attempt}-")))
        try:
            return self._run_child(run, fine_tune_run, resume_from, devices, files)
        finally:
            shutil.rmtree(files.directory, ignore_errors=True)

    def _run_child(
        self, run: JobRun, fine_tune_run: FineTuneRun, resume_from: str | None, devices: int, files: AttemptFiles
    ) -> dict[str, Any]:
        spec = {
            "model_dir": fine_tune_run.model_dir,
            "train_file": fine_tune_run.train_file,
            "validation_file": fine_tune_run.validation_file,
            "output_dir": fine_tune_run.output_dir,
            "seed": fine_tune_run.seed,
            "method": fine_tune_run.settings.model_dump(mode="json"),
            "resume_from": resume_from,
            "worker_pid": os.getpid(),
        }
        write_json_atomic(files.spec, spec)
        command = [sys.executable, "-m", "server.jobs.attempt", str(files.spec)]
        if devices > 1:  # data-parallel: one process per device, rendezvous on a free local port
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}"]
            command = [*launcher, "-m", "server.jobs.attempt", str(files.spec)]
        environment = os.environ.copy()
        if self.settings.worker_threads is not None:  # torch reads it when the child starts (torchrun passes it on)
            environment["OMP_NUM_THREADS"] = str(self.settings.worker_threads)
        # Its own session: a Ctrl-C at the worker's terminal reaches the worker, which pauses the child in order.
        process = subprocess.Popen(command, start_new_session=True, env=environment)
        try:
            parallelism = fine_tune_run.settings.data_parallelism
            message = "Training process started" + (f" ({devices} devices, {parallelism})." if devices > 1 else ".")
            data = {"attempt": run.lease.attempt, "devices": devices} | (
                {"parallelism": parallelism} if devices > 1 else {}
            )
            logger.info("job %s: training process %d started", run.lease.job_id, process.pid)
            run.write(jobs.record_event, message, data=data)
            self._follow(run, process, files)
        finally:
            if process.poll() is None:  # leaving early (lost lease, database error): the child must not outlive it
                write_control(files, "cancel")
                try:
                    process.wait(timeout=self.config.stop_grace_seconds)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if not files.result.is_file():
            logger.warning("job %s: training process %d ended without a result", run.lease.job_id, process.pid)
            raise AttemptDied(f"The training process {exit_description(process.returncode)}")
        result: dict[str, Any] = json.loads(files.result.read_text())
        return result

    def _follow(self, run: JobRun, process: subprocess.Popen[bytes], files: AttemptFiles) -> None:
        hooks = JobHooks(run)
        reader = EventReader(files.events)
        pending: list[dict[str, Any]] = []  # read from the child, not yet recorded
        sent = None
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.1)
            ended = process.returncode is not None  # read after the exit: the last lines are in the file by then
            pending += reader.read()
            try:
                while pending:
                    report(hooks, pending[0])
                    pending.pop(0)
            except SQLAlchemyError as error:
                # A database restart or failover: the child trains on, its records wait in order for the next try.
                # The heartbeat finds out whether the lease outlived the outage.
                if run.lost.is_set():
                    raise jobs.LeaseLost(f"lost job {run.lease.job_id} while the database was away") from error
                logger.warning("recording job %s's progress failed, retrying: %s", run.lease.job_id, error)
                time.sleep(1)
            if ended and not pending:
                return
            action = run.stop_reason()
            if action is not None and action != sent and sent != "cancel":
                write_control(files, action)
                sent = action

    def _finish(self, run: JobRun, result: dict[str, Any]) -> None:
        if run.lost.is_set():
            raise jobs.LeaseLost(f"lost job {run.lease.job_id} before it finished")
        status = result["status"]
        if status == "succeeded":
            try:
                run.write(
                    jobs.finish_succeeded,
                    output_dir=result["output_dir"],
                    metrics=json_safe(result["metrics"]),
                    trained_tokens=result.get("trained_tokens"),
                )
            except APIError as error:  # the trainer's output does not load as a model version
                failure = {"code": "registration_failed", "message": error.message, "param": None}
                run.write(jobs.finish_stopped, JobStatus.failed, f"Job failed: {error.message}", error=failure)
        elif status == "cancelled":
            run.write(jobs.finish_stopped, JobStatus.cancelled, "Job cancelled.")
        elif status == "paused" and run.requested_action == "pause":
            run.write(jobs.finish_stopped, JobStatus.paused, "Job paused at its last checkpoint.")
        elif status == "paused":  # this worker is shutting down: another one continues the job
            run.write(jobs.finish_stopped, JobStatus.queued, "The worker shut down; job re-queued.")
        else:
            message = f"The trainer returned an unknown status {status!r}."
            unknown = {"code": "training_error", "message": message, "param": None}
            run.write(jobs.finish_stopped, JobStatus.failed, f"Job failed: {message}", error=unknown)


def install_signal_handlers(worker: Worker) -> None:
    """SIGTERM / SIGINT: checkpoint the running job, put it back in the queue, exit."""

    def stop(signum: int, _frame: FrameType | None) -> None:
        logger.info("signal %d: stopping after the current step", signum)
        worker.shutdown.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
