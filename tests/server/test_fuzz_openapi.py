"""Fuzz every operation of the app's own OpenAPI document with schemathesis, over real HTTP (uvicorn on 127.0.0.1).

Schemathesis' coverage phase (boundary values, wrong types, unexpected methods) and its positive and negative
(schema-violating) fuzzing make the requests. Each goes out with an admin key (which passes every role check, so the
input reaches the route) and with one more caller, taken in turn: an analyst key, a data key, or no key at all. No
answer may be a 5xx, and every answer must match the document (status, content type, body schema; errors are
OpenAI's `{"error": {...}}`). Examples per operation are few so CI stays bounded; `FUZZ_MAX_EXAMPLES` raises them.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from schemathesis import GenerationMode

from server.app import create_app
from server.settings import Settings

MAX_EXAMPLES = int(os.environ.get("FUZZ_MAX_EXAMPLES", "5"))
CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]

pytestmark = pytest.mark.slow


@pytest.fixture
def settings(settings):
    """No rate limits: the fuzzer sends far more than a minute's worth of requests with each key, and without."""
    limits_off = {"rate_limit_requests_per_minute": 0, "rate_limit_tokens_per_minute": 0}
    return settings.model_copy(update={**limits_off, "rate_limit_auth_failures_per_minute": 0})


@pytest.fixture
def ready_server(live_server) -> str:
    """The server once its engine has started (before that, /health rightly answers 503)."""
    deadline = time.monotonic() + 180
    while requests.get(f"{live_server}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.1)
    return live_server


@pytest.fixture
def sessions_by_role(keys):
    """A requests session per caller: one per role, and one without a key."""
    callers = {"none": requests.Session()}
    for role, secret in keys.items():
        callers[role] = requests.Session()
        callers[role].headers["Authorization"] = f"Bearer {secret}"
    yield callers
    for session in callers.values():
        session.close()


OTHER_CALLERS = itertools.cycle(["analyst", "data", "none"])


def load_schema():
    """The document the app serves at /openapi.json (it depends on no database, so any app will do)."""
    with tempfile.TemporaryDirectory() as directory:
        document = create_app(Settings(data_dir=Path(directory), database_url="sqlite://")).openapi()
    schema = schemathesis.openapi.from_dict(document)
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=MAX_EXAMPLES, deterministic=True
    )
    return schema


# Loaded at import, not from a fixture: schemathesis' lazy (fixture) loading does not run under pytest 9.
schema = load_schema()


def assert_openai_error_shape(response: requests.Response, caller: str) -> None:
    if response.status_code < 400:
        return
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], caller
    assert isinstance(error["type"], str) and set(error) >= {"param", "code"}, caller


@schema.parametrize()
@hypothesis_settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_every_operation_with_every_role(case, ready_server, sessions_by_role):
    for caller in ("admin", next(OTHER_CALLERS)):
        session = sessions_by_role[caller]
        # A schema-generated Authorization header would replace the caller's key: keep the caller's.
        if case.headers:
            case.headers.pop("Authorization", None)
            case.headers.pop("authorization", None)
        response = case.call_and_validate(base_url=ready_server, session=session, checks=CHECKS, timeout=60)
        assert_openai_error_shape(response, caller)
