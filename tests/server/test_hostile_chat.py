"""Hostile inference inputs over real HTTP: each is a clear 4xx naming the field, never a 5xx.

`test_chat_api.py` covers prompts beyond the context, `max_tokens` 0 / negative / huge, `n` huge, stop lists of
hundreds of strings and unknown models; this adds what a hostile client sends on top.
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import select

from server.db.models import ApiKey, AuditLog, ModelVersion

LONE_SURROGATE = "\\ud800"  # as it appears in the JSON text: an escape that decodes to no Unicode character


@pytest.fixture
def model_name(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        session.add(ModelVersion(name="tiny", version=1, kind="full", path=str(tiny_model_dir)))
        session.commit()
    return "tiny"


def post_raw(base_url: str, path: str, body: bytes, headers: dict) -> httpx.Response:
    return httpx.post(
        f"{base_url}{path}", content=body, headers={**headers, "Content-Type": "application/json"}, timeout=60
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a%sb"}]}', "messages"),
        (
            "/v1/chat/completions",
            '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
            "messages",
        ),
        ("/v1/chat/completions", '{"model": "ti%sny", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x%s"}', "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop": ["%s"]}', "stop"),
    ],
)
def test_lone_surrogate_escapes_are_400_naming_the_field(live_server, auth, model_name, path, body, param):
    response = post_raw(live_server, path, (body % LONE_SURROGATE).encode(), auth("analyst"))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert "surrogate" in error["message"]


def test_lone_surrogates_elsewhere_are_400_too(live_server, auth, sessions):
    body = ('{"name": "key-' + LONE_SURROGATE + '", "role": "analyst"}').encode()
    response = post_raw(live_server, "/v1/admin/keys", body, auth("admin"))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "name"
    with sessions() as session:
        assert session.scalars(select(ApiKey).where(ApiKey.name.startswith("key-"))).all() == []


def test_a_nul_in_the_model_name_is_400_naming_model(live_server, auth):
    body = b'{"model": "ti\\u0000ny", "messages": [{"role": "user", "content": "x"}]}'
    response = post_raw(live_server, "/v1/chat/completions", body, auth("analyst"))
    assert response.status_code == 400 and response.json()["error"]["param"] == "model", response.text


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/admin/keys", b'{"name": "a\\u0000b", "role": "analyst"}'),
        ("POST", "/v1/fine_tuning/jobs", b'{"model": "a\\u0000b", "training_file": "file-\\u0000"}'),
        ("GET", "/v1/admin/audit?actor=a%00b", None),
        ("GET", "/v1/files/file-%00x", None),
        ("DELETE", "/v1/files/file-%00x", None),
        ("POST", "/v1/admin/keys/key_%00/revoke", None),
        ("DELETE", "/v1/files/" + "f" * 5000, None),
    ],
)
def test_nul_characters_and_huge_ids_are_never_a_5xx(live_server, auth, sessions, method, path, body):
    """PostgreSQL cannot store a NUL or an over-long id: such a request is refused (400/404), or stored where the
    database can hold it (SQLite); the audit log still records it."""
    headers = {**auth("admin"), "Content-Type": "application/json"}
    response = httpx.request(method, f"{live_server}{path}", content=body, headers=headers, timeout=60)
    assert response.status_code < 500, response.text
    assert response.status_code in (200, 400, 404), response.text
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    if method != "GET":
        with sessions() as session:
            [entry] = session.scalars(select(AuditLog).where(AuditLog.method == method)).all()
        assert entry.status_code == response.status_code


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}]}',  # Latin-1, not UTF-8
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\x00\x01"}]}',  # raw control characters
        b'{"model": "tiny", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",  # nested past any recursion limit
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 1e999}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999999999999999}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 99999999999999999999999}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        b'{"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}',
        b'{"model": "tiny", "messages": "not a list"}',
        b"[]",
        b"null",
        b"",
    ],
)
def test_malformed_chat_bodies_are_400(live_server, auth, model_name, body):
    response = post_raw(live_server, "/v1/chat/completions", body, auth("analyst"))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_an_adapter_whose_files_belong_to_another_base_is_a_clean_error(
    live_server, auth, sessions, tiny_model_dir, tiny_adapter_dir, tmp_path
):
    """Registration refuses such adapters (test_adapter_registration.py); one that reached the registry anyway (its
    base's files replaced on disk) is the server's fault, not the caller's: 503 naming the model, never a 500."""
    from zaya_model import ZayaConfig, ZayaForCausalLM

    other = ZayaConfig.from_pretrained(tiny_model_dir).to_dict()
    other.update(hidden_size=48)
    other_dir = tmp_path / "other-base"
    ZayaForCausalLM(ZayaConfig.from_dict(other)).save_pretrained(other_dir)
    for tokenizer_file in tiny_model_dir.iterdir():
        if "token" in tokenizer_file.name or tokenizer_file.suffix == ".jinja":
            (other_dir / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    with sessions() as session:
        base = ModelVersion(name="other", version=1, kind="full", path=str(other_dir))
        session.add(base)
        session.flush()
        adapter = ModelVersion(
            name="mismatched", version=1, kind="adapter", path=str(tiny_adapter_dir), base_version_id=base.id
        )
        session.add(adapter)
        session.commit()
    body = {"model": "mismatched", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    response = httpx.post(f"{live_server}/v1/chat/completions", json=body, headers=auth("analyst"), timeout=60)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "model_unavailable"
