"""`/v1/fine_tuning/jobs` through the official `openai` client against a real uvicorn server, plus bad input."""

from __future__ import annotations

import io

import openai
import pytest

from server.db.models import Checkpoint, File, FineTuningJob, JobEvent
from server.jobs.worker import Worker, WorkerConfig
from server.services import registry


@pytest.fixture
def base_model(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        session.commit()
    return "zaya-tiny"


@pytest.fixture
def data_client(live_server, keys):
    with openai.OpenAI(base_url=f"{live_server}/v1", api_key=keys["data"], max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture
def training_file(data_client, valid_dataset) -> str:
    return data_client.files.create(file=("train.jsonl", io.BytesIO(valid_dataset)), purpose="fine-tune").id


def test_create_list_retrieve_cancel_with_the_openai_client(data_client, base_model, training_file, settings, sessions):
    job = data_client.fine_tuning.jobs.create(
        model=base_model,
        training_file=training_file,
        suffix="bank-disputes",
        seed=42,
        metadata={"team": "risk"},
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {"n_epochs": 2, "batch_size": 1, "learning_rate_multiplier": 0.5},
                "adapter": "lora",
                "lora": {"r": 4, "alpha": 8},
            },
        },
    )
    assert job.object == "fine_tuning.job" and job.id.startswith("ftjob-")
    assert (job.status, job.model, job.training_file, job.seed) == ("validating_files", base_model, training_file, 42)
    assert job.fine_tuned_model is None and job.finished_at is None and job.error is None
    assert job.method.type == "supervised"
    assert job.method.supervised.hyperparameters.n_epochs == 2
    assert job.hyperparameters.learning_rate_multiplier == 0.5
    assert job.metadata == {"team": "risk"}

    second = data_client.fine_tuning.jobs.create(model=base_model, training_file=training_file)
    assert second.method.supervised.hyperparameters.batch_size == "auto" and 0 <= second.seed < 2**31

    assert data_client.fine_tuning.jobs.retrieve(job.id).id == job.id
    first_page = data_client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in first_page.data] == [second.id] and first_page.has_more
    assert [j.id for j in data_client.fine_tuning.jobs.list(limit=1, after=second.id).data] == [job.id]
    assert [j.id for j in data_client.fine_tuning.jobs.list()] == [second.id, job.id]  # auto-paginates
    assert [j.id for j in data_client.fine_tuning.jobs.list(metadata={"team": "risk"})] == [job.id]

    events = list(data_client.fine_tuning.jobs.list_events(job.id, limit=1))
    assert len(events) == 2 and all(e.object == "fine_tuning.job.event" for e in events)  # auto-paginated by id
    assert events[0].message == "Validating the training and validation files." and events[0].level == "info"
    assert list(data_client.fine_tuning.jobs.checkpoints.list(job.id)) == []

    cancelled = data_client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    with pytest.raises(openai.ConflictError):
        data_client.fine_tuning.jobs.cancel(job.id)
    with pytest.raises(openai.ConflictError):
        data_client.fine_tuning.jobs.resume(job.id)

    with pytest.raises(openai.ConflictError):  # only a queued (validated) job can be held
        data_client.fine_tuning.jobs.pause(second.id)
    Worker(settings, sessions, WorkerConfig()).validate_pending()
    assert data_client.fine_tuning.jobs.retrieve(second.id).status == "queued"
    assert data_client.fine_tuning.jobs.pause(second.id).status == "paused"
    with pytest.raises(openai.ConflictError):
        data_client.fine_tuning.jobs.pause(second.id)
    assert data_client.fine_tuning.jobs.resume(second.id).status == "queued"

    with pytest.raises(openai.NotFoundError):
        data_client.fine_tuning.jobs.retrieve("ftjob-missing")


def test_checkpoints_are_listed_in_openai_s_shape(data_client, base_model, training_file, sessions):
    job = data_client.fine_tuning.jobs.create(model=base_model, training_file=training_file, suffix="s")
    with sessions() as session:
        for step in (2, 4):
            session.add(Checkpoint(job_id=job.id, step=step, path=f"/c/{step}", metrics={"train_loss": 1.0 / step}))
        session.commit()
    checkpoints = list(data_client.fine_tuning.jobs.checkpoints.list(job.id))
    assert [c.step_number for c in checkpoints] == [4, 2]
    assert checkpoints[0].object == "fine_tuning.job.checkpoint"
    assert checkpoints[0].fine_tuned_model_checkpoint == f"ft:zaya-tiny:zaya:s:{job.id}:ckpt-step-4"
    assert checkpoints[0].metrics.train_loss == 0.25 and checkpoints[0].metrics.step == 4


def error_of(response) -> dict:
    assert 400 <= response.status_code < 500, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"model": "no-such-model"}, 404, "model"),
        ({"training_file": "file-missing"}, 400, "training_file"),
        ({"validation_file": "file-missing"}, 400, "validation_file"),
        ({"method": {"type": "reinforcement"}}, 400, "method.type"),
        ({"method": {"type": "dpo", "supervised": {}}}, 400, "method.supervised"),
        ({"method": {"supervised": {"hyperparameters": {"beta": 0.1}}}}, 400, "method.supervised.hyperparameters.beta"),
        (
            {"method": {"supervised": {"hyperparameters": {"n_epochs": 0}}}},
            400,
            "method.supervised.hyperparameters.n_epochs",
        ),
        (
            {"method": {"supervised": {"hyperparameters": {"n_epochs": "many"}}}},
            400,
            "method.supervised.hyperparameters.n_epochs",
        ),
        (
            {"method": {"supervised": {"hyperparameters": {"n_epochs": "3"}}}},
            400,
            "method.supervised.hyperparameters.n_epochs",
        ),
        ({"method": {"supervised": {"hyperparameters": {"learning_rate_multiplier": -1.0}}}}, 400, None),
        (
            {"method": {"supervised": {"hyperparameters": {"batch_size": 1.5}}}},
            400,
            "method.supervised.hyperparameters.batch_size",
        ),
        ({"method": {"supervised": {"adapter": "qlora"}}}, 400, "method.supervised.adapter"),
        ({"method": {"supervised": {"lora": {"r": 0}}}}, 400, "method.supervised.lora.r"),
        (
            {"method": {"supervised": {"hyperparameters": {"keep_checkpoints": 0}}}},
            400,
            "method.supervised.hyperparameters.keep_checkpoints",
        ),
        ({"method": {"supervised": {"hyperparameters": {"keep_checkpoints": 1.5}}}}, 400, None),
        (
            {"method": {"supervised": {"adapter": "full", "hyperparameters": {"balancing_bias_lr": -0.1}}}},
            400,
            "method.supervised.hyperparameters.balancing_bias_lr",
        ),
        (
            {"method": {"supervised": {"adapter": "full", "hyperparameters": {"balancing_bias_lr": 1.5}}}},
            400,
            "method.supervised.hyperparameters.balancing_bias_lr",
        ),
        ({"method": {"supervised": {"hyperparameters": {"balancing_bias_lr": "fast"}}}}, 400, None),
        (
            {"method": {"supervised": {"adapter": "full", "merge_adapter": True}}},
            400,
            "method.supervised.merge_adapter",
        ),
        (
            {"method": {"supervised": {"hyperparameters": {"early_stopping_patience": 2}}}},
            400,
            "method.supervised.hyperparameters.early_stopping_patience",
        ),
        ({"method": {"supervised": {"lora": {"rank": 8}}}}, 400, "method.supervised.lora.rank"),
        ({"suffix": "has spaces"}, 400, "suffix"),
        ({"seed": -1}, 400, "seed"),
        ({"hyperparameters": {"n_epochs": 2}, "method": {"type": "supervised"}}, 400, "hyperparameters"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/estimate"])
def test_bad_job_requests_get_a_clear_4xx_and_create_nothing(
    client, auth, base_model, valid_dataset, sessions, change, status, param, path
):
    file_id = client.post(
        "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", valid_dataset)}
    ).json()["id"]
    body = {"model": base_model, "training_file": file_id, **change}
    response = client.post(path, headers=auth("data"), json=body)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    with sessions() as session:
        assert session.query(FineTuningJob).count() == 0 and session.query(JobEvent).count() == 0


def test_files_of_the_wrong_purpose_deleted_files_and_adapters_are_refused(
    client, auth, base_model, valid_dataset, sessions, tiny_adapter_dir
):
    with sessions() as session:
        other = File(filename="a.jsonl", purpose="assistants", bytes=1, sha256="0" * 64)
        session.add(other)
        registry.register_version(
            session, name="an-adapter", path=tiny_adapter_dir, base_version_id=registry.list_versions(session)[0].id
        )
        session.commit()
        other_id = other.id
    file_id = client.post(
        "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", valid_dataset)}
    ).json()["id"]

    wrong_purpose = client.post(
        "/v1/fine_tuning/jobs", headers=auth("data"), json={"model": base_model, "training_file": other_id}
    )
    assert error_of(wrong_purpose)["code"] == "invalid_file_purpose"
    adapter = client.post(
        "/v1/fine_tuning/jobs", headers=auth("data"), json={"model": "an-adapter", "training_file": file_id}
    )
    assert error_of(adapter)["code"] == "model_not_trainable"

    body = {"model": base_model, "training_file": file_id}
    job = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
    assert job.status_code == 200
    assert client.delete(f"/v1/files/{file_id}", headers=auth("data")).status_code == 409  # in use by a queued job
    client.post(f"/v1/fine_tuning/jobs/{job.json()['id']}/cancel", headers=auth("data"))
    assert client.delete(f"/v1/files/{file_id}", headers=auth("data")).status_code == 200
    deleted = client.post(
        "/v1/fine_tuning/jobs", headers=auth("data"), json={"model": base_model, "training_file": file_id}
    )
    assert error_of(deleted)["code"] == "file_not_found"


def test_job_mutations_are_audited(client, auth, base_model, valid_dataset):
    file_id = client.post(
        "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", valid_dataset)}
    ).json()["id"]
    job_id = client.post(
        "/v1/fine_tuning/jobs", headers=auth("data"), json={"model": base_model, "training_file": file_id}
    ).json()["id"]
    client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", headers=auth("data"))
    entries = client.get("/v1/admin/audit", headers=auth("admin")).json()["data"]
    actions = [(entry["action"], entry["target"], entry["outcome"]) for entry in entries[:2]]
    assert actions == [("fine_tuning.jobs.cancel", job_id, "success"), ("fine_tuning.jobs.create", job_id, "success")]
