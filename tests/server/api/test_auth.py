"""Every route x every role: no key -> 401, too weak a role -> 403, enough -> 2xx. Plus the error shapes."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from server.db.models import ModelVersion, Role

PUBLIC = None

# The role each route needs. A route missing here fails `test_every_route_is_in_the_matrix`.
REQUIRED_ROLE = {
    ("GET", "/health"): PUBLIC,
    ("GET", "/metrics"): Role.admin,
    ("GET", "/openapi.json"): Role.analyst,
    ("GET", "/docs"): Role.analyst,
    ("GET", "/docs/oauth2-redirect"): Role.analyst,
    ("GET", "/redoc"): Role.analyst,
    ("GET", "/v1/models"): Role.analyst,
    ("GET", "/v1/models/{model}"): Role.analyst,
    ("POST", "/v1/files"): Role.data,
    ("GET", "/v1/files"): Role.data,
    ("GET", "/v1/files/{file_id}"): Role.data,
    ("GET", "/v1/files/{file_id}/content"): Role.data,
    ("DELETE", "/v1/files/{file_id}"): Role.data,
    ("POST", "/v1/admin/keys"): Role.admin,
    ("GET", "/v1/admin/keys"): Role.admin,
    ("POST", "/v1/admin/keys/{key_id}/revoke"): Role.admin,
    ("GET", "/v1/admin/audit"): Role.admin,
}


def app_routes(app) -> set[tuple[str, str]]:
    routes = set()
    for route in app.routes:
        if isinstance(route, APIRoute | Route):
            routes.update((method, route.path) for method in route.methods - {"HEAD"})
    return routes


def test_every_route_is_in_the_matrix(app):
    assert app_routes(app) == set(REQUIRED_ROLE)


class RequestFactory:
    """Builds a request that succeeds for a strong enough key: fresh objects for routes that consume them."""

    def __init__(self, client: TestClient, admin_headers: dict, valid_dataset: bytes, sessions, make_key) -> None:
        self.client, self.admin, self.dataset, self.sessions, self.make_key = (
            client,
            admin_headers,
            valid_dataset,
            sessions,
            make_key,
        )

    def new_file(self) -> str:
        response = self.client.post(
            "/v1/files",
            headers=self.admin,
            data={"purpose": "fine-tune"},
            files={"file": ("train.jsonl", self.dataset)},
        )
        assert response.status_code == 200, response.text
        return response.json()["id"]

    def registered_model(self) -> str:
        with self.sessions() as session:
            if session.query(ModelVersion).filter_by(name="zaya-tiny").count() == 0:
                session.add(ModelVersion(name="zaya-tiny", version=1, kind="full", path="/models/zaya-tiny"))
                session.commit()
        return "zaya-tiny"

    def build(self, method: str, path: str) -> dict:
        kwargs: dict = {}
        if "{file_id}" in path:
            path = path.replace("{file_id}", self.new_file())
        if "{key_id}" in path:
            path = path.replace("{key_id}", self.make_key(Role.analyst, "to revoke")[0])
        if "{model}" in path:
            path = path.replace("{model}", self.registered_model())
        if path == "/v1/files" and method == "POST":
            kwargs = {"data": {"purpose": "fine-tune"}, "files": {"file": ("train.jsonl", self.dataset)}}
        if path == "/v1/admin/keys" and method == "POST":
            kwargs = {"json": {"name": "made in matrix", "role": "analyst"}}
        return {"method": method, "url": path, **kwargs}


@pytest.mark.parametrize(("method", "path"), sorted(REQUIRED_ROLE))
def test_route_role_matrix(method, path, client, keys, auth, valid_dataset, sessions, make_key):
    required = REQUIRED_ROLE[(method, path)]
    factory = RequestFactory(client, auth("admin"), valid_dataset, sessions, make_key)

    anonymous = client.request(**factory.build(method, path))
    assert anonymous.status_code == (200 if required is PUBLIC else 401), anonymous.text

    for role in Role:
        response = client.request(**factory.build(method, path), headers=auth(role.value))
        if required is PUBLIC or role.allows(required):
            assert 200 <= response.status_code < 300, f"{role}: {response.status_code} {response.text}"
        else:
            assert response.status_code == 403, f"{role}: {response.status_code} {response.text}"
            assert response.json()["error"]["type"] == "permission_error"


def test_bad_keys_get_401_in_openai_shape(client, keys):
    for headers in (
        {},
        {"Authorization": "Bearer zk-not-a-real-key"},
        {"Authorization": f"Basic {keys['admin']}"},
        {"Authorization": f"Bearer {keys['admin']}x"},
    ):
        response = client.get("/v1/models", headers=headers)
        assert response.status_code == 401
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert response.json()["error"]["type"] == "authentication_error"


def test_a_malformed_body_without_a_key_is_still_401(client):
    response = client.post("/v1/admin/keys", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 401


def test_revocation_takes_effect_on_the_next_request(client, auth, make_key):
    key_id, secret = make_key(Role.data, "soon revoked")
    assert client.get("/v1/files", headers=auth(secret)).status_code == 200
    revoked = client.post(f"/v1/admin/keys/{key_id}/revoke", headers=auth("admin"))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert client.get("/v1/files", headers=auth(secret)).status_code == 401


def test_validation_errors_name_the_field(client, auth):
    response = client.post("/v1/admin/keys", headers=auth("admin"), json={"name": "x", "role": "superuser"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "role"
    malformed = client.post(
        "/v1/admin/keys", headers={**auth("admin"), "Content-Type": "application/json"}, content=b"{not json"
    )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["code"] == "invalid_json"
    bad_query = client.get("/v1/files", headers=auth("admin"), params={"limit": 0})
    assert bad_query.status_code == 400 and bad_query.json()["error"]["param"] == "limit"


def test_unknown_route_and_method_errors_are_openai_shaped(client, auth):
    missing = client.get("/v1/nothing-here", headers=auth("admin"))
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    wrong_method = client.put("/v1/files", headers=auth("admin"))
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_server_errors_never_leak_internals(app, auth):
    @app.get("/v1/boom")
    def boom():
        raise RuntimeError("password=hunter2 at /srv/secret/path")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/v1/boom", headers=auth("analyst"))
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "hunter2" not in response.text and "RuntimeError" not in response.text


def test_oversized_json_bodies_get_413(client, auth, settings):
    body = b"x" * (settings.max_request_bytes + 1)
    response = client.post(
        "/v1/admin/keys", headers={**auth("admin"), "Content-Type": "application/json"}, content=body
    )
    assert response.status_code == 413
