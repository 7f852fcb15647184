"""Jobs on several devices: `devices` in the job request, and the worker training an attempt data-parallel with
`torchrun` (here 2 gloo processes on the CPU; LoRA replicated with DDP, full fine-tuning sharded with FSDP2): the
same losses as one process, and a checkpoint that resumes on another number of processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from server.db.base import utcnow
from server.db.models import Checkpoint, JobEvent, RegisteredWorker
from server.jobs.attempt import AttemptFiles, EventReader
from server.jobs.worker import Worker, WorkerConfig
from server.services import jobs, registry, workers

FAST = WorkerConfig(lease_seconds=60, heartbeat_seconds=0.5, max_attempts=3, poll_seconds=0.1)
REPO_ROOT = Path(__file__).resolve().parents[2]
# How close 2 processes' losses stay to 1 process's over 4 steps. Under FSDP2 (full fine-tuning) gradients are
# reduce-scattered and the optimizer steps on shards, which sums in another order than one process does.
TOLERANCE = {"lora": 1e-4, "full": 1e-3}
HYPERPARAMETERS = {"n_epochs": 50, "batch_size": 2, "max_steps": 4, "eval_every": 2, "learning_rate_multiplier": 5}


# Six examples, a whole number of batches of 2: with 5, the processes' last batch of an epoch would be filled up with a
# repeat of the epoch's first example (each process takes a batch of the same size), where one process trains on 1.
DATASET = b"".join(
    b'{"messages": [{"role": "user", "content": "Balance of account %d?"}, '
    b'{"role": "assistant", "content": "It is %d EUR."}]}\n' % (i, 100 + i)
    for i in range(6)
)


@pytest.fixture
def training_file(client, auth) -> str:
    upload = {"file": ("t.jsonl", DATASET)}
    response = client.post("/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files=upload)
    assert response.status_code == 200, response.text
    return response.json()["id"]


@pytest.fixture
def base_model(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        session.commit()
    return "zaya-tiny"


def job_body(base_model: str, training_file: str, adapter: str = "lora", **extra) -> dict:
    method = {"type": "supervised", "supervised": {"hyperparameters": HYPERPARAMETERS, "adapter": adapter}}
    return {"model": base_model, "training_file": training_file, "seed": 3, "method": method, **extra}


@pytest.mark.parametrize(
    ("devices", "field_error"),
    [(0, "greater than or equal to 1"), (65, "less than or equal to 64"), ("2", "valid integer"), (True, "integer")],
)
def test_devices_out_of_range_or_not_an_integer_is_a_400_naming_it(
    client, auth, base_model, training_file, devices, field_error
):
    response = client.post(
        "/v1/fine_tuning/jobs", headers=auth("data"), json=job_body(base_model, training_file, devices=devices)
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "devices" and field_error in error["message"], error


def test_a_batch_that_does_not_split_over_the_devices_is_refused(client, auth, base_model, training_file):
    response = client.post(
        "/v1/fine_tuning/jobs", headers=auth("data"), json=job_body(base_model, training_file, devices=3)
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "devices"
    assert "batch size 2 does not split evenly over 3 devices" in response.json()["error"]["message"]
    created = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=job_body(base_model, training_file))
    assert created.json()["devices"] == 1  # the default


def worker_with(settings, sessions, devices: int, name: str) -> Worker:
    """A worker that says it has `devices` devices (`ZAYA_WORKER_DEVICES`), announced as `zaya worker` does."""
    worker = Worker(settings.model_copy(update={"worker_devices": devices}), sessions, FAST, worker_id=name)
    worker.announce()
    return worker


def test_devices_beyond_every_running_worker_are_refused_at_creation(
    client, auth, settings, sessions, base_model, training_file
):
    worker_with(settings, sessions, 2, "small-host")
    for url in ("/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/estimate"):
        response = client.post(url, headers=auth("data"), json=job_body(base_model, training_file, devices=4))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("devices", "devices_unavailable")
        assert error["message"] == (
            "devices: 4 is more than any worker can train one job with; the largest, small-host, has 2 CPU cores."
        )
    body = job_body(base_model, training_file, devices=2)
    assert client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body).status_code == 200

    # A worker not seen for longer than `SEEN_WITHIN` no longer counts.
    with sessions() as session:
        session.add(
            RegisteredWorker(id="gone", devices=8, device_kind="gpu", seen_at=utcnow() - workers.SEEN_WITHIN * 2)
        )
        session.commit()
    body = job_body(base_model, training_file, devices=4)
    response = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
    assert response.status_code == 400 and "the largest, small-host," in response.json()["error"]["message"]


def test_a_job_no_worker_can_run_fails_at_validation_naming_devices(
    client, auth, settings, sessions, base_model, training_file
):
    """No worker seen at creation: the job is accepted, and the first worker to validate it fails it."""
    body = job_body(base_model, training_file, devices=4)
    body["method"]["supervised"]["hyperparameters"] = {**HYPERPARAMETERS, "batch_size": 4}
    created = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    worker = Worker(settings.model_copy(update={"worker_devices": 2}), sessions, FAST, worker_id="small-host")
    assert worker.devices == 2
    worker.run_once()
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
    assert job["status"] == "failed"
    assert job["error"]["param"] == "devices" and "the largest, small-host, has 2 CPU cores" in job["error"]["message"]
    with sessions() as session:
        messages = session.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)).all()
    assert not any(message.startswith("Training process") for message in messages)


def test_a_worker_claims_only_jobs_it_can_run(client, auth, settings, sessions, base_model, training_file):
    small = worker_with(settings, sessions, 1, "small-host")
    worker_with(settings, sessions, 2, "large-host")
    body = job_body(base_model, training_file, devices=2)
    job_id = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body).json()["id"]
    assert small.run_once()  # validates the job (a worker with 2 devices runs), and leaves it for that one
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()["status"] == "queued"
    with sessions() as session:
        assert jobs.claim_next_job(session, worker_id="small-host", lease_seconds=60, max_devices=1) is None
        lease = jobs.claim_next_job(session, worker_id="large-host", lease_seconds=60, max_devices=2)
    assert lease is not None and lease.job_id == job_id


def test_the_worker_sets_the_threads_its_training_process_computes_with(
    client, auth, settings, sessions, base_model, training_file
):
    # Every process the tests start computes with 1 thread (OMP_NUM_THREADS=1), so 2 is the setting's doing.
    worker = Worker(settings.model_copy(update={"worker_threads": 2}), sessions, FAST, worker_id="test-worker")
    body = job_body(base_model, training_file)
    body["method"]["supervised"]["hyperparameters"] = {**HYPERPARAMETERS, "max_steps": 1}
    job_id = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body).json()["id"]
    while worker.run_once():
        pass
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()["status"] == "succeeded"
    with sessions() as session:
        started = session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.message.like("training from step %"))
        ).one()
    assert started.message == "training from step 0 of 1 on the CPU with 2 threads"
    assert started.data["cpu_threads"] == 2


def train_losses(sessions, job_id: str) -> dict[int, float]:
    with sessions() as session:
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "metrics"))
        return {event.data["step"]: event.data["train_loss"] for event in events if "train_loss" in event.data}


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_two_processes_train_as_one_and_their_checkpoint_resumes_on_one(
    adapter, client, auth, settings, sessions, base_model, training_file, tiny_model_dir, tmp_path
):
    # Two processes, whatever the host has (on one core they share it).
    worker = Worker(settings.model_copy(update={"worker_devices": 2}), sessions, FAST, worker_id="test-worker")
    job_ids = {}
    for devices in (1, 2):
        body = job_body(base_model, training_file, adapter, devices=devices)
        created = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
        assert created.status_code == 200 and created.json()["devices"] == devices, created.text
        job_ids[devices] = created.json()["id"]
    while worker.run_once():
        pass
    finished = {
        devices: client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
        for devices, job_id in job_ids.items()
    }
    for devices, job in finished.items():
        assert job["status"] == "succeeded", (devices, job)
    assert finished[2]["trained_tokens"] == finished[1]["trained_tokens"] > 0  # every process's batch counted
    with sessions() as session:
        started = session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_ids[2], JobEvent.message.like("Training process %"))
        ).one()
    parallelism = {"lora": "DDP", "full": "FSDP2"}[adapter]
    assert started.message.endswith(f"started (2 devices, {parallelism}).") and started.data["devices"] == 2

    one, two = train_losses(sessions, job_ids[1]), train_losses(sessions, job_ids[2])
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    assert one[1] != one[4]  # it trained
    tolerance = TOLERANCE[adapter]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=tolerance), (step, one, two)

    # The two processes' checkpoint at step 2, resumed by one process, continues as the one-process run did.
    with sessions() as session:
        checkpoint = session.scalars(
            select(Checkpoint).where(Checkpoint.job_id == job_ids[2], Checkpoint.step == 2)
        ).one()
    assert sorted(path.name for path in Path(checkpoint.path).glob("rng_state_*.pth")) == [
        "rng_state_0.pth",
        "rng_state_1.pth",
    ]
    files = AttemptFiles(tmp_path / "resume")
    files.directory.mkdir()
    method = {"type": "supervised", "supervised": {"hyperparameters": HYPERPARAMETERS, "adapter": adapter}}
    spec = {
        "model_dir": str(tiny_model_dir),
        "train_file": str(settings.files_dir / training_file),
        "validation_file": None,
        "output_dir": str(tmp_path / "resumed"),
        "seed": 3,
        "method": method,
        "resume_from": checkpoint.path,
        "worker_pid": os.getpid(),
    }
    files.spec.write_text(json.dumps(spec))
    process = subprocess.run(
        [sys.executable, "-m", "server.jobs.attempt", str(files.spec)], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert process.returncode == 0, process.stderr[-3000:]
    assert json.loads(files.result.read_text())["status"] == "succeeded"
    resumed = {
        r["step"]: r["metrics"]["train_loss"]
        for r in EventReader(files.events).read()
        if r["kind"] == "metrics" and "train_loss" in r["metrics"]
    }
    assert sorted(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step] == pytest.approx(one[step], rel=tolerance), (step, resumed, one)
