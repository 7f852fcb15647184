"""Per-project quotas: unfinished fine-tuning jobs and stored bytes. A request beyond one gets 429 naming the quota
and stores nothing; the other project is not affected; racing requests cannot both take the last place (SQLite, and
PostgreSQL in its pass). The per-key stream quota is tested with the inference service (tests/server/services)."""

from __future__ import annotations

import threading

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

from server.app import create_app
from server.db.models import File, FineTuningJob, Role
from server.services import registry


@pytest.fixture
def app(settings, valid_dataset) -> FastAPI:
    """The app of this module's tests (also behind `client` and `live_server`): a project may hold 2 unfinished jobs
    and files of 2.5 datasets' size."""
    quotas = {"project_max_concurrent_jobs": 2, "project_max_stored_bytes": len(valid_dataset) * 5 // 2}
    return create_app(settings.model_copy(update=quotas))


@pytest.fixture
def project_keys(make_project, make_key) -> dict[str, str]:
    """A data key in each of two projects."""
    return {name: make_key(Role.data, name, project_id=make_project(name))[1] for name in ("risk", "fraud")}


@pytest.fixture
def base_model(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        registry.register_version(session, name="zaya", path=tiny_model_dir)
        session.commit()
    return "zaya"


def upload(client, secret: str, dataset: bytes):
    return client.post(
        "/v1/files",
        headers={"Authorization": f"Bearer {secret}"},
        data={"purpose": "fine-tune"},
        files={"file": ("cases.jsonl", dataset)},
    )


def assert_quota_refusal(response, code: str, setting: str) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", code)
    assert setting in error["message"]


def test_a_project_holds_at_most_its_unfinished_jobs(client, project_keys, valid_dataset, base_model, sessions):
    risk, fraud = ({"Authorization": f"Bearer {project_keys[name]}"} for name in ("risk", "fraud"))
    training_file = upload(client, project_keys["risk"], valid_dataset).json()["id"]
    body = {"model": base_model, "training_file": training_file}
    made = [client.post("/v1/fine_tuning/jobs", headers=risk, json=body) for _ in range(2)]
    assert [response.status_code for response in made] == [200, 200]

    refused = client.post("/v1/fine_tuning/jobs", headers=risk, json=body)
    assert_quota_refusal(refused, "concurrent_jobs_quota_exceeded", "ZAYA_PROJECT_MAX_CONCURRENT_JOBS = 2")
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(FineTuningJob)) == 2

    # The other project has its own quota; a finished job frees a place.
    fraud_file = upload(client, project_keys["fraud"], valid_dataset).json()["id"]
    other = client.post("/v1/fine_tuning/jobs", headers=fraud, json={"model": base_model, "training_file": fraud_file})
    assert other.status_code == 200, other.text
    assert client.post(f"/v1/fine_tuning/jobs/{made[0].json()['id']}/cancel", headers=risk).status_code == 200
    assert client.post("/v1/fine_tuning/jobs", headers=risk, json=body).status_code == 200


def test_a_project_stores_at_most_its_bytes(client, project_keys, valid_dataset, settings, sessions):
    risk = project_keys["risk"]
    stored = [upload(client, risk, valid_dataset) for _ in range(2)]
    assert [response.status_code for response in stored] == [200, 200]

    refused = upload(client, risk, valid_dataset)
    assert_quota_refusal(refused, "storage_quota_exceeded", "ZAYA_PROJECT_MAX_STORED_BYTES")
    on_disk = sorted(path.name for path in settings.files_dir.iterdir() if path.is_file())
    assert on_disk == sorted(response.json()["id"] for response in stored)
    assert not any((settings.files_dir / ".incoming").iterdir())  # the refused upload's temporary file is gone
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(File)) == 2

    assert upload(client, project_keys["fraud"], valid_dataset).status_code == 200
    deleted = client.delete(f"/v1/files/{stored[0].json()['id']}", headers={"Authorization": f"Bearer {risk}"})
    assert deleted.status_code == 200
    assert upload(client, risk, valid_dataset).status_code == 200


def test_racing_jobs_cannot_both_take_the_last_place(live_server, project_keys, valid_dataset, base_model, sessions):
    headers = {"Authorization": f"Bearer {project_keys['risk']}"}
    with httpx.Client(base_url=live_server, headers=headers, timeout=60) as first:
        uploaded = first.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", valid_dataset)})
        body = {"model": base_model, "training_file": uploaded.json()["id"]}
        assert first.post("/v1/fine_tuning/jobs", json=body).status_code == 200
    statuses: list[int] = []
    start = threading.Barrier(4)

    def create() -> None:
        with httpx.Client(base_url=live_server, headers=headers, timeout=60) as racer:
            start.wait()
            statuses.append(racer.post("/v1/fine_tuning/jobs", json=body).status_code)

    racers = [threading.Thread(target=create) for _ in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    assert sorted(statuses) == [200, 429, 429, 429]
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(FineTuningJob)) == 2
