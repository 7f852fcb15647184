"""Console test fixtures: the server tests' database, app, key and tiny-model fixtures (one definition, loaded
from `tests/server/conftest.py`; it cannot be imported by name, `server` is the application package)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "server_test_fixtures", Path(__file__).parents[1] / "server" / "conftest.py"
)
server_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_fixtures)

database_url = server_fixtures.database_url
settings = server_fixtures.settings
sessions = server_fixtures.sessions
app = server_fixtures.app
client = server_fixtures.client
make_key = server_fixtures.make_key
make_project = server_fixtures.make_project
keys = server_fixtures.keys
valid_dataset = server_fixtures.valid_dataset
tiny_model_dir = server_fixtures.tiny_model_dir


@pytest.fixture(name="HTML")
def html_headers() -> dict[str, str]:
    """What a browser sends when it navigates to a page."""
    return {"Accept": "text/html"}


@pytest.fixture(name="sign_in")
def sign_in_fixture():
    """Sign a TestClient in through the sign-in form; returns the form post's response."""

    def sign_in(client, secret: str, next_path: str = "/console/"):
        page = client.get("/console/login", params={"next": next_path})
        assert page.status_code == 200
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
        return client.post(
            "/console/session", data={"api_key": secret, "csrf": csrf, "next": next_path}, follow_redirects=False
        )

    return sign_in


@pytest.fixture(name="csrf_of")
def csrf_of_fixture(HTML):
    """The session's CSRF token, as a page carries it for its scripts."""

    def csrf_of(client, path: str) -> str:
        page = client.get(path, headers=HTML)
        assert page.status_code == 200, page.text
        return re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text).group(1)

    return csrf_of
