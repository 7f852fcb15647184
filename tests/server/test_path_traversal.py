"""No path traversal from any id or filename: every route with a path parameter, fed traversal-shaped ids, answers
a clean 4xx and never a file's content; stored files live under their generated id whatever the uploaded name; the
console's static assets do not reach outside their folder."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute

SECRET_MARKER = "root:x:0:0"  # the first line of /etc/passwd
TRAVERSAL_IDS = [
    "..%2F..%2F..%2F..%2Fetc%2Fpasswd",
    "%2e%2e%2f%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "....%2F%2F....%2F%2Fetc%2Fpasswd",
    "%2Fetc%2Fpasswd",
    "..%5C..%5Cetc%5Cpasswd",
    "file-..",
]


def routes_with_path_parameters(app) -> list[tuple[str, str]]:
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute) and "{" in route.path:
            for method in sorted(route.methods - {"HEAD", "OPTIONS"}):
                found.append((method, route.path))
    return found


def test_every_id_parameter_refuses_traversal(app, client, auth):
    routes = routes_with_path_parameters(app)
    assert len(routes) >= 10  # files, jobs, events, checkpoints, models, versions, aliases, keys, approvals
    for method, template in routes:
        for payload in TRAVERSAL_IDS:
            path = re.sub(r"\{[^}]+\}", payload, template)
            response = client.request(method, path, headers=auth("admin"), json={"reason": "probe"})
            assert 400 <= response.status_code < 500, (method, path, response.status_code, response.text)
            assert SECRET_MARKER not in response.text
            if response.headers.get("content-type", "").startswith("application/json"):
                assert "error" in response.json(), (method, path, response.text)


def test_stored_files_live_under_their_id_whatever_the_name(client, auth, settings, valid_dataset):
    response = client.post(
        "/v1/files",
        headers=auth("data"),
        data={"purpose": "fine-tune"},
        files={"file": ("../../../../tmp/escaped.jsonl", valid_dataset)},
    )
    assert response.status_code == 200, response.text
    file_id = response.json()["id"]
    stored = [path for path in settings.data_dir.rglob("*") if path.is_file() and path.suffix != ".db"]
    assert [path.name for path in stored if settings.files_dir in path.parents] == [file_id]
    assert all(settings.data_dir in path.parents for path in stored)
    content = client.get(f"/v1/files/{file_id}/content", headers=auth("data"))
    assert content.status_code == 200 and content.content == valid_dataset


@pytest.mark.parametrize(
    "path",
    [
        "/console/static/..%2F..%2Fsettings.py",
        "/console/static/%2e%2e/%2e%2e/settings.py",
        "/console/static/../../settings.py",
        "/console/static/..%2F..%2F..%2F..%2F..%2F..%2Fetc%2Fpasswd",
    ],
)
def test_console_assets_stay_in_their_folder(client, path):
    response = client.get(path)
    # 404 inside the console's folder; a client that normalises `../` lands on an API path and gets 401.
    assert response.status_code in (401, 404), (path, response.status_code)
    assert SECRET_MARKER not in response.text and "class Settings" not in response.text
