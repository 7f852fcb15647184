"""`zaya db upgrade`, `zaya projects create`, `zaya keys create`: run through the real CLI entry point."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from zaya_cli.main import main


def test_db_upgrade_then_keys_create_gives_a_working_admin_key(tmp_path, monkeypatch, capsys, fresh_database):
    with fresh_database(tmp_path) as url:
        monkeypatch.setenv("ZAYA_DATA_DIR", str(tmp_path / "var"))
        monkeypatch.setenv("ZAYA_DATABASE_URL", url)

        assert main(["keys", "create", "--role", "admin", "--name", "first admin"]) == 1
        assert "zaya db upgrade" in capsys.readouterr().err

        assert main(["db", "upgrade"]) == 0
        assert main(["keys", "create", "--role", "admin", "--name", "first admin"]) == 0
        secret = capsys.readouterr().out.strip().splitlines()[-1]

        with TestClient(create_app(Settings())) as client:
            response = client.get("/v1/admin/keys", headers={"Authorization": f"Bearer {secret}"})
        assert response.status_code == 200
        assert [key["name"] for key in response.json()["data"]] == ["first admin"]
        assert secret not in response.text


def test_keys_are_created_in_a_project_made_first(tmp_path, monkeypatch, capsys, fresh_database):
    with fresh_database(tmp_path) as url:
        monkeypatch.setenv("ZAYA_DATA_DIR", str(tmp_path / "var"))
        monkeypatch.setenv("ZAYA_DATABASE_URL", url)
        assert main(["db", "upgrade"]) == 0

        assert main(["keys", "create", "--role", "data", "--name", "risk team", "--project", "risk"]) == 1
        assert "zaya projects create risk" in capsys.readouterr().err
        assert main(["projects", "create", "risk"]) == 0
        assert main(["projects", "create", "risk"]) == 1
        assert "already exists" in capsys.readouterr().err
        assert main(["projects", "create", "Bad Name"]) == 1
        assert "Invalid project name" in capsys.readouterr().err
        assert main(["projects", "list"]) == 0
        listed = dict(line.split("\t")[::-1] for line in capsys.readouterr().out.strip().splitlines())
        assert set(listed) == {"default", "risk"} and listed["default"] == "proj_default"

        assert main(["keys", "create", "--role", "data", "--name", "risk team", "--project", "risk"]) == 0
        assert "in project risk" in capsys.readouterr().out
        assert main(["keys", "create", "--role", "admin", "--name", "ops"]) == 0
        admin = capsys.readouterr().out.strip().splitlines()[-1]
        with TestClient(create_app(Settings())) as client:
            headers = {"Authorization": f"Bearer {admin}"}
            keys = client.get("/v1/admin/keys", headers=headers).json()["data"]
            audit = client.get("/v1/admin/audit", headers=headers).json()["data"]
        assert {key["name"]: key["project_id"] for key in keys} == {"risk team": listed["risk"], "ops": "proj_default"}
        # Keys made on the command line have no creating key, and are audited as made there.
        assert {key["created_by"] for key in keys} == {None}
        made = [(entry["action"], entry["method"], entry["actor_key_id"], entry["target"]) for entry in audit]
        assert sorted(made) == sorted(("keys.create", "CLI", None, key["id"]) for key in keys)


def test_keys_create_refuses_an_unknown_role(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["keys", "create", "--role", "root", "--name", "x"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
