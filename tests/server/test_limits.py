"""Per-key rate limits (429 + Retry-After) and body size limits (413) that hold for chunked bodies, over real HTTP."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from sqlalchemy import select

from server.api.limits import MULTIPART_OVERHEAD_BYTES
from server.db.models import ApiKey, File, InferenceRecord, ModelVersion

REQUESTS_PER_WINDOW = 3
TOKENS_PER_WINDOW = 100
WINDOW_S = 2
# Long enough that a window cannot end while a test generates (its tests never wait for it to end).
LONG_WINDOW_S = 60
MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture
def settings(settings, request):
    """Small limits and a short window (or `LONG_WINDOW_S`, parametrized indirectly), so a test sees a window end
    without waiting a minute."""
    return settings.model_copy(
        update={
            "rate_limit_requests_per_minute": REQUESTS_PER_WINDOW,
            "rate_limit_tokens_per_minute": TOKENS_PER_WINDOW,
            "rate_limit_window_s": getattr(request, "param", WINDOW_S),
            "max_request_bytes": MAX_REQUEST_BYTES,
        }
    )


def assert_rate_limited(response: httpx.Response, *, retry_after: bool = True, window_s: int = WINDOW_S) -> None:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    if retry_after:
        assert 1 <= int(response.headers["retry-after"]) <= window_s
    else:
        assert "retry-after" not in response.headers


def test_requests_over_the_limit_get_429_with_retry_after_per_key(live_server, auth):
    with httpx.Client(base_url=live_server) as client:
        for _ in range(REQUESTS_PER_WINDOW):
            assert client.get("/v1/models", headers=auth("analyst")).status_code == 200
        refused = client.get("/v1/models", headers=auth("analyst"))
        assert_rate_limited(refused)
        # Other keys have their own budget.
        assert client.get("/v1/models", headers=auth("data")).status_code == 200
        # Refusals are not counted: once the window ends the key has its whole budget back.
        time.sleep(int(refused.headers["retry-after"]) + 0.05)
        for _ in range(REQUESTS_PER_WINDOW):
            assert client.get("/v1/models", headers=auth("analyst")).status_code == 200


@pytest.fixture
def model_name(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        session.add(ModelVersion(name="tiny", version=1, kind="full", path=str(tiny_model_dir)))
        session.commit()
    return "tiny"


@pytest.mark.parametrize("settings", [LONG_WINDOW_S], indirect=True)
def test_tokens_over_the_limit_get_429_counting_prompt_and_max_tokens(live_server, auth, sessions, model_name):
    def complete(role: str, max_tokens: int) -> httpx.Response:
        # Three prompt tokens: each call costs 3 + max_tokens.
        body = {"model": model_name, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0}
        return client.post("/v1/completions", json=body, headers=auth(role))

    with httpx.Client(base_url=live_server, timeout=60) as client:
        assert complete("analyst", 40).status_code == 200  # 43 tokens
        assert complete("analyst", 40).status_code == 200  # 86
        refused = complete("analyst", 40)  # 129 > 100
        assert_rate_limited(refused, window_s=LONG_WINDOW_S)
        assert refused.json()["error"]["param"] == "max_tokens"
        assert complete("data", 40).status_code == 200

        # A request that could never fit the limit says so, without a Retry-After to wait for in vain.
        too_big = complete("admin", 150)
        assert_rate_limited(too_big, retry_after=False)
        assert "more than this key's limit" in too_big.json()["error"]["message"]

    with sessions() as session:
        statuses = sorted(record.status_code for record in session.scalars(select(InferenceRecord)))
    assert statuses == [200, 200, 200, 429, 429]


def chunked(*parts: bytes):
    """A generator body: httpx sends it chunked, without a Content-Length."""

    def body():
        yield from parts

    return body()


def test_a_chunked_json_body_over_the_limit_is_413(live_server, auth, sessions):
    headers = {**auth("admin"), "Content-Type": "application/json"}
    small = json.dumps({"name": "chunked", "role": "analyst"}).encode()
    accepted = httpx.post(f"{live_server}/v1/admin/keys", headers=headers, content=chunked(small[:10], small[10:]))
    assert accepted.status_code == 200, accepted.text

    padding = b" " * (MAX_REQUEST_BYTES // 4)
    response = httpx.post(
        f"{live_server}/v1/admin/keys", headers=headers, content=chunked(small[:-1], *[padding] * 5, b"}")
    )
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"
    with sessions() as session:
        assert session.scalars(select(ApiKey.name).where(ApiKey.name == "chunked")).all() == ["chunked"]


def test_a_declared_oversized_upload_is_413_before_its_body_is_read(live_server, keys):
    address = urlparse(live_server)
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {keys['data']}\r\n"
        f"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: {10**12}\r\n\r\n"
    ).encode()
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(head)  # and not one byte of the terabyte it announces
        answer = sock.makefile("rb").readline()
    assert answer.split()[1] == b"413"


def test_an_endless_chunked_upload_stops_at_the_limit_without_a_trace(live_server, auth, settings, sessions):
    """A 'multi-GB' upload made lazily: the server refuses it at the limit and reads little more than that."""
    boundary = "endless"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="huge.jsonl"\r\n\r\n'
    ).encode()
    line = b'{"text": "' + b"a" * 1000 + b'"}\n'
    sent = 0
    four_gib = 4 * 1024**3

    def body():
        nonlocal sent
        yield head
        while sent < four_gib:
            chunk = line * 64
            sent += len(chunk)
            yield chunk

    headers = {**auth("data"), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    try:
        response = httpx.post(f"{live_server}/v1/files", headers=headers, content=body(), timeout=60)
    except httpx.TransportError:
        response = None  # the server may reset the connection (it closes it after the 413) before we read the answer
    if response is not None:
        assert response.status_code == 413 and response.json()["error"]["param"] == "file"
    # What the server read, plus what socket buffers and the client's last chunks hold.
    assert sent < settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES + 8 * 1024**2
    files = [path for path in settings.files_dir.rglob("*") if path.is_file()]
    assert files == []
    with sessions() as session:
        assert session.scalars(select(File)).all() == []
