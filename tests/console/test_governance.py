"""The model-versions page with four-eyes on: a promotion from the console waits in the approval queue, the
requester cannot approve it, a second admin can, and the alias history shows approver and evaluation gate."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from server.app import create_app
from server.db.session import session_scope
from server.services import registry


def test_four_eyes_promotion_through_the_console(settings, make_key, sessions, tiny_model_dir, sign_in, csrf_of, HTML):
    with session_scope(sessions) as session:
        version = registry.register_version(session, name="bank-model", path=tiny_model_dir)
        version_id = version.id
    requester_id, requester = make_key("admin", "first admin")
    approver_id, approver = make_key("admin", "second admin")
    app = create_app(settings.model_copy(update={"four_eyes": True}))
    with TestClient(app) as client:
        sign_in(client, requester)
        token = csrf_of(client, "/console/models")
        promoted = client.post(
            f"/v1/admin/models/{version_id}/promote",
            json={"alias": "production", "reason": "ready for traffic"},
            headers={"X-CSRF-Token": token},
        )
        assert promoted.status_code == 202 and promoted.json()["status"] == "pending"
        approval_id = promoted.json()["id"]

        page = client.get("/console/models", headers=HTML).text
        assert "four-eyes approval is <strong>on</strong>" in page
        queue = re.search(r'<table class="data" id="approvals">(.*?)</table>', page, re.S).group(1)
        assert approval_id in queue and "ready for traffic" in queue and "Approve" in queue

        approve = f"/v1/admin/model_aliases/approvals/{approval_id}/approve"
        own = client.post(approve, headers={"X-CSRF-Token": token})
        assert own.status_code == 403 and own.json()["error"]["code"] == "self_approval"
        client.cookies.clear()  # the second admin, in another browser
        sign_in(client, approver)
        approved = client.post(approve, headers={"X-CSRF-Token": csrf_of(client, "/console/models")})
        assert approved.status_code == 200, approved.text

        page = client.get("/console/models", headers=HTML).text
        history = re.search(r'<table class="data" id="alias-history">(.*?)</table>', page, re.S).group(1)
        assert "bank-model@production" in history and approver_id in history and requester_id in history
        assert "passed: no held-out loss to beat" in history  # the gate's record: nothing held the alias before
        queue = re.search(r'<table class="data" id="approvals">(.*?)</table>', page, re.S).group(1)
        assert f"approved by <code>{approver_id}</code>" in queue and "Approve" not in queue
