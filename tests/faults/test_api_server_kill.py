"""kill -9 of the API server (`zaya serve`) while an upload and a streamed chat are in flight.

Nothing half-written may become visible, nothing completed before the kill may be lost, both clients must see an
error (never a truncated success), and the restarted server must serve everything as before.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from sqlalchemy import select

from server.db.models import File, FineTuningJob, InferenceRecord
from server.services.storage import INCOMING_DIR, STALE_UPLOAD_S

from .processes import DATASET, dataset, kill, logs, visible_files, wait_for

pytestmark = pytest.mark.slow

BOUNDARY = "zaya-fault-boundary"
# Large enough that the server has written part of it to disk before the rest is sent.
BIG_DATASET = dataset(4000)


def multipart_parts(filename: str, content: bytes, split: int) -> tuple[bytes, bytes]:
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    return head + content[:split], content[split:] + f"\r\n--{BOUNDARY}--\r\n".encode()


def upload_in_two_halves(url: str, headers: dict, released: threading.Event, outcome: dict) -> None:
    """Send half the body, wait until the test has killed the server, then try to send the rest."""
    first, rest = multipart_parts("cut.jsonl", BIG_DATASET, len(BIG_DATASET) // 2)

    def body():
        yield first
        released.wait(120)
        yield rest

    content_type = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    try:
        outcome["response"] = httpx.post(f"{url}/v1/files", content=body(), headers={**headers, **content_type})
    except httpx.HTTPError as error:
        outcome["error"] = error


def test_kill_9_of_the_api_server_mid_upload_and_mid_stream_loses_nothing(stack):
    stack.start_server()
    client = httpx.Client(base_url=stack.url, timeout=60)
    data, analyst = stack.headers("data"), stack.headers("analyst")

    # Completed before the kill: an upload, a job created from it (no worker runs: it stays waiting), a chat.
    done = client.post("/v1/files", headers=data, data={"purpose": "fine-tune"}, files={"file": ("a.jsonl", DATASET)})
    assert done.status_code == 200, done.text
    file_id = done.json()["id"]
    job = client.post("/v1/fine_tuning/jobs", headers=data, json={"model": "zaya-tiny", "training_file": file_id})
    assert job.status_code == 200, job.text
    chat = {"model": "zaya-tiny", "messages": [{"role": "user", "content": "Summarise case 7."}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", headers=analyst, json=chat).status_code == 200

    # In flight at the kill: a long greedy stream (the tiny model does not stop early) and half an upload.
    incoming = stack.data_dir / "files" / INCOMING_DIR
    stream_body = {**chat, "stream": True, "max_tokens": 1500, "temperature": 0}
    released, outcome = threading.Event(), {}
    uploader = threading.Thread(target=upload_in_two_halves, args=(stack.url, data, released, outcome))
    received: list[str] = []
    with client.stream("POST", "/v1/chat/completions", headers=analyst, json=stream_body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while len(received) < 3:
            line = next(lines)
            if line.startswith("data: "):
                received.append(line)
        uploader.start()

        def upload_half_on_disk() -> bool:
            return any(part.stat().st_size > 0 for part in incoming.glob("*.part"))

        wait_for(upload_half_on_disk, 60, stack, "the first half of the upload on the server's disk")
        kill(stack.server)
        released.set()
        # The stream breaks off: an error for the client, never a [DONE].
        with pytest.raises(httpx.HTTPError):
            received.extend(lines)
    assert "data: [DONE]" not in received
    uploader.join(timeout=60)
    assert "error" in outcome and "response" not in outcome, outcome

    # With the server dead: no row and no visible file for the cut upload; the completed one is intact.
    files_dir = stack.data_dir / "files"
    with stack.database() as sessions, sessions() as session:
        assert [row.id for row in session.scalars(select(File))] == [file_id]
        assert session.get(FineTuningJob, job.json()["id"]).status == job.json()["status"]
        assert session.scalar(select(InferenceRecord).where(InferenceRecord.status_code == 200)) is not None
    assert visible_files(files_dir) == {file_id}
    assert (files_dir / file_id).read_bytes() == DATASET
    leftovers = list(incoming.glob("*.part"))
    assert leftovers, "the cut upload's temp file should still be there (hidden) until a restart sweeps it"

    # Restart. A temp file older than the sweep age is removed at startup (pretend the kill was long ago).
    old = time.time() - STALE_UPLOAD_S - 60
    for part in leftovers:
        os.utime(part, (old, old))
    stack.start_server()
    assert not list(incoming.glob("*.part")), "stale temp files were not swept at startup"
    listed = client.get("/v1/files", headers=data).json()["data"]
    assert [item["id"] for item in listed] == [file_id], logs(stack)
    assert client.get(f"/v1/files/{file_id}/content", headers=data).content == DATASET
    assert client.get(f"/v1/fine_tuning/jobs/{job.json()['id']}", headers=data).json() == job.json()
    again = client.post("/v1/files", headers=data, data={"purpose": "fine-tune"}, files={"file": ("b.jsonl", DATASET)})
    assert again.status_code == 200, again.text
    assert client.post("/v1/chat/completions", headers=analyst, json=chat).status_code == 200
