"""Leases and failure detection: one claimant per job, fenced writes after a lost lease, re-queue and give-up, and a
real `zaya worker` process killed with SIGKILL mid-job whose job another worker resumes from its last checkpoint."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from server.db.base import utcnow
from server.db.models import DEFAULT_PROJECT_ID, File, FineTuningJob, JobEvent, JobStatus, ModelVersion
from server.services import jobs, registry

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def queued_jobs(sessions, tmp_path):
    """Make `n` queued jobs directly in the database (the queue does not care how they got there)."""

    def make(n: int) -> list[str]:
        model_dir = tmp_path / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text('{"model_type": "zaya"}')
        with sessions() as session:
            base = registry.register_version(session, name=f"base-{secrets.token_hex(3)}", path=model_dir)
            dataset = File(
                filename="t.jsonl", purpose="fine-tune", bytes=1, sha256="0" * 64, project_id=DEFAULT_PROJECT_ID
            )
            session.add(dataset)
            session.flush()
            created = [
                FineTuningJob(
                    model=base.name,
                    base_version_id=base.id,
                    training_file_id=dataset.id,
                    status="queued",
                    project_id=DEFAULT_PROJECT_ID,
                )
                for _ in range(n)
            ]
            session.add_all(created)
            session.commit()
            return [job.id for job in created]

    return make


def claim(sessions, worker_id: str, lease_seconds: float = 30) -> jobs.Lease | None:
    with sessions() as session:
        return jobs.claim_next_job(session, worker_id=worker_id, lease_seconds=lease_seconds)


def expire_lease(sessions, job_id: str) -> None:
    with sessions() as session:
        session.execute(
            update(FineTuningJob)
            .where(FineTuningJob.id == job_id)
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )
        session.commit()


def test_concurrent_workers_never_claim_the_same_job(sessions, queued_jobs):
    job_ids = queued_jobs(24)
    claimed: dict[str, list[str]] = {f"w{i}": [] for i in range(4)}
    errors: list[BaseException] = []

    def work(worker_id: str) -> None:
        try:
            while (lease := claim(sessions, worker_id)) is not None:
                claimed[worker_id].append(lease.job_id)
        except BaseException as error:  # surfaced below: a thread's failure must fail the test
            errors.append(error)

    threads = [threading.Thread(target=work, args=(worker_id,)) for worker_id in claimed]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    all_claims = [job_id for ids in claimed.values() for job_id in ids]
    assert sorted(all_claims) == sorted(job_ids)  # every job once, none twice
    with sessions() as session:
        rows = session.scalars(select(FineTuningJob).where(FineTuningJob.id.in_(job_ids))).all()
        assert {(row.status, row.attempts) for row in rows} == {("running", 1)}
        assert all(row.worker_id and row.id in claimed[row.worker_id] for row in rows)


def test_a_worker_that_lost_its_lease_can_no_longer_write(sessions, queued_jobs):
    (job_id,) = queued_jobs(1)
    old = claim(sessions, "old-worker")
    expire_lease(sessions, job_id)
    with sessions() as session:
        assert jobs.requeue_expired(session, max_attempts=3) == [job_id]
    new = claim(sessions, "new-worker")
    assert (new.job_id, new.attempt) == (job_id, 2) and new.token != old.token

    with sessions() as session:
        with pytest.raises(jobs.LeaseLost):
            jobs.heartbeat(session, old, lease_seconds=30)
        with pytest.raises(jobs.LeaseLost):
            jobs.record_checkpoint(session, old, step=5, path="/elsewhere", metrics=None)
        with pytest.raises(jobs.LeaseLost):
            jobs.finish_succeeded(session, old, output_dir="/elsewhere", metrics=None, trained_tokens=None)
        with pytest.raises(jobs.LeaseLost):
            jobs.finish_stopped(session, old, JobStatus.failed, "stale worker")
        assert jobs.heartbeat(session, new, lease_seconds=30) is None
    with sessions() as session:
        job = session.get(FineTuningJob, job_id)
        assert (job.status, job.worker_id, job.lease_expirations) == ("running", "new-worker", 1)


def test_a_job_is_given_up_after_max_attempts_lost_leases(sessions, queued_jobs):
    (job_id,) = queued_jobs(1)
    for attempt in (1, 2):
        assert claim(sessions, f"worker-{attempt}").attempt == attempt
        expire_lease(sessions, job_id)
        with sessions() as session:
            jobs.requeue_expired(session, max_attempts=2)
    with sessions() as session:
        job = session.get(FineTuningJob, job_id)
        assert job.status == JobStatus.failed and job.finished_at is not None
        assert job.error["code"] == "worker_lost" and "Gave up after 2 attempts" in job.error["message"]
    assert claim(sessions, "worker-3") is None


def test_a_lost_job_with_a_pending_cancel_is_cancelled_not_requeued(sessions, queued_jobs):
    (job_id,) = queued_jobs(1)
    claim(sessions, "worker")
    with sessions() as session:
        jobs.cancel_job(session, session.get(FineTuningJob, job_id))
    expire_lease(sessions, job_id)
    with sessions() as session:
        jobs.requeue_expired(session, max_attempts=3)
        assert session.get(FineTuningJob, job_id).status == JobStatus.cancelled


# --- a real worker process, killed mid-job -------------------------------------------------------------------------


def start_worker(settings, log_path: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "ZAYA_DATABASE_URL": settings.database_url,
        "ZAYA_DATA_DIR": str(settings.data_dir),
    }
    command = [sys.executable, "-m", "zaya_cli", "worker", "--lease-seconds", "5", "--heartbeat-seconds", "0.5"]
    command += ["--poll-seconds", "0.2"]
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(predicate, timeout: float, processes: dict[int, subprocess.Popen], log_path: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for process in processes.values():
            if process.poll() is not None:
                pytest.fail(f"worker exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    pytest.fail(f"timed out; worker log:\n{log_path.read_text()[-3000:]}")


def test_a_killed_worker_s_job_resumes_from_its_checkpoint_and_succeeds_once(
    client, auth, settings, sessions, tiny_model_dir, valid_dataset, tmp_path
):
    with sessions() as session:
        registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        session.commit()
    upload = {"file": ("train.jsonl", valid_dataset)}
    file_id = client.post("/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files=upload).json()["id"]
    hyperparameters = {"n_epochs": 100, "batch_size": 1, "max_steps": 12, "eval_every": 3}
    method = {"supervised": {"hyperparameters": hyperparameters}}
    body = {"model": "zaya-tiny", "training_file": file_id, "method": method}
    job_id = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body).json()["id"]
    log_path = tmp_path / "workers.log"

    # Two real worker processes (started together: each pays the torch import once). One claims the job; it is
    # killed with SIGKILL right after the job's first checkpoint; the other must take the job over.
    workers = {process.pid: process for process in (start_worker(settings, log_path), start_worker(settings, log_path))}

    def holder_after_first_checkpoint() -> int | None:
        with sessions() as session:
            job = session.get(FineTuningJob, job_id)
            if job.status != JobStatus.running or jobs.latest_checkpoint(session, job_id) is None:
                return None
            return int(job.worker_id.rsplit(":", 1)[1])

    try:
        holder = wait_for(holder_after_first_checkpoint, 180, workers, log_path)
        workers[holder].send_signal(signal.SIGKILL)
        workers[holder].wait()
        with sessions() as session:
            job = session.get(FineTuningJob, job_id)
            # (A heartbeat starved for a whole lease would legitimately hand the job over before the kill.)
            assert (job.status, job.worker_id.endswith(f":{holder}")) == ("running", True), "killed the holder"
            resume_step = jobs.latest_checkpoint(session, job_id).step
        (survivor,) = (pid for pid in workers if pid != holder)
        survivors = {survivor: workers[survivor]}

        def finished() -> bool:
            with sessions() as session:
                return session.get(FineTuningJob, job_id).status in jobs.FINISHED_STATUSES

        wait_for(finished, 180, survivors, log_path)
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
    assert workers[survivor].wait(timeout=60) == 0

    with sessions() as session:
        job = session.get(FineTuningJob, job_id)
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
        history = "\n".join(f"{event.created_at:%H:%M:%S.%f} {event.message}" for event in events)
        assert job.status == JobStatus.succeeded, (job.error, history, log_path.read_text()[-3000:])
        assert (job.attempts, job.lease_expirations) == (2, 1), history
        assert job.fine_tuned_model.endswith(f":{job_id}")
        versions = session.scalars(select(ModelVersion).where(ModelVersion.job_id == job_id)).all()
        assert len(versions) == 1 and versions[0].name == job.fine_tuned_model
        messages = [event.message for event in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
    assert any("stopped responding (lease expired); re-queued" in message for message in messages)
    assert f"Resuming from checkpoint checkpoint-{resume_step}." in messages
    # The second attempt continued after the checkpoint: it wrote no checkpoint at or before it.
    second_attempt = settings.data_dir / "jobs" / job_id / "attempt-2" / "checkpoints"
    steps = [int(path.name.split("-")[1]) for path in second_attempt.glob("checkpoint-*")]
    assert steps and min(steps) > resume_step
    assert Path(versions[0].path).is_dir()


def test_a_lost_attempt_is_requeued_then_given_up_counting_with_lost_leases(sessions, queued_jobs):
    (job_id,) = queued_jobs(1)
    claim(sessions, "worker-1")
    expire_lease(sessions, job_id)
    with sessions() as session:
        jobs.requeue_expired(session, max_attempts=3)  # one lost lease
    lease = claim(sessions, "worker-2")
    with sessions() as session:
        reason = "The training process was killed by signal SIGKILL (9)"
        assert jobs.end_lost_attempt(session, lease, reason, max_attempts=3) == JobStatus.queued
    lease = claim(sessions, "worker-3")
    with sessions() as session:
        assert jobs.end_lost_attempt(session, lease, reason, max_attempts=3) == JobStatus.failed
        with pytest.raises(jobs.LeaseLost):  # the lease ended with the attempt
            jobs.heartbeat(session, lease, lease_seconds=30)
    with sessions() as session:
        job = session.get(FineTuningJob, job_id)
        assert (job.status, job.lease_expirations, job.lease_token) == (JobStatus.failed, 3, None)
        assert job.error["code"] == "training_process_died"
        assert job.error["message"] == f"{reason}. Gave up after 3 lost attempts."
        messages = [e.message for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
    assert f"{reason}; re-queued to resume from the last checkpoint (lost 2 of at most 3 times)." in messages


def test_a_killed_training_process_costs_an_attempt_not_the_worker(
    client, auth, settings, sessions, tiny_model_dir, valid_dataset, tmp_path
):
    with sessions() as session:
        registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        session.commit()
    upload = {"file": ("train.jsonl", valid_dataset)}
    file_id = client.post("/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files=upload).json()["id"]
    hyperparameters = {"n_epochs": 100, "batch_size": 1, "max_steps": 12, "eval_every": 3}
    body = {
        "model": "zaya-tiny",
        "training_file": file_id,
        "method": {"supervised": {"hyperparameters": hyperparameters}},
    }
    job_id = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body).json()["id"]
    log_path = tmp_path / "worker.log"
    worker = start_worker(settings, log_path)
    processes = {worker.pid: worker}

    def training_process_after_first_checkpoint() -> int | None:
        with sessions() as session:
            if jobs.latest_checkpoint(session, job_id) is None:
                return None
        # The worker's child running `server.jobs.attempt` (job events name no process ids).
        for task in Path(f"/proc/{worker.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                with contextlib.suppress(FileNotFoundError):
                    if b"server.jobs.attempt" in Path(f"/proc/{child}/cmdline").read_bytes():
                        return int(child)
        return None

    try:
        child = wait_for(training_process_after_first_checkpoint, 180, processes, log_path)
        assert child != worker.pid
        os.kill(child, signal.SIGKILL)  # what the kernel's out-of-memory killer does

        def finished() -> bool:
            with sessions() as session:
                return session.get(FineTuningJob, job_id).status in jobs.FINISHED_STATUSES

        wait_for(finished, 180, processes, log_path)  # fails at once if the worker went down with its child
        assert worker.poll() is None, "the worker lives on"
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0

    with sessions() as session:
        job = session.get(FineTuningJob, job_id)
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
        history = "\n".join(f"{event.level} {event.message}" for event in events)
        assert job.status == JobStatus.succeeded, (job.error, history, log_path.read_text()[-3000:])
        assert (job.attempts, job.lease_expirations) == (2, 1), history
    lost = [event for event in events if "killed by signal SIGKILL (9)" in event.message]
    assert len(lost) == 1 and lost[0].level == "warn", history
    assert lost[0].message == (
        "The training process was killed by signal SIGKILL (9); re-queued to resume from the last checkpoint "
        "(lost 1 of at most 3 times)."
    )
    assert any(event.message.startswith("Resuming from checkpoint checkpoint-") for event in events), history
