"""The job worker with the real fine-tuning core on a tiny model: a job runs to a registered model version, and
pause, resume and cancel reach a running job. (Leases and crash recovery: `test_worker_recovery.py`.)"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from sqlalchemy import select
from transformers import AutoTokenizer

from finetune.balancing_callback import BALANCING_STATE_FILE
from finetune.datasets.formats import parse_record
from finetune.datasets.rendering import tokenize_example
from server.db.base import utcnow
from server.db.models import Checkpoint, FineTuningJob, JobEvent, JobStatus, ModelVersion
from server.jobs.worker import Pace, Worker, WorkerConfig
from server.services import registry
from server.services.access import Scope
from server.services.model_resolution import find_version

FAST = WorkerConfig(lease_seconds=20, heartbeat_seconds=0.2, max_attempts=3, poll_seconds=0.1)


@pytest.fixture
def base_model(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        session.commit()
    return "zaya-tiny"


@pytest.fixture
def training_file(client, auth, valid_dataset) -> str:
    response = client.post(
        "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", valid_dataset)}
    )
    assert response.status_code == 200, response.text
    return response.json()["id"]


@pytest.fixture
def create_job(client, auth, base_model, training_file):
    def create(
        max_steps: int, eval_every: int, *, hyperparameters: dict | None = None, validation_file=None, **supervised
    ) -> str:
        body = {
            "model": base_model,
            "training_file": training_file,
            "validation_file": validation_file,
            "suffix": "bank",
            "seed": 7,
            "method": {
                "type": "supervised",
                "supervised": {
                    "hyperparameters": {
                        "n_epochs": 50,
                        "batch_size": 1,
                        "max_steps": max_steps,
                        "eval_every": eval_every,
                        **(hyperparameters or {}),
                    },
                    **supervised,
                },
            },
        }
        response = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "validating_files"
        return response.json()["id"]

    return create


@pytest.fixture
def worker(settings, sessions) -> Worker:
    return Worker(settings, sessions, FAST, worker_id="test-worker")


def job_row(sessions, job_id: str) -> FineTuningJob:
    with sessions() as session:
        return session.get(FineTuningJob, job_id)


def wait_until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_job_trains_and_registers_exactly_one_model_version(client, auth, worker, create_job, sessions):
    job_id = create_job(max_steps=4, eval_every=2)
    assert worker.run_once() is True
    assert worker.run_once() is False  # nothing left

    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
    assert job["status"] == "succeeded", job
    assert job["fine_tuned_model"] == f"ft:zaya-tiny:zaya:bank:{job_id}"
    assert job["finished_at"] >= job["created_at"]

    with sessions() as session:
        versions = session.scalars(select(ModelVersion).where(ModelVersion.job_id == job_id)).all()
        assert len(versions) == 1
        version = versions[0]
        assert (version.name, version.kind, version.version) == (job["fine_tuned_model"], "adapter", 1)
        assert version.base_version_id == find_version(session, Scope.everything(), "zaya-tiny").id
        assert version.lineage["training_file"] == job["training_file"]
        assert find_version(session, Scope.everything(), job["fine_tuned_model"]).id == version.id
        steps = sorted(c.step for c in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
        assert steps == [2, 4]

    checkpoints = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth("data")).json()["data"]
    assert [c["step_number"] for c in checkpoints] == [4, 2]
    assert checkpoints[0]["fine_tuned_model_checkpoint"] == f"{job['fine_tuned_model']}:ckpt-step-4"
    assert "train_loss" in checkpoints[0]["metrics"]

    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100", headers=auth("data")).json()["data"]
    metric_events = [event for event in events if event["type"] == "metrics"]
    assert {1, 2, 3, 4} <= {event["data"]["step"] for event in metric_events}
    # As OpenAI words them: the step out of the total, then what was measured (training and validation apart).
    for event in metric_events:
        data = event["data"]
        assert data["total_steps"] == 4
        assert event["message"].startswith(f"Step {data['step']}/4: ")
        if "valid_loss" in data:
            assert f"validation loss={data['valid_loss']:.4f}" in event["message"]
        if "train_loss" in data:
            assert f"training loss={data['train_loss']:.4f}" in event["message"]
    assert "succeeded" in events[0]["message"]

    models = {model["id"] for model in client.get("/v1/models", headers=auth("analyst")).json()["data"]}
    assert job["fine_tuned_model"] in models

    lineage = client.get(f"/v1/admin/models/{version.id}/lineage", headers=auth("admin")).json()["chain"]
    assert [entry["name"] for entry in lineage] == [job["fine_tuned_model"], "zaya-tiny"]
    assert lineage[0]["job"]["training_file"]["sha256"]


def test_a_succeeded_job_bills_the_trained_tokens_its_estimate_announced(
    client, auth, worker, create_job, sessions, tiny_model_dir, valid_dataset, base_model, training_file
):
    hyperparameters = {"n_epochs": 2, "batch_size": 2}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = [parse_record(json.loads(line))[0] for line in valid_dataset.splitlines()]
    per_epoch = sum(tokenize_example(example, tokenizer).n_trained for example in examples)

    # Before any job on this model: the tokens, but no throughput to time them with. Nothing is created.
    body = {"model": base_model, "training_file": training_file, "method": {"supervised": {"hyperparameters": {}}}}
    body["method"]["supervised"]["hyperparameters"] = hyperparameters
    before = client.post("/v1/fine_tuning/jobs/estimate", headers=auth("data"), json=body)
    assert before.status_code == 200, before.text
    before = before.json()
    assert before["object"] == "fine_tuning.job.estimate"
    assert (before["n_examples"], before["n_trained_tokens_per_epoch"]) == (len(examples), per_epoch)
    assert before["trained_tokens"] == 2 * per_epoch and before["n_steps"] == 2 * 3  # 5 examples: 3 batches of 2
    assert before["hyperparameters"]["n_epochs"] == 2 and before["hyperparameters"]["batch_size"] == 2
    assert before["estimated_seconds"] is None and before["throughput_jobs"] == []
    assert client.get("/v1/fine_tuning/jobs", headers=auth("data")).json()["data"] == []

    job_id = create_job(max_steps=None, eval_every=None, hyperparameters=hyperparameters)
    assert worker.run_once() is True
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
    assert job["status"] == "succeeded", job
    assert job["trained_tokens"] == 2 * per_epoch == before["trained_tokens"]
    # "auto" is replaced by what the run chose, in `hyperparameters` and in `method`; given values stay.
    multiplier = before["hyperparameters"]["learning_rate_multiplier"]
    chosen = {"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": multiplier}
    assert job["hyperparameters"] == chosen and isinstance(chosen["learning_rate_multiplier"], float)
    assert {key: job["method"]["supervised"]["hyperparameters"][key] for key in chosen} == chosen
    assert job["estimated_finish"] is None  # only a running job has one
    # The model version records the run's throughput, which later estimates for this base model read.
    with sessions() as session:
        version = session.scalars(select(ModelVersion).where(ModelVersion.job_id == job_id)).one()
    assert version.metrics["trained_tokens"] == job["trained_tokens"]
    rate = version.metrics["trained_tokens_per_second"]
    assert rate > 0

    after = client.post("/v1/fine_tuning/jobs/estimate", headers=auth("data"), json=body).json()
    assert after["throughput_jobs"] == [job_id] and after["trained_tokens_per_second"] == pytest.approx(rate)
    assert after["estimated_seconds"] == pytest.approx(after["trained_tokens"] / rate)
    # A full fine-tuning runs at another pace: the LoRA job's throughput is not used for it.
    body["method"]["supervised"]["adapter"] = "full"
    full = client.post("/v1/fine_tuning/jobs/estimate", headers=auth("data"), json=body).json()
    assert full["throughput_jobs"] == [] and full["estimated_seconds"] is None


def test_an_estimate_refuses_a_file_that_does_not_fit_the_job_naming_it(client, auth, base_model, training_file):
    body = {"model": base_model, "training_file": training_file, "method": {"type": "dpo"}}
    response = client.post("/v1/fine_tuning/jobs/estimate", headers=auth("data"), json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("training_file", "invalid_training_file")
    assert "a dpo job needs preference data" in error["message"]
    # Checked against the base model as the worker checks it: here every example is longer than max_seq_len.
    body["method"] = {"supervised": {"hyperparameters": {"max_seq_len": 4}}}
    response = client.post("/v1/fine_tuning/jobs/estimate", headers=auth("data"), json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "training_file", response.text
    assert "line 1: " in response.json()["error"]["message"] and "max_seq_len 4" in response.json()["error"]["message"]
    assert client.post("/v1/fine_tuning/jobs/estimate", headers=auth("analyst"), json=body).status_code == 403


def test_the_pace_of_the_steps_so_far_gives_the_estimated_finish():
    now = [100.0]
    pace = Pace(first_step=10, total_steps=110, clock=lambda: now[0])
    assert pace.estimated_finish(10) is None  # no step done yet: no pace
    now[0] = 120.0  # 20 steps in 20 s: the 80 steps left take 80 s more
    before = utcnow()
    finish = pace.estimated_finish(30)
    assert before + timedelta(seconds=79.9) <= finish <= utcnow() + timedelta(seconds=80.1)


@pytest.fixture
def held_out_file(client, auth, valid_dataset) -> str:
    held_out = valid_dataset.replace(b"Balance of", b"Limit of")  # same shape, no overlap with the training file
    upload = {"file": ("v.jsonl", held_out)}
    response = client.post("/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files=upload)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def test_rotated_checkpoints_leave_no_rows_behind(client, auth, worker, create_job, held_out_file, sessions, settings):
    job_id = create_job(
        max_steps=5, eval_every=1, hyperparameters={"keep_checkpoints": 1}, validation_file=held_out_file
    )
    assert worker.run_once() is True
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
    assert job["status"] == "succeeded", job
    assert job["method"]["supervised"]["hyperparameters"]["keep_checkpoints"] == 1

    on_disk = {
        int(path.name.split("-")[1])
        for path in (settings.data_dir / "jobs" / job_id / "attempt-1" / "checkpoints").glob("checkpoint-*")
    }
    with sessions() as session:
        rows = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).all()
        paths = {row.step: row.path for row in rows}
        messages = [e.message for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
    assert all(Path(path).is_dir() for path in paths.values()), paths
    # Each step logs a training and a validation record: two events whose messages say which is which.
    step_3 = sorted(message for message in messages if message.startswith("Step 3/5: "))
    assert len(step_3) == 2
    assert "training loss=" in step_3[0] and "validation loss=" in step_3[1], step_3
    assert set(paths) == on_disk and 5 in on_disk and len(on_disk) <= 2  # the newest, and the best if older
    # The job ended with the task evaluation of its validation file, recorded on its model version.
    assert any(message.startswith("task evaluation: exact match") for message in messages)
    version = client.get("/v1/admin/models", headers=auth("admin")).json()["data"]
    (evaluated,) = [v for v in version if v["job_id"] == job_id]
    assert evaluated["evaluation"]["n_examples"] > 0 and 0 <= evaluated["evaluation"]["exact_match"] <= 1
    rotated = [message for message in messages if message.endswith("deleted (rotation).")]
    assert len(rotated) == 5 - len(on_disk)  # one checkpoint per step was saved; every other one was rotated away

    listed = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth("data")).json()["data"]
    assert [c["step_number"] for c in listed] == sorted(on_disk, reverse=True)
    console = client.get(f"/console/jobs/{job_id}", headers=auth("data"))  # the job page draws the rows left
    assert console.status_code == 200, console.text


@pytest.mark.parametrize(("balancing_bias_lr", "balanced"), [(0.0, False), (None, True)])
def test_full_fine_tuning_takes_the_balancing_bias_rate(
    client, auth, worker, create_job, sessions, balancing_bias_lr, balanced
):
    hyperparameters = {} if balancing_bias_lr is None else {"balancing_bias_lr": balancing_bias_lr}
    job_id = create_job(max_steps=2, eval_every=2, hyperparameters=hyperparameters, adapter="full")
    assert worker.run_once() is True
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
    assert job["status"] == "succeeded", job
    with sessions() as session:
        (checkpoint,) = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).all()
    # The balancing-bias updater saves its state in each checkpoint when it runs (the trainer's default rate);
    # a rate of 0 turns it off.
    assert (Path(checkpoint.path) / BALANCING_STATE_FILE).is_file() is balanced


def test_a_job_can_ask_for_gradient_checkpointing(client, auth, worker, create_job, sessions):
    job_id = create_job(max_steps=2, eval_every=2, hyperparameters={"gradient_checkpointing": True})
    assert worker.run_once() is True
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
    assert job["status"] == "succeeded", job
    with sessions() as session:
        (checkpoint,) = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).all()
    # The Trainer stores the arguments it ran with in every checkpoint.
    arguments = torch.load(Path(checkpoint.path) / "training_args.bin", weights_only=False)
    assert arguments.gradient_checkpointing is True


def run_in_thread(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run_once, daemon=True)
    thread.start()
    return thread


def last_metrics_step(sessions, job_id: str) -> int:
    with sessions() as session:
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "metrics")).all()
        return max((event.data["step"] for event in events), default=0)


def test_pause_checkpoints_a_running_job_and_resume_continues_it(client, auth, worker, create_job, sessions):
    job_id = create_job(max_steps=400, eval_every=1000)
    thread = run_in_thread(worker)
    wait_until(lambda: last_metrics_step(sessions, job_id) >= 2)
    # While it runs, the job says when it should finish at its pace so far: hundreds of steps ahead, so later.
    running = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
    assert running["status"] == "running"
    assert time.time() < running["estimated_finish"] < time.time() + 3600, running

    paused = client.post(f"/v1/fine_tuning/jobs/{job_id}/pause", headers=auth("data"))
    assert paused.status_code == 200, paused.text
    thread.join(timeout=60)
    job = job_row(sessions, job_id)
    assert job.status == JobStatus.paused and job.lease_token is None and job.estimated_finish is None
    with sessions() as session:
        checkpoint_steps = [c.step for c in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id))]
    assert len(checkpoint_steps) == 1 and 2 <= checkpoint_steps[0] < 400
    assert worker.run_once() is False  # a paused job is not claimed

    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/resume", headers=auth("data")).json()["status"] == "queued"
    # The resumed run continues after the checkpoint; cancel it there (also covers cancelling a running job).
    thread = run_in_thread(worker)
    wait_until(lambda: last_metrics_step(sessions, job_id) > checkpoint_steps[0])
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=auth("data")).status_code == 200
    thread.join(timeout=60)
    job = job_row(sessions, job_id)
    assert job.status == JobStatus.cancelled and job.attempts == 2
    with sessions() as session:
        messages = [e.message for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
    assert any(message.startswith("Resuming from checkpoint checkpoint-") for message in messages)
    # The resumed run started after the checkpoint: no step at or before it was logged twice.
    with sessions() as session:
        steps = [
            e.data["step"]
            for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == "metrics"))
        ]
    assert len(steps) == len(set(steps))
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=auth("data")).status_code == 409


def test_a_job_whose_files_do_not_fit_its_model_fails_with_the_reason_and_registers_nothing(
    client, auth, worker, sessions, training_file, tiny_model_dir, tmp_path
):
    # A checkpoint without its tokenizer passes registration (config.json loads) but not the dataset checks.
    weights_only = tmp_path / "no-tokenizer"
    weights_only.mkdir()
    (weights_only / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with sessions() as session:
        registry.register_version(session, name="no-tokenizer", path=weights_only)
        session.commit()
    body = {"model": "no-tokenizer", "training_file": training_file}
    job_id = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body).json()["id"]

    assert worker.run_once() is True
    job = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
    assert job["status"] == "failed" and job["fine_tuned_model"] is None
    # Refused when its files are validated against this model, before any training.
    assert (job["error"]["code"], job["error"]["param"]) == ("invalid_training_file", "training_file")
    assert f"training_file {training_file} (t.jsonl)" in job["error"]["message"]
    assert "line 1:" in job["error"]["message"]  # the fine-tuning validator's problems, with line numbers
    with sessions() as session:
        assert session.scalars(select(ModelVersion).where(ModelVersion.job_id == job_id)).first() is None


def test_a_worker_shutting_down_checkpoints_its_job_and_puts_it_back_in_the_queue(worker, create_job, sessions):
    job_id = create_job(max_steps=400, eval_every=1000)
    thread = run_in_thread(worker)
    wait_until(lambda: last_metrics_step(sessions, job_id) >= 2)
    worker.shutdown.set()  # what SIGTERM does
    thread.join(timeout=60)
    job = job_row(sessions, job_id)
    assert (job.status, job.lease_token, job.lease_expirations) == (JobStatus.queued, None, 0)
    assert job.estimated_finish is None  # queued again: not running
    with sessions() as session:
        assert session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)).first() is not None
        messages = [e.message for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id))]
    assert "The worker shut down; job re-queued." in messages


def preference_lines(offset: int, n: int) -> bytes:
    lines = []
    for index in range(offset, offset + n):
        record = {
            "input": {"messages": [{"role": "user", "content": f"Balance of account {index}?"}]},
            "preferred_output": [{"role": "assistant", "content": f"It is {100 + index} EUR."}],
            "non_preferred_output": [{"role": "assistant", "content": "I cannot say."}],
        }
        lines.append(json.dumps(record))
    return ("\n".join(lines) + "\n").encode()


def upload(client, auth, name: str, content: bytes):
    return client.post(
        "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": (name, content)}
    )


def test_a_dpo_job_trains_on_preference_pairs_and_each_method_refuses_the_others_data(
    client, auth, worker, base_model, training_file, sessions
):
    broken = preference_lines(0, 2).replace(b'"assistant", "content": "I cannot', b'"user", "content": "I cannot', 1)
    refused = upload(client, auth, "broken.jsonl", broken)
    assert refused.status_code == 400 and "line 1: non_preferred_output[0].role" in refused.json()["error"]["message"]
    pairs = upload(client, auth, "pairs.jsonl", preference_lines(0, 6)).json()["id"]
    held_out = upload(client, auth, "held-out.jsonl", preference_lines(50, 2)).json()["id"]

    hyperparameters = {"beta": 0.2, "n_epochs": 50, "batch_size": 2, "max_steps": 3, "eval_every": 3}
    method = {"type": "dpo", "dpo": {"hyperparameters": hyperparameters, "adapter": "lora"}}
    body = {"model": base_model, "training_file": pairs, "validation_file": held_out, "method": method}
    created = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
    assert created.status_code == 200, created.text
    assert created.json()["method"]["dpo"]["hyperparameters"]["beta"] == 0.2
    # A supervised job on preference data, and a dpo job on chat data, fail their file validation.
    wrong = [
        {"model": base_model, "training_file": pairs},
        {"model": base_model, "training_file": training_file, "method": {"type": "dpo"}},
    ]
    wrong_ids = [client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=job).json()["id"] for job in wrong]

    assert worker.run_once() is True
    job = client.get(f"/v1/fine_tuning/jobs/{created.json()['id']}", headers=auth("data")).json()
    assert job["status"] == "succeeded", job
    version = next(
        v for v in client.get("/v1/admin/models", headers=auth("admin")).json()["data"] if v["job_id"] == job["id"]
    )
    assert version["kind"] == "adapter" and version["evaluation"]["preference"]["n_pairs"] == 2
    events = client.get(f"/v1/fine_tuning/jobs/{job['id']}/events?limit=100", headers=auth("data")).json()["data"]
    assert any("validation loss=" in event["message"] for event in events)  # the DPO loss on the held-out pairs

    reasons = ["train on it with method type dpo", "a dpo job needs preference data"]
    for job_id, message in zip(wrong_ids, reasons, strict=True):
        failed = client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()
        assert failed["status"] == "failed" and failed["error"]["param"] == "training_file"
        assert message in failed["error"]["message"]
