"""Admin API: keys, the audit log and its filters; plus health and metrics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from server.db.models import DEFAULT_PROJECT_ID, FineTuningJob, JobStatus


def test_keys_are_created_listed_and_revoked_over_http(client, auth, sessions):
    created = client.post("/v1/admin/keys", headers=auth("admin"), json={"name": "analyst bot", "role": "analyst"})
    assert created.status_code == 200
    body = created.json()
    secret = body["secret"]
    assert body["role"] == "analyst" and secret.startswith(body["prefix"])
    assert client.get("/v1/models", headers=auth(secret)).status_code == 200

    listed = client.get("/v1/admin/keys", headers=auth("admin"))
    assert "secret" not in listed.text and secret not in listed.text
    by_name = {key["name"]: key for key in listed.json()["data"]}
    assert by_name["analyst bot"]["last_used_at"] is not None

    with sessions() as session:
        hashes = session.execute(text("SELECT secret_hash FROM api_keys")).scalars().all()
    assert secret not in hashes

    assert client.post(f"/v1/admin/keys/{body['id']}/revoke", headers=auth("admin")).status_code == 200
    assert client.get("/v1/models", headers=auth(secret)).status_code == 401
    assert client.post("/v1/admin/keys/key_missing/revoke", headers=auth("admin")).status_code == 404


def audit(client, auth, **filters) -> list[dict]:
    response = client.get("/v1/admin/audit", headers=auth("admin"), params=filters)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def test_every_mutating_request_is_audited_whatever_its_outcome(client, auth, keys, valid_dataset):
    admin_id = client.get("/v1/admin/keys", headers=auth("admin")).json()["data"]
    admin_id = next(key["id"] for key in admin_id if key["role"] == "admin")

    upload = client.post(
        "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", valid_dataset)}
    )
    file_id = upload.json()["id"]
    client.post("/v1/files", headers=auth("analyst"), data={"purpose": "fine-tune"}, files={"file": ("t", b"x")})
    client.post("/v1/admin/keys", json={"name": "x", "role": "admin"})
    client.delete(f"/v1/files/{file_id}", headers=auth("admin"))
    client.get("/v1/files", headers=auth("admin"))  # reads are not audited

    entries = audit(client, auth)
    assert [(entry["action"], entry["status_code"], entry["outcome"]) for entry in entries] == [
        ("files.delete", 200, "success"),
        ("keys.create", 401, "denied"),
        ("files.create", 403, "denied"),
        ("files.create", 200, "success"),
    ]
    delete, anonymous, _, created = entries
    assert created["target"] == file_id and delete["target"] == file_id
    assert delete["actor_key_id"] == admin_id and anonymous["actor_key_id"] is None
    assert delete["client_address"] and delete["method"] == "DELETE"


def test_audit_filters_by_actor_action_and_time(client, auth, make_key):
    actor_id, actor_secret = make_key("admin", "auditor")
    for name in ("a", "b"):
        client.post("/v1/admin/keys", headers=auth(actor_secret), json={"name": name, "role": "analyst"})
    client.post("/v1/admin/keys/key_missing/revoke", headers=auth("admin"))

    assert len(audit(client, auth, actor=actor_id)) == 2
    assert [entry["outcome"] for entry in audit(client, auth, action="keys.revoke")] == ["failure"]
    future = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    past = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    assert audit(client, auth, since=future) == []
    assert len(audit(client, auth, since=past, until=future)) == 3
    first_page = client.get("/v1/admin/audit", headers=auth("admin"), params={"limit": 2}).json()
    assert first_page["has_more"]
    assert len(audit(client, auth, after=first_page["last_id"])) == 1
    naive = client.get("/v1/admin/audit", headers=auth("admin"), params={"since": "2026-01-01T00:00:00"})
    assert naive.status_code == 400 and naive.json()["error"]["param"] == "since"


def test_health_needs_no_key_and_reports_the_database_to_keys(client, auth):
    response = client.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    body = client.get("/health", headers=auth("analyst")).json()
    assert (body["status"], body["database"], body["engine"]) == ("ok", "ok", {"status": "ready", "kind": "local"})
    body = client.get("/health", headers=auth("admin")).json()
    assert (body["status"], body["database"], body["engine"]["status"]) == ("ok", "ok", "ready")


def test_metrics_count_requests_and_job_states(client, auth, sessions, valid_dataset):
    upload = client.post(
        "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", valid_dataset)}
    )
    with sessions() as session:
        session.add(
            FineTuningJob(
                model="m", training_file_id=upload.json()["id"], status=JobStatus.queued, project_id=DEFAULT_PROJECT_ID
            )
        )
        session.commit()
    client.get("/v1/files", headers=auth("data"))

    response = client.get("/metrics", headers=auth("admin"))
    assert response.headers["content-type"].startswith("text/plain")
    lines = response.text.splitlines()
    assert 'zaya_http_requests_total{method="GET",route="/v1/files",status="200"} 1.0' in lines
    assert 'zaya_fine_tuning_jobs{status="queued"} 1.0' in lines
    assert 'zaya_fine_tuning_jobs{status="running"} 0.0' in lines
    assert any(line.startswith("zaya_http_request_duration_seconds_bucket") for line in lines)
