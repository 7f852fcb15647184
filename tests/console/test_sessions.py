"""Console sessions without a browser: the encrypted cookie, sign-in, CSRF, idle timeout, revocation, and that a
session is exactly as strong as its key (the API's role checks answer)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import select

from server.app import create_app
from server.console.session import COOKIE_NAME, ConsoleSession, SessionCodec
from server.db.models import ApiKey, AuditLog
from server.db.session import session_scope
from server.services.keys import revoke_key


def test_the_cookie_is_opaque_tamper_proof_and_ends_after_the_idle_timeout():
    codec = SessionCodec("server secret", idle_timeout_s=60)
    session = ConsoleSession.start("zk-the-api-key")
    token = codec.encode(session, now=1_000_000)
    assert "zk-the-api-key" not in token  # encrypted, not just signed
    assert codec.decode(token, now=1_000_059) == session
    assert codec.decode(token, now=1_000_061) is None  # idle too long
    assert SessionCodec("another secret", idle_timeout_s=60).decode(token, now=1_000_001) is None
    assert codec.decode(token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1], now=1_000_001) is None
    assert codec.decode("not a token", now=1_000_001) is None


def test_sign_in_sets_a_strict_http_only_cookie_and_is_audited(client, keys, sessions, sign_in, HTML):
    assert sign_in(client, "zk-not-a-key").status_code == 401
    response = sign_in(client, keys["data"], next_path="/console/jobs")
    assert response.status_code == 303 and response.headers["location"] == "/console/jobs"
    cookie = next(h for h in response.headers.get_list("set-cookie") if h.startswith(f"{COOKIE_NAME}="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert keys["data"] not in cookie
    assert client.get("/console/jobs", headers=HTML).status_code == 200
    with sessions() as session:
        outcomes = [
            row.status_code for row in session.scalars(select(AuditLog).where(AuditLog.action == "console.sign_in"))
        ]
    assert sorted(outcomes) == [303, 401]


def test_sign_in_refuses_a_form_without_its_csrf_token_and_foreign_redirects(client, keys, sign_in):
    client.get("/console/login")
    forged = client.post("/console/session", data={"api_key": keys["admin"], "csrf": "guess"}, follow_redirects=False)
    assert forged.status_code == 403 and COOKIE_NAME not in forged.cookies
    response = sign_in(client, keys["admin"], next_path="//evil.example/")
    assert response.headers["location"] == "/console/"


def test_every_post_needs_the_session_csrf_token(client, keys, sign_in, csrf_of):
    sign_in(client, keys["admin"])
    token = csrf_of(client, "/console/keys")
    body = {"name": "made in console", "role": "analyst"}
    missing = client.post("/v1/admin/keys", json=body)
    assert missing.status_code == 403 and missing.json()["error"]["code"] == "csrf_failed"
    wrong = client.post("/v1/admin/keys", json=body, headers={"X-CSRF-Token": "x" + token})
    assert wrong.status_code == 403
    created = client.post("/v1/admin/keys", json=body, headers={"X-CSRF-Token": token})
    assert created.status_code == 200 and created.json()["secret"].startswith("zk-")


@pytest.mark.parametrize(
    ("role", "allowed", "forbidden"),
    [
        (
            "analyst",
            ["/console/playground"],
            ["/console/jobs", "/console/datasets", "/console/models", "/console/keys"],
        ),
        ("data", ["/console/jobs", "/console/datasets", "/console/playground"], ["/console/models", "/console/audit"]),
        ("admin", ["/console/models", "/console/keys", "/console/audit", "/console/jobs"], []),
    ],
)
def test_a_session_can_do_exactly_what_its_key_can(client, keys, role, allowed, forbidden, sign_in, csrf_of, HTML):
    sign_in(client, keys[role])
    token = csrf_of(client, "/console/playground")
    for path in allowed:
        assert client.get(path, headers=HTML).status_code == 200, path
    for path in forbidden:
        response = client.get(path, headers=HTML)
        assert response.status_code == 403, path
        assert response.json()["error"]["type"] == "permission_error"
    forged = client.post("/v1/admin/keys", json={"name": "x", "role": "admin"}, headers={"X-CSRF-Token": token})
    assert forged.status_code == (200 if role == "admin" else 403)


def test_revoking_the_key_ends_its_console_session(client, make_key, sessions, sign_in, HTML):
    key_id, secret = make_key("data")
    sign_in(client, secret)
    assert client.get("/console/jobs", headers=HTML).status_code == 200
    with session_scope(sessions) as session:
        revoke_key(session, session.get(ApiKey, key_id))
    page = client.get("/console/jobs", headers=HTML, follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"].startswith("/console/login?next=/console/jobs")
    assert client.get("/v1/files").status_code == 401  # the same session on the API


def test_an_idle_session_is_sent_to_sign_in(settings, keys, HTML):
    settings = settings.model_copy(update={"console_secret": SecretStr("known"), "console_idle_timeout_s": 600})
    codec = SessionCodec("known", 600)
    with TestClient(create_app(settings)) as client:
        client.cookies.set(COOKIE_NAME, codec.encode(ConsoleSession.start(keys["data"]), now=time.time() - 300))
        assert client.get("/console/jobs", headers=HTML).status_code == 200  # active within the timeout
        client.cookies.clear()  # drop the cookie that request re-issued
        client.cookies.set(COOKIE_NAME, codec.encode(ConsoleSession.start(keys["data"]), now=time.time() - 601))
        page = client.get("/console/jobs", headers=HTML, follow_redirects=False)
        assert page.status_code == 303 and "ended=expired" in page.headers["location"]
        assert client.get("/v1/files").status_code == 401


def test_browsers_without_a_session_are_sent_to_sign_in_and_api_clients_get_401(client, HTML):
    page = client.get("/console/models", headers=HTML, follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"] == "/console/login?next=/console/models"
    assert client.get("/console/models").status_code == 401
    assert client.get("/console/static/console.css").status_code == 200


def test_bad_filter_and_preview_input_is_a_400_naming_the_field(client, keys, valid_dataset, sign_in, csrf_of, HTML):
    sign_in(client, keys["admin"])
    page = client.get("/console/audit", params={"since": "yesterday"}, headers=HTML)
    assert page.status_code == 400 and "since: not a date and time" in page.text
    assert client.get("/console/audit", params={"since": "2026-01-01T00:00"}, headers=HTML).status_code == 200
    token = csrf_of(client, "/console/datasets")
    uploaded = client.post(
        "/v1/files",
        data={"purpose": "fine-tune"},
        files={"file": ("t.jsonl", valid_dataset)},
        headers={"X-CSRF-Token": token},
    )
    assert uploaded.status_code == 200, uploaded.text
    for line in ("0", "first"):
        response = client.get(f"/console/datasets/{uploaded.json()['id']}", params={"line": line})
        assert response.status_code == 400 and response.json()["error"]["param"] == "line"
    beyond = client.get(f"/console/datasets/{uploaded.json()['id']}", params={"line": 99}, headers=HTML)
    assert beyond.status_code == 200  # no model registered: the reports show, the preview says why it cannot
