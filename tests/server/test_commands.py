"""`zaya db upgrade`, `zaya keys create`: run through the real CLI entry point."""

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


def test_keys_create_refuses_an_unknown_role(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["keys", "create", "--role", "root", "--name", "x"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
