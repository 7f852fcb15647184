"""No request can stall the server: hostile requests against a real `zaya serve` process, each refused quickly while
`/health`, polled all along, keeps answering within a second.

- a chat or text prompt far over the context (megabytes) is refused by its length, before tokenizing (400
  `context_length_exceeded`), and its tokens are charged to the key;
- a request target over `max_request_line_bytes` gets 414, a head over `max_header_bytes` gets 431, both before the
  rest is read (a 100 MB header is cut off after its first bytes, without growing the server's memory);
- requests without a valid key are limited per client address (401, then 429), and the audit log keeps at most
  1,024 characters of their paths.

`python -m benchmarks.attack_bench` runs the same attacks and prints the figures in docs/reliability.md.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import func
from sqlalchemy import select as sql_select

from benchmarks.attack_bench import HealthProbe, health_probed, rss_bytes, send_raw, status_and_error
from benchmarks.load_test.stack import MODEL_NAME, Stack

HEALTH_BOUND_S = 1.0  # the bound for /health during an attack
AUTH_FAILURES_PER_WINDOW = 20
TOKENS_PER_WINDOW = 100_000
MAX_REQUEST_LINE_BYTES = 8 * 1024
MAX_HEADER_BYTES = 32 * 1024
STACK_ENV = {
    "ZAYA_RATE_LIMIT_AUTH_FAILURES_PER_MINUTE": str(AUTH_FAILURES_PER_WINDOW),
    "ZAYA_RATE_LIMIT_TOKENS_PER_MINUTE": str(TOKENS_PER_WINDOW),
    "ZAYA_MAX_REQUEST_LINE_BYTES": str(MAX_REQUEST_LINE_BYTES),
    "ZAYA_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("stall"), env=STACK_ENV) as stack:
        stack.prepare()
        stack.start_server()
        yield stack


def check(probe: HealthProbe) -> None:
    assert not probe.failures, probe.failures[:3]
    assert len(probe.latencies) >= 2, "the attack ended before /health was probed"
    assert probe.worst < HEALTH_BOUND_S, f"/health took {probe.worst:.2f} s during the attack"


# --- prompts over the context ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("route", "role", "field_name"),
    [("/v1/chat/completions", "analyst", "messages"), ("/v1/completions", "admin", "prompt")],
)
def test_prompt_over_the_context_is_refused_by_its_length_and_charged(stack, route, role, field_name):
    text = "Summarise case 12: 40 cash deposits of 9,900 EUR. " * 150_000  # 7.5 MB, millions of tokens
    body = {"model": MODEL_NAME, "max_tokens": 4}
    body |= {"messages": [{"role": "user", "content": text}]} if field_name == "messages" else {"prompt": text}
    headers = stack.headers(role)
    with health_probed(stack.url) as probe:
        started = time.perf_counter()
        response = httpx.post(f"{stack.url}{route}", json=body, headers=headers, timeout=60)
        elapsed = time.perf_counter() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        field_name,
    )
    assert "maximum context length" in error["message"]
    assert elapsed < 5, f"refused after {elapsed:.1f} s"
    check(probe)

    # Its tokens were charged: the key's window is used up, so a small request is refused with 429.
    small = {"model": MODEL_NAME, "max_tokens": 2}
    small |= {"messages": [{"role": "user", "content": "Hi"}]} if field_name == "messages" else {"prompt": "Hi"}
    after = httpx.post(f"{stack.url}{route}", json=small, headers=headers, timeout=60)
    assert after.status_code == 429, after.text
    assert after.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(after.headers["Retry-After"]) >= 1


# --- request heads ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_100_mb_header_is_cut_off_with_431(stack):
    before = rss_bytes(stack.server.pid)
    start = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: "
    with health_probed(stack.url) as probe:
        started = time.perf_counter()
        answer, sent = send_raw(stack.port, start, 100 * 1024**2)
        elapsed = time.perf_counter() - started
    status, error = status_and_error(answer)
    assert (status, error["code"]) == (431, "header_too_large")
    assert sent < 10 * 1024**2, f"the server read {sent} bytes of the header before answering"
    assert elapsed < 5
    assert rss_bytes(stack.server.pid) - before < 32 * 1024**2
    check(probe)
    # The server serves on.
    assert httpx.get(f"{stack.url}/v1/models", headers=stack.headers("admin"), timeout=10).status_code == 200


@pytest.mark.slow
def test_a_long_request_target_gets_414(stack):
    with health_probed(stack.url) as probe:
        answer, _sent = send_raw(stack.port, b"GET /v1/" + b"a" * 1024**2 + b" HTTP/1.1\r\n\r\n", 0)
    status, error = status_and_error(answer)
    assert (status, error["code"]) == (414, "uri_too_long")
    check(probe)


@pytest.mark.slow
def test_heads_within_the_limits_are_served(stack):
    """Just under both limits: a long query string and large header fields are read and answered as usual."""
    headers = {**stack.headers("admin"), "X-Padding": "a" * (MAX_HEADER_BYTES - MAX_REQUEST_LINE_BYTES - 1024)}
    query = "x=" + "a" * (MAX_REQUEST_LINE_BYTES - 200)
    response = httpx.get(f"{stack.url}/v1/models?{query}", headers=headers, timeout=10)
    assert response.status_code == 200, response.text

    # Two requests pipelined in one write, their heads together over the limit, each within it: both answered.
    key = stack.keys["admin"]
    one = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nX-Padding: {'a' * 20_000}\r\n\r\n"
    last = one.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n")
    answer, _sent = send_raw(stack.port, (one + last).encode(), 0)
    assert answer.count(b"HTTP/1.1 200 OK") == 2, answer[:300]


# --- requests without a valid key --------------------------------------------------------------------------------


@pytest.mark.slow
def test_requests_without_a_key_are_limited_per_address_and_audited_short(stack):
    from server.db.models import AuditLog

    path = "/v1/files/" + "f" * (MAX_REQUEST_LINE_BYTES - 1024)
    statuses = []
    with health_probed(stack.url) as probe, httpx.Client(base_url=stack.url, timeout=10) as client:
        for attempt in range(AUTH_FAILURES_PER_WINDOW + 10):
            headers = {"Authorization": "Bearer sk-not-a-key"} if attempt % 2 else {}
            response = client.delete(path, headers=headers)
            statuses.append(response.status_code)
            if response.status_code == 429:
                error = response.json()["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
                assert int(response.headers["Retry-After"]) >= 1
    assert statuses == [401] * AUTH_FAILURES_PER_WINDOW + [429] * 10
    check(probe)
    # A valid key from the same address is served all the same.
    assert httpx.get(f"{stack.url}/v1/models", headers=stack.headers("admin"), timeout=10).status_code == 200

    with stack.database() as sessions, sessions() as session:
        rows = session.execute(
            sql_select(func.count(), func.max(func.length(AuditLog.path))).where(AuditLog.actor_key_id.is_(None))
        ).one()
    assert rows[0] == AUTH_FAILURES_PER_WINDOW  # the 401s; the 429s past the limit leave no row
    assert rows[1] == 1024


# --- the length bound itself -------------------------------------------------------------------------------------


def test_the_length_bound_never_exceeds_the_token_count(tiny_model_dir):
    from transformers import AutoTokenizer

    from server.services.prompt_length import longest_token_chars, min_tokens

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert longest_token_chars(tokenizer) > 0
    rng = random.Random(0)
    alphabet = "ab c1 2,.€é\u0301漢字🙂\n\t<|>" + "".join(tokenizer.all_special_tokens)
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        assert min_tokens(tokenizer, text) <= len(tokenizer.encode(text, add_special_tokens=False))
    special = "".join(tokenizer.all_special_tokens) * 20
    assert min_tokens(tokenizer, special) <= len(tokenizer.encode(special, add_special_tokens=False))


def test_no_length_bound_for_a_tokenizer_that_may_drop_characters(tiny_model_dir, tmp_path):
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    from server.services.prompt_length import min_tokens

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.backend_tokenizer.normalizer = normalizers.Strip()  # "   " is no token at all
    assert min_tokens(tokenizer, " " * 10_000) == 0


# --- console sign-in -----------------------------------------------------------------------------------------------


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"rate_limit_auth_failures_per_minute": 3})


def test_console_sign_in_failures_count_with_the_apis(client, keys, sign_in):
    """Wrong keys at the sign-in form and at the API share one per-address budget; past it even the right key waits
    (no guessing keys through the console), while API calls with a valid key go on."""
    assert client.get("/v1/models").status_code == 401
    assert [sign_in(client, "sk-wrong").status_code for _ in range(2)] == [401, 401]
    refused = sign_in(client, keys["admin"])
    assert refused.status_code == 429
    assert int(refused.headers["Retry-After"]) >= 1
    assert "Too many requests without a valid API key" in refused.text
    assert client.get("/v1/models").json()["error"]["code"] == "rate_limit_exceeded"
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {keys['admin']}"}).status_code == 200
