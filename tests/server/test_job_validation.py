"""`validating_files` is a state the API shows: a new job waits in it until a worker has checked its files with the
fine-tuning validator against the job's base model, then it is queued, or failed with an error naming file and line."""

from __future__ import annotations

import pytest

from server.jobs.worker import Worker, WorkerConfig
from server.services import registry


@pytest.fixture
def base_model(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        session.commit()
    return "zaya-tiny"


@pytest.fixture
def upload(client, auth):
    def make(content: bytes, filename: str = "train.jsonl") -> str:
        response = client.post(
            "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": (filename, content)}
        )
        assert response.status_code == 200, response.text
        return response.json()["id"]

    return make


@pytest.fixture
def worker(settings, sessions) -> Worker:
    return Worker(settings, sessions, WorkerConfig(), worker_id="validator")


def create(client, auth, **body) -> dict:
    response = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
    assert response.status_code == 200, response.text
    return response.json()


def get(client, auth, job_id: str) -> dict:
    return client.get(f"/v1/fine_tuning/jobs/{job_id}", headers=auth("data")).json()


def messages(client, auth, job_id: str) -> list[str]:
    events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events", headers=auth("data")).json()["data"]
    return [event["message"] for event in reversed(events)]


def test_a_new_job_is_validating_files_until_a_worker_queues_it(
    client, auth, base_model, upload, valid_dataset, worker
):
    job = create(client, auth, model=base_model, training_file=upload(valid_dataset))
    assert job["status"] == "validating_files"
    assert get(client, auth, job["id"])["status"] == "validating_files"
    pause = client.post(f"/v1/fine_tuning/jobs/{job['id']}/pause", headers=auth("data"))
    assert pause.status_code == 409 and "validating_files" in pause.json()["error"]["message"]

    assert worker.validate_pending() == [job["id"]]
    queued = get(client, auth, job["id"])
    assert queued["status"] == "queued" and queued["error"] is None
    assert messages(client, auth, job["id"])[-1] == "Files validated; job queued."
    assert worker.validate_pending() == []


def test_a_file_that_fails_validation_at_job_start_fails_the_job_naming_file_and_line(
    client, auth, base_model, upload, valid_dataset, worker
):
    # Valid on upload (no model known then), too long for this job's max_seq_len once templated for its model.
    training_file = upload(valid_dataset, "disputes.jsonl")
    method = {"type": "supervised", "supervised": {"hyperparameters": {"max_seq_len": 8}}}
    job = create(client, auth, model=base_model, training_file=training_file, method=method)

    assert worker.run_once() is True  # validated (and failed); nothing was claimed
    failed = get(client, auth, job["id"])
    assert failed["status"] == "failed" and failed["finished_at"] is not None
    error = failed["error"]
    assert (error["code"], error["param"]) == ("invalid_training_file", "training_file")
    assert f"training_file {training_file} (disputes.jsonl)" in error["message"]
    assert "line 1: " in error["message"] and "more than max_seq_len 8" in error["message"]
    assert messages(client, auth, job["id"])[-1].startswith("File validation failed: training_file")
    # A failed job no longer holds its file.
    assert client.delete(f"/v1/files/{training_file}", headers=auth("data")).status_code == 200


def test_the_validation_file_is_checked_too_and_a_cancelled_job_is_left_alone(
    client, auth, base_model, upload, valid_dataset, worker
):
    training_file = upload(valid_dataset)
    overlapping = upload(valid_dataset.splitlines(keepends=True)[0], "valid.jsonl")
    job = create(client, auth, model=base_model, training_file=training_file, validation_file=overlapping)
    cancelled = create(client, auth, model=base_model, training_file=training_file)
    client.post(f"/v1/fine_tuning/jobs/{cancelled['id']}/cancel", headers=auth("data"))

    worker.validate_pending()
    error = get(client, auth, job["id"])["error"]
    assert error["param"] == "training_file" and "line 1: " in error["message"]
    assert "line 1 of the other (validation) file" in error["message"]
    assert get(client, auth, cancelled["id"])["status"] == "cancelled"
