"""kill -9 of `zaya worker` processes at three points of one fine-tuning job; the job must still succeed once.

The points are hit by watching what the worker's training process leaves behind (the records it reports, checkpoint
directories on disk) and freezing it (SIGSTOP) the moment one appears; once the worker has recorded everything the
training process reported, the worker is frozen too. The test checks it caught the intended state, then SIGKILLs the
worker (its training process dies with it). No hook in the product code. A spare worker is always running; it takes
the job over when the lease (5 s here) runs out.

1. attempt 1: training has started (a metrics event), no checkpoint written yet;
2. attempt 2: checkpoint-4 is published and checkpoint-8 is half written (its `.partial` staging dir exists);
3. attempt 3 (resumed from checkpoint-4): the last step's checkpoint-12 is published, the job is not yet
   registered as succeeded;
4. attempt 4 resumes from the last checkpoint and finishes: one success, one model version.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from server.db.models import Checkpoint, FineTuningJob, JobEvent, ModelVersion

from .processes import DATASET, freeze, kill, logs, training_process, training_reports, wait_for

pytestmark = pytest.mark.slow

MAX_STEPS, EVERY = 12, 4
STEP_TIMEOUT_S = 240


def test_kill_9_of_workers_at_three_points_of_a_job_succeeds_exactly_once(stack):
    stack.start_server()
    client = httpx.Client(base_url=stack.url, headers=stack.headers("data"), timeout=60)
    upload = client.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", DATASET)})
    hyperparameters = {"n_epochs": 100, "batch_size": 1, "max_steps": MAX_STEPS, "eval_every": EVERY}
    body = {"model": "zaya-tiny", "training_file": upload.json()["id"]}
    body["method"] = {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}
    job_id = client.post("/v1/fine_tuning/jobs", json=body).json()["id"]
    job_dir = stack.data_dir / "jobs" / job_id
    workers = {}

    def start_worker() -> None:
        worker = stack.start_worker("--max-attempts", "5")
        workers[worker.pid] = worker

    start_worker()
    start_worker()

    with stack.database() as sessions:

        def job() -> FineTuningJob:
            with sessions() as session:
                return session.get(FineTuningJob, job_id)

        def holder_of(attempt: int):
            current = job()
            if current.status == "running" and current.attempts == attempt and current.worker_id:
                return workers[int(current.worker_id.rsplit(":", 1)[1])]
            return None

        def checkpoint_rows() -> list[tuple[int, str]]:
            with sessions() as session:
                rows = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id))
                return sorted((row.step, row.path) for row in rows)

        def checkpoints(attempt: int) -> Path:
            return job_dir / f"attempt-{attempt}" / "checkpoints"

        def metrics_events_from(attempt: int) -> int:
            """Metrics events recorded since the training process of `attempt` started."""
            with sessions() as session:
                started = [
                    event.id
                    for event in session.scalars(
                        select(JobEvent).where(
                            JobEvent.job_id == job_id, JobEvent.message.startswith("Training process started")
                        )
                    )
                    if (event.data or {}).get("attempt") == attempt
                ]
                query = select(func.count()).where(
                    JobEvent.job_id == job_id, JobEvent.type == "metrics", JobEvent.id > (started[0] if started else 0)
                )
                return session.scalar(query) if started else -1

        def recorded(attempt: int, child) -> bool:
            """The worker has recorded every metric and checkpoint its training process reported."""
            reported = training_reports(child.reports)
            metrics = sum(record["kind"] == "metrics" for record in reported)
            kept = {record["step"] for record in reported if record["kind"] == "checkpoint"}
            kept -= {record["step"] for record in reported if record["kind"] == "checkpoint_deleted"}
            rows = {step for step, path in checkpoint_rows() if Path(path).parent == checkpoints(attempt)}
            return metrics_events_from(attempt) == metrics and rows == kept

        def kill_when(attempt: int, moment, what: str) -> None:
            holder = wait_for(lambda: holder_of(attempt), STEP_TIMEOUT_S, stack, f"attempt {attempt} to start")
            child = wait_for(lambda: training_process(holder.pid), STEP_TIMEOUT_S, stack, "its training process")
            reports = child.reports
            wait_for(lambda: moment(reports), STEP_TIMEOUT_S, stack, what, poll=0.002)
            os.kill(child.pid, signal.SIGSTOP)
            wait_for(lambda: recorded(attempt, child), STEP_TIMEOUT_S, stack, "the worker to record what was reported")
            freeze(holder)
            return holder

        # 1. Training has started, no checkpoint yet.
        first_metrics = lambda reports: any(record["kind"] == "metrics" for record in training_reports(reports))  # noqa: E731
        holder = kill_when(1, first_metrics, "the first training metrics")
        assert checkpoint_rows() == [] and not list(checkpoints(1).glob("*checkpoint-*")), "too late: a checkpoint"
        kill(holder)
        start_worker()

        # 2. Mid-way through writing the second checkpoint.
        staging = checkpoints(2) / f".checkpoint-{2 * EVERY}.partial"
        holder = kill_when(2, lambda _: staging.exists(), "checkpoint 8 being written")
        assert (checkpoints(2) / f"checkpoint-{EVERY}").is_dir()
        assert not (checkpoints(2) / f"checkpoint-{2 * EVERY}").exists(), "too late: the checkpoint was published"
        kill(holder)
        start_worker()

        # 3. After the last step's checkpoint, before the job is registered as succeeded.
        last = checkpoints(3) / f"checkpoint-{MAX_STEPS}"
        holder = kill_when(3, lambda _: last.is_dir(), "the last checkpoint")
        assert job().status == "running", "too late: the job already finished"
        with sessions() as session:
            assert session.scalar(select(func.count()).where(ModelVersion.job_id == job_id)) == 0
        kill(holder)

        # 4. A surviving worker finishes the job.
        wait_for(lambda: job().status not in ("queued", "running"), STEP_TIMEOUT_S, stack, "the job to finish")
        finished = job()
        with sessions() as session:
            events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
            history = "\n".join(event.message for event in events)
            versions = session.scalars(select(ModelVersion).where(ModelVersion.job_id == job_id)).all()
        assert finished.status == "succeeded", (finished.error, history, logs(stack))
        assert (finished.attempts, finished.lease_expirations) == (4, 3), history
        assert len(versions) == 1 and versions[0].id == finished.result_model_version_id
        assert versions[0].name == finished.fine_tuned_model
        assert sum(message.startswith("Job succeeded") for message in history.splitlines()) == 1, history
        assert "Resuming from checkpoint checkpoint-4." in history  # attempt 3 continued from attempt 2's checkpoint
        # The registered version and every recorded checkpoint are complete, published directories.
        assert (Path(versions[0].path) / "adapter_config.json").is_file()
        for step, path in checkpoint_rows():
            assert Path(path).name == f"checkpoint-{step}" and (Path(path) / "metrics.json").is_file(), path
    # The model serves: the fine-tuned name works in chat at once.
    chat = {"model": finished.fine_tuned_model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answer = httpx.post(f"{stack.url}/v1/chat/completions", json=chat, headers=stack.headers("analyst"), timeout=60)
    assert answer.status_code == 200, answer.text
