"""Two real `zaya serve` processes on one database and one Redis, as replicas behind a load balancer run: what one
does, the other sees on its next request (a key's rate limit, a revoked key, a moved alias, a job and its cancel).

The Redis is the run's (`ZAYA_TEST_REDIS_URL`, set by `tests/private_services.py`; else this machine's); the database
is the test's own (a PostgreSQL schema on the PostgreSQL pass).
"""

from __future__ import annotations

import os

import httpx
import pytest
from private_services import DEFAULT_REDIS_URL, REDIS_URL_ENV, redis_answers
from sqlalchemy import select

from benchmarks.load_test.stack import MODEL_NAME, Stack
from server.db.models import InferenceRecord

from .processes import assert_no_secret_logged, logs, wait_for

pytestmark = pytest.mark.slow

REQUESTS_PER_WINDOW = 10


def chat(url: str, secret: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=bearer(secret), timeout=120)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_two_api_servers_share_limits_keys_aliases_and_jobs(stack, tmp_path):
    redis_url = os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL
    assert redis_answers(redis_url), f"no Redis answers at {redis_url}"
    stack.env.update(
        {
            "ZAYA_RATE_LIMIT_STORAGE_URI": redis_url,
            "ZAYA_RATE_LIMIT_REQUESTS_PER_MINUTE": str(REQUESTS_PER_WINDOW),
            "ZAYA_RATE_LIMIT_WINDOW_S": "3600",  # the window starts at a key's first request: none ends in the test
        }
    )
    (tmp_path / "second").mkdir()
    second = Stack(
        stack.data_dir, database_url=stack.database_url, env=stack.env, log_dir=tmp_path / "second", keys=stack.keys
    )
    with second:
        stack.start_server(wait=False)
        second.start_server()
        stack.wait_until_healthy()
        a, b = stack.url, second.url
        admin = stack.headers("admin")

        def create_key(url: str, role: str) -> dict:
            response = httpx.post(f"{url}/v1/admin/keys", json={"name": role, "role": role}, headers=admin)
            assert response.status_code == 200, response.text
            return response.json()

        # A key's request limit holds across both servers: its requests alternate, the limit counts them all.
        limited = create_key(a, "analyst")["secret"]
        for index in range(REQUESTS_PER_WINDOW):
            response = httpx.get(f"{(a, b)[index % 2]}/v1/models", headers=bearer(limited))
            assert response.status_code == 200, (index, response.text)
        for url in (a, b):
            refused = httpx.get(f"{url}/v1/models", headers=bearer(limited))
            assert refused.status_code == 429, (url, refused.text, logs(stack))
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"

        # A key revoked through one server fails its next request on the other.
        created = create_key(b, "analyst")
        assert httpx.get(f"{a}/v1/models", headers=bearer(created["secret"])).status_code == 200
        revoked = httpx.post(f"{b}/v1/admin/keys/{created['id']}/revoke", headers=admin)
        assert revoked.status_code == 200, revoked.text
        refused = httpx.get(f"{a}/v1/models", headers=bearer(created["secret"]))
        assert refused.status_code == 401, refused.text

        # An alias moved through one server: the other's next request resolves the model to the new version.
        versions = httpx.get(f"{a}/v1/admin/models", params={"name": MODEL_NAME}, headers=admin).json()["data"]
        (first,) = versions
        body = {"name": MODEL_NAME, "path": first["path"], "description": "second version"}
        new = httpx.post(f"{a}/v1/admin/models", json=body, headers=admin)
        assert new.status_code == 200, new.text
        new_id = new.json()["id"]
        analyst = stack.keys["analyst"]
        assert chat(b, analyst).status_code == 200
        promoted = httpx.post(f"{a}/v1/admin/models/{new_id}/promote", json={"reason": "two servers"}, headers=admin)
        assert promoted.status_code == 200, promoted.text
        aliases = httpx.get(f"{b}/v1/admin/model_aliases", params={"model_name": MODEL_NAME}, headers=admin).json()
        assert {(alias["alias"], alias["version_id"]) for alias in aliases["data"]} == {("production", new_id)}
        answered = chat(b, analyst)
        assert answered.status_code == 200, answered.text

        def answering_versions() -> list[str] | None:
            with stack.database() as sessions, sessions() as session:
                rows = session.scalars(
                    select(InferenceRecord.model_version_id)
                    .where(InferenceRecord.requested_model == MODEL_NAME)
                    .order_by(InferenceRecord.id)
                ).all()
            return rows if len(rows) == 2 else None  # the records are written in the background

        assert wait_for(answering_versions, 30, stack, "the inference records") == [first["id"], new_id]

        # A job created through one server is seen and cancelled through the other (no worker runs: it waits).
        data = stack.headers("data")
        upload = {
            "file": (
                "train.jsonl",
                b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}\n',
            )
        }
        file_id = httpx.post(f"{a}/v1/files", data={"purpose": "fine-tune"}, files=upload, headers=data).json()["id"]
        job = httpx.post(f"{a}/v1/fine_tuning/jobs", json={"model": MODEL_NAME, "training_file": file_id}, headers=data)
        assert job.status_code == 200, job.text
        job_id = job.json()["id"]
        seen = httpx.get(f"{b}/v1/fine_tuning/jobs/{job_id}", headers=data)
        assert seen.status_code == 200 and seen.json()["status"] == "validating_files", seen.text
        cancelled = httpx.post(f"{b}/v1/fine_tuning/jobs/{job_id}/cancel", headers=data)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        assert httpx.get(f"{a}/v1/fine_tuning/jobs/{job_id}", headers=data).json()["status"] == "cancelled"
    assert_no_secret_logged(second)
