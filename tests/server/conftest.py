"""Server test fixtures: a migrated database (SQLite by default, PostgreSQL when ZAYA_TEST_DATABASE_URL says so; see
`fresh_database` in tests/conftest.py), an app per test on a clean database, API keys for every role, and a real
uvicorn server for the `openai` client.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import delete

from server.app import create_app
from server.db.base import Base
from server.db.migrations import upgrade
from server.db.models import DEFAULT_PROJECT_ID, Project, Role
from server.db.session import make_engine, make_sessionmaker, session_scope
from server.http_server import protocol_options
from server.services.keys import create_key
from server.services.projects import create_project
from server.settings import LocalEngineSettings, Settings

MAX_UPLOAD_BYTES = 256 * 1024

VALID_DATASET = b"".join(
    b'{"messages": [{"role": "user", "content": "Balance of account %d?"}, '
    b'{"role": "assistant", "content": "It is %d EUR."}]}\n' % (i, 100 + i)
    for i in range(5)
)


@pytest.fixture(scope="session")
def database_url(tmp_path_factory, fresh_database) -> Iterator[str]:
    """One migrated database for the session; each test leaves it empty again (see `settings`)."""
    with fresh_database(tmp_path_factory.mktemp("db")) as url:
        upgrade(url)
        yield url


def empty_all_tables(database_url: str) -> None:
    """Delete every row but the default project's (the migration makes it; a new install has it)."""
    engine = make_engine(database_url)
    try:
        with engine.begin() as connection:
            for table in reversed(Base.metadata.sorted_tables):
                keep = table.c.id == DEFAULT_PROJECT_ID if table is Project.__table__ else None
                connection.execute(delete(table) if keep is None else delete(table).where(~keep))
    finally:
        engine.dispose()


@pytest.fixture
def settings(tmp_path, database_url) -> Iterator[Settings]:
    # The local engine decodes eagerly here: compiling its decode steps has tests of its own (test_engine_compiled.py).
    yield Settings(
        data_dir=tmp_path / "data",
        database_url=database_url,
        max_upload_bytes=MAX_UPLOAD_BYTES,
        local_engine=LocalEngineSettings(compile=False),
    )
    empty_all_tables(database_url)


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def app(settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def make_key(sessions):
    """Create a key directly in the database (as `zaya keys create` does), by default in the default project;
    returns (key id, secret)."""

    def make(
        role: Role | str, name: str = "test", *, project_id: str = DEFAULT_PROJECT_ID, created_by: str | None = None
    ) -> tuple[str, str]:
        with session_scope(sessions) as session:
            created = create_key(session, name=name, role=role, project_id=project_id, created_by=created_by)
        return created.key.id, created.secret

    return make


@pytest.fixture
def make_project(sessions):
    """Create a project (as `zaya projects create` does); returns its id."""

    def make(name: str) -> str:
        with sessions() as session:
            return create_project(session, name).id

    return make


@pytest.fixture
def keys(make_key) -> dict[str, str]:
    """A secret for every role, by role name."""
    return {role.value: make_key(role, name=f"{role.value} key")[1] for role in Role}


@pytest.fixture
def auth(keys):
    """Authorization headers for a role name (or a raw secret)."""

    def headers(role_or_secret: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {keys.get(role_or_secret, role_or_secret)}"}

    return headers


@pytest.fixture
def valid_dataset() -> bytes:
    return VALID_DATASET


@pytest.fixture
def live_server(app) -> Iterator[str]:
    """The app served by a real uvicorn on 127.0.0.1 and a free port, as `zaya serve` runs it; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # With the head bounds `zaya serve` runs with (`server.http_server`).
    config = uvicorn.Config(app, log_level="warning", lifespan="on", **protocol_options(app.state.settings))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=15)
    sock.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random ZAYA checkpoint with a tokenizer trained here: a base model the fine-tuning worker can train."""
    import torch

    from finetune.datasets.synthetic import generate_chat_examples
    from zaya_model import ZayaConfig, ZayaForCausalLM
    from zaya_model.pretrain import generation_eos_token_ids, train_tokenizer
    from zaya_model.pretrain.presets import MICRO_MODEL

    conversations = [example["messages"] for example in generate_chat_examples(40, seed=0)]
    texts = ["\n".join(message["content"] for message in conversation) for conversation in conversations]
    tokenizer = train_tokenizer(texts, vocab_size=400, model_max_length=256)
    config = ZayaConfig(
        **{**MICRO_MODEL, "num_experts": 2, "max_position_embeddings": 256},
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=generation_eos_token_ids(tokenizer),
    )
    directory = tmp_path_factory.mktemp("tiny-zaya")
    # Seeded: the weights (so greedy answers, and whether one ends at once) must not depend on which tests ran first.
    torch.manual_seed(0)
    ZayaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_adapter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A PEFT LoRA adapter on `tiny_model_dir`'s attention projections: registrable as an adapter version (adapters
    are checked against their base at registration)."""
    import peft

    from zaya_model import ZayaForCausalLM

    config = peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"])
    directory = tmp_path_factory.mktemp("tiny-adapter")
    peft.get_peft_model(ZayaForCausalLM.from_pretrained(tiny_model_dir), config).save_pretrained(directory)
    return directory
