"""A file's validation and PII reports are computed once per content and stored: the console's dataset page, job
estimates and the worker's check of a new job read them back instead of reading the file again."""

from __future__ import annotations

import re
import threading
import time

import pytest
from sqlalchemy import select

import finetune.datasets.validation
import server.console.datasets
import server.services.files
from finetune.datasets.pii import scan_file
from finetune.datasets.validation import validate_dataset
from server.db.models import DatasetReport, File
from server.jobs.worker import Worker, WorkerConfig
from server.services import dataset_reports, registry

BASE_MODEL = "zaya-tiny"


@pytest.fixture
def computations(monkeypatch) -> dict[str, int]:
    """How often the validator and the PII scan really ran (the real functions, counted on the way through)."""
    counts = {"validate": 0, "pii": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    for module in (finetune.datasets.validation, server.console.datasets, server.services.files):
        monkeypatch.setattr(module, "validate_dataset", counted("validate", validate_dataset))
    for module in (server.console.datasets, server.services.files):
        monkeypatch.setattr(module, "scan_file", counted("pii", scan_file))
    return counts


@pytest.fixture
def auth(keys):
    return lambda role: {"Authorization": f"Bearer {keys[role]}"}


@pytest.fixture
def signed_in(client, keys, sign_in, csrf_of):
    sign_in(client, keys["data"])
    return {"X-CSRF-Token": csrf_of(client, "/console/datasets")}


def upload(client, headers, content: bytes) -> str:
    response = client.post(
        "/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", content)}, headers=headers
    )
    assert response.status_code == 200, response.text
    return response.json()["id"]


def report_sections(client, file_id: str, **params) -> list[str]:
    page = client.get(f"/console/datasets/{file_id}", params=params, headers={"Accept": "text/html"})
    assert page.status_code == 200, page.text
    return [
        re.search(rf'<p id="{name}"[^>]*>(.*?)</p>', page.text, re.S).group(1)
        for name in ("validation-verdict", "pii-summary")
    ] + [re.search(r'<table class="data compact" id="pii-table">(.*?)</table>', page.text, re.S).group(1)]


def stored(sessions, sha256: str) -> list[tuple[str, str]]:
    with sessions() as session:
        rows = session.execute(
            select(DatasetReport.project_id, DatasetReport.kind).where(DatasetReport.sha256 == sha256)
        ).all()
    return sorted((project, kind) for project, kind in rows)


def test_page_views_estimates_and_the_job_reuse_one_computation(
    client, auth, signed_in, sessions, settings, tiny_model_dir, valid_dataset, computations
):
    file_id = upload(client, signed_in, valid_dataset)
    assert computations == {"validate": 1, "pii": 0}  # the upload's check (no tokenizer); PII scan is off

    # No model yet: the page shows the upload's report, and scans for PII once.
    first = report_sections(client, file_id)
    assert "Valid" in first[0] and "5 examples in 5 lines" in first[0]
    assert computations == {"validate": 1, "pii": 1}
    assert report_sections(client, file_id) == first
    assert computations == {"validate": 1, "pii": 1}

    # With a model: the report with its tokenizer is computed on the first view only.
    with sessions() as session:
        registry.register_version(session, name=BASE_MODEL, path=tiny_model_dir)
        session.commit()
    tokenized = report_sections(client, file_id, model=BASE_MODEL, line=2)
    assert computations == {"validate": 2, "pii": 1}
    for line in (2, 3):
        assert report_sections(client, file_id, model=BASE_MODEL, line=line) == tokenized
    assert computations == {"validate": 2, "pii": 1}
    from transformers import AutoTokenizer

    path = settings.files_dir / file_id
    fresh = validate_dataset(path, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert f"{fresh.n_tokens} tokens of which" in tokenized[0] and str(fresh.n_trained_tokens) in tokenized[0]

    # Estimates: the job's checks (its length limit) are computed once; the job the estimate leads to reuses them.
    body = {"model": BASE_MODEL, "training_file": file_id, "method": {"supervised": {"hyperparameters": {}}}}
    estimates = [client.post("/v1/fine_tuning/jobs/estimate", headers=auth("data"), json=body) for _ in range(2)]
    assert [response.status_code for response in estimates] == [200, 200], estimates[0].text
    assert estimates[0].json() == estimates[1].json()
    assert computations == {"validate": 3, "pii": 1}
    job = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
    assert job.status_code == 200, job.text
    Worker(settings, sessions, WorkerConfig(), worker_id="validator").validate_pending()
    assert client.get(f"/v1/fine_tuning/jobs/{job.json()['id']}", headers=auth("data")).json()["status"] == "queued"
    assert computations == {"validate": 3, "pii": 1}

    with sessions() as session:
        file = session.get_one(File, file_id)
    project = file.project_id
    assert stored(sessions, file.sha256) == [(project, "pii")] + [(project, "validation")] * 3


def test_reports_stay_in_their_project_and_go_with_the_last_file_of_their_content(
    client, auth, signed_in, sessions, valid_dataset, make_project, make_key, computations
):
    first, second = upload(client, signed_in, valid_dataset), upload(client, signed_in, valid_dataset)
    report_sections(client, first)
    report_sections(client, second)  # the same content: read back
    assert computations == {"validate": 2, "pii": 1}
    with sessions() as session:
        file = session.get_one(File, first)
    assert len(stored(sessions, file.sha256)) == 2

    # Another project with the same content computes its own: a stored report says nothing across projects.
    _, other_secret = make_key("data", project_id=make_project("other-team"))
    other = client.post(
        "/v1/files",
        headers={"Authorization": f"Bearer {other_secret}"},
        data={"purpose": "fine-tune"},
        files={"file": ("t.jsonl", valid_dataset)},
    )
    assert other.status_code == 200, other.text
    assert computations == {"validate": 3, "pii": 1}
    assert len(stored(sessions, file.sha256)) == 3

    assert client.delete(f"/v1/files/{first}", headers=signed_in).status_code == 200
    assert len(stored(sessions, file.sha256)) == 3  # `second` has the same content
    assert client.delete(f"/v1/files/{second}", headers=signed_in).status_code == 200
    with sessions() as session:
        other_project = session.get_one(File, other.json()["id"]).project_id
    assert stored(sessions, file.sha256) == [(other_project, "validation")]


def test_callers_asking_at_once_wait_for_one_computation(client, signed_in, sessions, valid_dataset):
    file_id = upload(client, signed_in, valid_dataset)
    calls = []

    def compute():
        calls.append(threading.get_ident())
        time.sleep(0.3)
        return {"answer": 42}

    results = []

    def ask():
        with sessions() as session:
            file = session.get_one(File, file_id)
            results.append(dataset_reports.stored_report(session, file, "test", {"n": 1}, compute))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert [report for report, _ in results] == [{"answer": 42}] * 4
    with sessions() as session:
        assert len(session.scalars(select(DatasetReport).where(DatasetReport.kind == "test")).all()) == 1
