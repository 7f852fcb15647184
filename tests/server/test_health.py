"""`GET /health`: 200 only when the database and the inference engine are ready, else 503 saying which is not (to a
key; without one it says up or down only)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from server.app import create_app
from server.db.migrations import upgrade
from server.db.models import ModelVersion, Role
from server.db.session import session_scope
from server.engines import create_engine
from server.engines.base import EngineError
from server.services.inference import InferenceService
from server.services.keys import create_key
from server.settings import Settings

# Starting the local engine imports torch and transformers: slow on a busy machine when nothing imported them yet.
ENGINE_START_TIMEOUT_S = 180
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def health(client: TestClient, secret: str | None = None) -> tuple[int, dict]:
    """`/health` as the key `secret` sees it (the client's own headers otherwise)."""
    response = client.get("/health", headers={"Authorization": f"Bearer {secret}"} if secret else None)
    return response.status_code, response.json()


@pytest.fixture
def client(app, keys) -> Iterator[TestClient]:
    """The app as an admin calls it: `/health`'s details need a key."""
    with TestClient(app, headers={"Authorization": f"Bearer {keys['admin']}"}) as test_client:
        yield test_client


def test_ready_when_the_database_is_migrated_and_the_engine_started(client):
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S  # the engine starts in the background with the app
    status, body = health(client)
    while body["engine"]["status"] == "loading" and time.monotonic() < deadline:
        time.sleep(0.2)
        status, body = health(client)
    assert status == 200
    assert (body["status"], body["database"]) == ("ok", "ok")
    assert body["engine"]["status"] == "ready" and body["engine"]["kind"] == "local"
    # Once the engine started, the startup heap is out of the garbage collector's way (`server.engines.heap`).
    assert gc.get_freeze_count() > 100_000


def test_503_while_the_engine_is_loading_then_ready(settings, sessions, auth, keys, tiny_model_dir):
    with sessions() as session:
        session.add(ModelVersion(name="tiny", version=1, kind="full", path=str(tiny_model_dir)))
        session.commit()
    release = threading.Event()

    def slow_engine(settings: Settings):
        release.wait(timeout=60)  # a real engine, held back the way a vLLM start takes minutes
        return create_engine(settings)

    app = create_app(settings)
    state = app.state
    state.inference = InferenceService(settings, state.reads, state.rows, state.rate_limits, engine_factory=slow_engine)
    with TestClient(app, headers=auth("admin")) as client:
        status, body = health(client)
        assert status == 503
        assert (body["status"], body["database"], body["engine"]["status"]) == ("unavailable", "ok", "loading")
        chat = client.post("/v1/chat/completions", json=CHAT, headers=auth("analyst"))
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "engine_loading"
        assert int(chat.headers["retry-after"]) > 0

        release.set()
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while health(client)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health(client)[1]["engine"]["status"] == "ready"
        assert client.post("/v1/chat/completions", json=CHAT, headers=auth("analyst")).status_code == 200


def test_503_when_the_engine_failed_to_start(settings, sessions, auth, keys, tiny_model_dir):
    with sessions() as session:
        session.add(ModelVersion(name="tiny", version=1, kind="full", path=str(tiny_model_dir)))
        session.commit()

    def engine_out_of_memory(_settings: Settings):
        raise EngineError("Not enough memory to allocate the KV cache.\nDetails follow on later lines.")

    app = create_app(settings)
    state = app.state
    state.inference = InferenceService(
        settings, state.reads, state.rows, state.rate_limits, engine_factory=engine_out_of_memory
    )
    with TestClient(app, headers=auth("admin")) as client:
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        status, body = health(client)
        while body["engine"]["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.2)
            status, body = health(client)
        assert status == 503
        assert (body["status"], body["database"], body["engine"]["status"]) == ("unavailable", "ok", "failed")
        assert body["engine"]["error"] == "Not enough memory to allocate the KV cache."  # the first line only
        chat = client.post("/v1/chat/completions", json=CHAT, headers=auth("analyst"))
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "engine_unavailable"


def test_503_when_the_schema_is_out_of_date(fresh_database, tmp_path):
    with fresh_database(tmp_path) as url:
        upgrade(url)
        with TestClient(create_app(Settings(data_dir=tmp_path / "data", database_url=url))) as client:
            with session_scope(client.app.state.sessionmaker) as session:
                client.headers["Authorization"] = f"Bearer {create_key(session, name='a', role=Role.admin).secret}"
            assert health(client)[0] in (200, 503)  # the engine may still be starting
            with client.app.state.engine.begin() as connection:
                connection.execute(text("DELETE FROM alembic_version"))
            status, body = health(client)
            assert status == 503 and (body["status"], body["database"]) == ("unavailable", "schema_out_of_date")
            client.app.state.engine.dispose()


@pytest.mark.parametrize("url", ["postgresql+psycopg://postgres@127.0.0.1:1/nothing_listens_here"])
def test_503_when_the_database_is_unreachable(tmp_path, url):
    # No lifespan: a server whose database went away after it started.
    client = TestClient(create_app(Settings(data_dir=tmp_path / "data", database_url=url)))
    # No key can be checked without the database: the answer is the keyless one, down.
    assert health(client, "zk-" + "x" * 43) == (503, {"status": "unavailable"})
