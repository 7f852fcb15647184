"""OpenAI files API, driven by the official `openai` client against a real uvicorn server."""

from __future__ import annotations

import hashlib
import socket
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest
from sqlalchemy import select

from server.db.models import DEFAULT_PROJECT_ID, File, FineTuningJob, JobStatus


@pytest.fixture
def openai_client(live_server, keys):
    with openai.OpenAI(base_url=f"{live_server}/v1", api_key=keys["data"], max_retries=0, timeout=30) as client:
        yield client


def stored_files(settings) -> list[str]:
    """Every file under the upload directory, temp files included."""
    return sorted(str(path.relative_to(settings.files_dir)) for path in settings.files_dir.rglob("*") if path.is_file())


def file_rows(sessions) -> list[File]:
    with sessions() as session:
        return list(session.scalars(select(File)))


def test_upload_list_retrieve_content_delete(openai_client, valid_dataset, settings, sessions):
    created = openai_client.files.create(file=("train.jsonl", valid_dataset), purpose="fine-tune")
    assert created.id.startswith("file-")
    assert (created.object, created.purpose, created.filename, created.bytes) == (
        "file",
        "fine-tune",
        "train.jsonl",
        len(valid_dataset),
    )
    assert created.status == "processed"
    assert abs(created.created_at - time.time()) < 60

    assert openai_client.files.retrieve(created.id) == created
    assert [file.id for file in openai_client.files.list()] == [created.id]
    assert openai_client.files.content(created.id).content == valid_dataset

    row = file_rows(sessions)[0]
    assert row.sha256 == hashlib.sha256(valid_dataset).hexdigest()
    assert stored_files(settings) == [created.id]

    deleted = openai_client.files.delete(created.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (created.id, True, "file")
    assert stored_files(settings) == []
    assert list(openai_client.files.list()) == []
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.files.content(created.id)


def test_list_pages_with_after_and_order(openai_client, valid_dataset):
    ids = [openai_client.files.create(file=(f"{i}.jsonl", valid_dataset), purpose="fine-tune").id for i in range(3)]
    newest_first = list(reversed(ids))
    first_page = openai_client.files.list(limit=2)
    assert [file.id for file in first_page.data] == newest_first[:2] and first_page.has_more
    # Iterating a page makes the client follow `after` through every page.
    assert [file.id for file in openai_client.files.list(limit=2)] == newest_first
    assert [file.id for file in openai_client.files.list(order="asc")] == ids
    assert [file.id for file in openai_client.files.list(purpose="batch")] == []


def test_oversized_upload_is_413_and_leaves_nothing(openai_client, settings, sessions):
    too_big = b'{"text": "' + b"a" * settings.max_upload_bytes + b'"}\n'
    with pytest.raises(openai.APIStatusError) as error:
        openai_client.files.create(file=("big.jsonl", too_big), purpose="fine-tune")
    assert error.value.status_code == 413
    assert error.value.body["type"] == "invalid_request_error"
    assert stored_files(settings) == []
    assert file_rows(sessions) == []


def test_wrong_purpose_is_400_naming_purpose(openai_client, valid_dataset, settings, sessions):
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.files.create(file=("train.jsonl", valid_dataset), purpose="assistants")
    assert error.value.param == "purpose"
    assert stored_files(settings) == [] and file_rows(sessions) == []


def test_invalid_dataset_is_400_with_line_numbers(openai_client, settings, sessions):
    bad = b'{"prompt": "hi", "completion": "there"}\nnot json\n{"prompt": "only a prompt"}\n'
    with pytest.raises(openai.BadRequestError) as error:
        openai_client.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert error.value.param == "file"
    assert "line 2" in error.value.message and "line 3" in error.value.message
    assert "line 1" not in error.value.message
    assert stored_files(settings) == [] and file_rows(sessions) == []


def test_deleting_a_file_used_by_an_active_job_is_409(openai_client, valid_dataset, sessions):
    training = openai_client.files.create(file=("train.jsonl", valid_dataset), purpose="fine-tune")
    validation = openai_client.files.create(file=("valid.jsonl", valid_dataset), purpose="fine-tune")
    with sessions() as session:
        job = FineTuningJob(
            model="zaya-tiny",
            training_file_id=training.id,
            validation_file_id=validation.id,
            status=JobStatus.queued,
            project_id=DEFAULT_PROJECT_ID,
        )
        session.add(job)
        session.commit()
        for status in (JobStatus.queued, JobStatus.running):
            job.status = status
            session.commit()
            for file_id in (training.id, validation.id):
                with pytest.raises(openai.ConflictError):
                    openai_client.files.delete(file_id)
        job.status = JobStatus.succeeded
        session.commit()
    assert openai_client.files.delete(training.id).deleted


def test_upload_without_a_file_or_multipart_is_400(live_server, auth):
    with httpx.Client(base_url=live_server, headers=auth("data")) as client:
        no_file = client.post("/v1/files", data={"purpose": "fine-tune"}, files={"other": ("x", b"y")})
        assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
        not_multipart = client.post("/v1/files", json={"purpose": "fine-tune"})
        assert not_multipart.status_code == 400


def test_a_client_that_disconnects_mid_upload_leaves_nothing(live_server, keys, settings, sessions):
    address = urlparse(live_server)
    boundary = "zaya-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
    ).encode()
    partial = head + b'{"text": "' + b"a" * 20_000
    request = (
        f"POST /v1/files HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {keys['data']}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(partial) + 100_000}\r\n\r\n"
    ).encode()
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(request + partial)
        assert wait_for(lambda: any(name.endswith(".part") for name in stored_files(settings)))
    assert wait_for(lambda: stored_files(settings) == [])
    assert file_rows(sessions) == []


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_multipart_body_without_its_closing_boundary_is_refused(live_server, auth, settings, sessions):
    boundary = "cut-short"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
        '{"text": "the rest never comes'
    ).encode()
    headers = {**auth("data"), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    response = httpx.post(f"{live_server}/v1/files", headers=headers, content=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    assert stored_files(settings) == [] and file_rows(sessions) == []
