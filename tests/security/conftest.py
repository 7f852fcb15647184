"""Security test fixtures: the server tests' database, app, key and tiny-model fixtures and the console's sign-in
helpers (one definition each, loaded from `tests/console/conftest.py`, which loads `tests/server/conftest.py`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "console_test_fixtures", Path(__file__).parents[1] / "console" / "conftest.py"
)
console_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(console_fixtures)
server_fixtures = console_fixtures.server_fixtures

database_url = server_fixtures.database_url
settings = server_fixtures.settings
sessions = server_fixtures.sessions
app = server_fixtures.app
client = server_fixtures.client
make_key = server_fixtures.make_key
make_project = server_fixtures.make_project
keys = server_fixtures.keys
auth = server_fixtures.auth
valid_dataset = server_fixtures.valid_dataset
tiny_model_dir = server_fixtures.tiny_model_dir
live_server = server_fixtures.live_server
html_headers = console_fixtures.html_headers
sign_in_fixture = console_fixtures.sign_in_fixture
csrf_of_fixture = console_fixtures.csrf_of_fixture
