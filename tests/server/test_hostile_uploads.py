"""Hostile uploads to `POST /v1/files` over real HTTP: each is refused with a clear 4xx and leaves no file or row, or
(names; PII per `ZAYA_UPLOAD_PII_SCAN`) is accepted in a documented way. The endless upload is in `test_limits.py`."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from server.app import create_app
from server.db.models import File

PII_DATASET = b"".join(
    json.dumps(
        {
            "messages": [
                {"role": "user", "content": f"Customer jane.doe{i}@example.com, IBAN DE89370400440532013000."},
                {"role": "assistant", "content": f"Card 4111 1111 1111 1111, SSN 078-05-112{i}, +49 30 1234567{i}."},
            ]
        }
    ).encode()
    + b"\n"
    for i in range(5)
)


@pytest.fixture
def upload(live_server, auth):
    def send(content: bytes, filename: str | bytes = "train.jsonl") -> httpx.Response:
        if isinstance(filename, bytes):  # raw bytes in the part header, as a hostile client may send them
            return raw_multipart(live_server, auth("data"), content, filename)
        return httpx.post(
            f"{live_server}/v1/files",
            headers=auth("data"),
            data={"purpose": "fine-tune"},
            files={"file": (filename, content)},
            timeout=60,
        )

    return send


def raw_multipart(base_url: str, headers: dict, content: bytes, filename: bytes) -> httpx.Response:
    body = b"".join(
        [
            b'--hostile\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n',
            b'--hostile\r\nContent-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n\r\n',
            content,
            b"\r\n--hostile--\r\n",
        ]
    )
    content_type = {"Content-Type": "multipart/form-data; boundary=hostile"}
    return httpx.post(f"{base_url}/v1/files", headers={**headers, **content_type}, content=body, timeout=60)


def assert_refused_without_a_trace(response: httpx.Response, settings, sessions, *, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and error["message"]
    assert [path for path in settings.files_dir.rglob("*") if path.is_file()] == []
    with sessions() as session:
        assert session.scalars(select(File)).all() == []
    return error


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "deeply nested JSON"),
        (b'{"messages": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}\n", "deeply nested objects"),
        (b'{"text": "' + b"a" * 1024 * 200 + b"\n", "a 200 KB line that never closes"),
        (b'{"text": "ok"}\n\x00\x00\x00\n', "NUL bytes"),
        (b'{"text": "bad \xff\xfe utf-8"}\n', "invalid UTF-8"),
        (b'{"text": "\\ud800 lone surrogate"}\n', "a lone surrogate escape"),
        (b"\x1f\x8b\x08\x00" + b"\x00" * 64, "a gzip stream"),
        (b"", "an empty file"),
    ],
)
def test_hostile_content_is_400_and_leaves_nothing(upload, settings, sessions, content, why):
    assert_refused_without_a_trace(upload(content), settings, sessions)


def test_a_1_mb_single_line_is_read_and_refused_on_its_merits(live_server, auth, settings, sessions):
    line = json.dumps({"messages": [{"role": "user", "content": "x" * 1024**2}]}).encode() + b"\n"
    response = httpx.post(
        f"{live_server}/v1/files",
        headers=auth("data"),
        data={"purpose": "fine-tune"},
        files={"file": ("one-line.jsonl", line)},
        timeout=60,
    )
    # Over the test's 256 KiB upload limit: 413, nothing kept.
    assert_refused_without_a_trace(response, settings, sessions, status=413)


@pytest.mark.parametrize(
    ("filename", "stored"),
    [
        ("../../etc/passwd", "../../etc/passwd"),
        ("/abs/path/train.jsonl", "/abs/path/train.jsonl"),
        ("..\\..\\windows\\train.jsonl", "..\\..\\windows\\train.jsonl"),
        (b"caf\xe9-latin1.jsonl", "caf\ufffd-latin1.jsonl"),
        ("x" * 2000 + ".jsonl", "x" * 512),
    ],
)
def test_hostile_filenames_are_only_labels(upload, valid_dataset, settings, sessions, filename, stored):
    """A filename is metadata: content is stored under the file's id, never under a client-given path."""
    response = upload(valid_dataset, filename)
    assert response.status_code == 200, response.text
    file_id = response.json()["id"]
    assert response.json()["filename"] == stored
    assert sorted(path.name for path in settings.files_dir.rglob("*") if path.is_file()) == [file_id]
    with sessions() as session:
        assert session.get(File, file_id).filename == stored


@pytest.mark.parametrize("policy", ["off", "report", "reject"])
def test_a_dataset_that_is_all_pii_follows_the_upload_pii_policy(settings, sessions, make_key, valid_dataset, policy):
    """`ZAYA_UPLOAD_PII_SCAN`: off stores it as is, report stores it with the findings in `status_details`, reject
    refuses it with the findings and leaves nothing behind; a clean file passes every policy."""
    app = create_app(settings.model_copy(update={"upload_pii_scan": policy}))
    headers = {"Authorization": f"Bearer {make_key('data')[1]}"}
    with TestClient(app) as client:

        def send(content: bytes):
            files = {"file": ("train.jsonl", content)}
            return client.post("/v1/files", headers=headers, data={"purpose": "fine-tune"}, files=files)

        response = send(PII_DATASET)
        if policy == "reject":
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "pii_detected" and error["param"] == "file"
            assert "EMAIL 5 (lines 1, 2, 3, 4, 5)" in error["message"] and "IBAN" in error["message"]
            assert [path for path in settings.files_dir.rglob("*") if path.is_file()] == []
            with sessions() as session:
                assert session.scalars(select(File)).all() == []
        else:
            assert response.status_code == 200, response.text
            assert (settings.files_dir / response.json()["id"]).read_bytes() == PII_DATASET
            details = response.json()["status_details"]
            if policy == "off":
                assert details is None
            else:
                assert details.startswith("PII scan: ") and "CARD_NUMBER 5" in details and "US_SSN" in details
        clean = send(valid_dataset)
        assert clean.status_code == 200, clean.text
        assert clean.json()["status_details"] == (None if policy == "off" else "PII scan: nothing found.")
