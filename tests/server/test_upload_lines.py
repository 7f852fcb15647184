"""The per-line limit of uploads (`Settings.max_upload_line_bytes`): enforced while the body arrives, so a huge single
line is refused with a 400 naming it after a bounded read, and nothing of it is kept."""

from __future__ import annotations

import random
import resource

import httpx
import pytest
from sqlalchemy import select

from server.db.models import File
from server.errors import LineTooLong
from server.services.storage import StreamedFile

LINE_LIMIT = 64 * 1024


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"max_upload_bytes": 512 * 1024**2, "max_upload_line_bytes": LINE_LIMIT})


def first_line_over(content: bytes, limit: int) -> int | None:
    lines = content.split(b"\n")
    return next((number for number, line in enumerate(lines, start=1) if len(line) > limit), None)


def test_streamed_file_names_the_first_line_over_the_limit_however_the_chunks_fall(tmp_path):
    rng = random.Random(3)
    for _ in range(400):
        content = b"".join(b"x" * rng.choice([0, 3, 9, 10, 11, 25]) + b"\n" * rng.randint(1, 2) for _ in range(8))
        content = content[: rng.randint(0, len(content))]
        expected = first_line_over(content, 10)
        streamed = StreamedFile(tmp_path, max_bytes=10**6, max_line_bytes=10)
        try:
            position = 0
            while position < len(content):
                size = rng.randint(1, 40)
                streamed.write(content[position : position + size])
                position += size
        except LineTooLong as error:
            assert error.line_number == expected, content
            assert error.status_code == 400 and error.code == "line_too_long" and error.param == "file"
            assert f"Line {expected} " in error.message
        else:
            assert expected is None, content
        finally:
            streamed.discard()
    assert list(tmp_path.rglob("*.part")) == []


def test_a_200_mb_single_line_is_refused_early_naming_its_line(live_server, auth, settings, sessions):
    boundary = "oneline"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="long.jsonl"\r\n\r\n'
    ).encode()
    short = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    sent = 0
    line_bytes = 200 * 1024**2

    def body():
        nonlocal sent
        yield head + short + short + b'{"messages": [{"role": "user", "content": "'
        chunk = b"a" * 1024**2
        while sent < line_bytes:  # one line, never materialised on this side either
            sent += len(chunk)
            yield chunk
        yield b'"}]}\n\r\n--' + boundary.encode() + b"--\r\n"

    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; the server runs in this process
    headers = {**auth("data"), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    try:
        response = httpx.post(f"{live_server}/v1/files", headers=headers, content=body(), timeout=60)
    except httpx.TransportError:
        response = None  # the server closes the connection after its answer; the client may see that first
    if response is not None:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("file", "line_too_long")
        assert error["message"].startswith("Line 3 of the file is longer than the limit of 65536 bytes")
    # Read up to the limit plus the drain after the refusal (64 MiB) and what socket buffers hold, not 200 MB.
    assert sent < 100 * 1024**2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 100 * 1024
    assert [path for path in settings.files_dir.rglob("*") if path.is_file()] == []
    with sessions() as session:
        assert session.scalars(select(File)).all() == []


def line_of(size: int, answer: str) -> bytes:
    empty = b'{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "%s"}]}' % answer.encode()
    line = empty.replace(b'"content": ""', b'"content": "' + b"a" * (size - len(empty)) + b'"')
    assert len(line) == size
    return line


def test_lines_up_to_the_limit_are_accepted(live_server, auth):
    def send(content: bytes) -> httpx.Response:
        files = {"file": ("edge.jsonl", content)}
        return httpx.post(
            f"{live_server}/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files=files, timeout=60
        )

    response = send(line_of(LINE_LIMIT, "one") + b"\n" + line_of(LINE_LIMIT, "two") + b"\n")
    assert response.status_code == 200, response.text
    response = send(line_of(LINE_LIMIT, "one") + b"\n" + line_of(LINE_LIMIT + 1, "two") + b"\n")
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("Line 2 "), response.text
