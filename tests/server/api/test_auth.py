"""Every route x every role: no key -> 401, too weak a role -> 403, enough -> 2xx. Every route x every role of
another project: its objects answer exactly as missing ones, its lists leave them out, admin keys see them. Plus the
error shapes."""

from __future__ import annotations

import secrets

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from server.db.models import DEFAULT_PROJECT_ID, ModelVersion, Role
from server.services import approvals, jobs, registry

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
    ("GET", "/v1/models/{model}/tokenizer"): Role.analyst,
    ("POST", "/v1/chat/completions"): Role.analyst,
    ("POST", "/v1/completions"): Role.analyst,
    ("POST", "/v1/files"): Role.data,
    ("GET", "/v1/files"): Role.data,
    ("GET", "/v1/files/{file_id}"): Role.data,
    ("GET", "/v1/files/{file_id}/content"): Role.data,
    ("DELETE", "/v1/files/{file_id}"): Role.data,
    ("POST", "/v1/admin/keys"): Role.admin,
    ("GET", "/v1/admin/keys"): Role.admin,
    ("POST", "/v1/admin/keys/{key_id}/revoke"): Role.admin,
    ("POST", "/v1/admin/projects"): Role.admin,
    ("GET", "/v1/admin/projects"): Role.admin,
    ("GET", "/v1/admin/projects/{project_id}"): Role.admin,
    ("GET", "/v1/admin/audit"): Role.admin,
    ("POST", "/v1/fine_tuning/jobs"): Role.data,
    ("POST", "/v1/fine_tuning/jobs/estimate"): Role.data,
    ("GET", "/v1/fine_tuning/jobs"): Role.data,
    ("GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}"): Role.data,
    ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel"): Role.data,
    ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/pause"): Role.data,
    ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/resume"): Role.data,
    ("GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/events"): Role.data,
    ("GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints"): Role.data,
    ("GET", "/v1/admin/models"): Role.admin,
    ("POST", "/v1/admin/models"): Role.admin,
    ("GET", "/v1/admin/models/{version_id}"): Role.admin,
    ("GET", "/v1/admin/models/{version_id}/lineage"): Role.admin,
    ("POST", "/v1/admin/models/{version_id}/archive"): Role.admin,
    ("POST", "/v1/admin/models/{version_id}/projects"): Role.admin,
    ("POST", "/v1/admin/models/{version_id}/promote"): Role.admin,
    ("GET", "/v1/admin/model_aliases"): Role.admin,
    ("GET", "/v1/admin/model_aliases/history"): Role.admin,
    ("POST", "/v1/admin/model_aliases/rollback"): Role.admin,
    ("GET", "/v1/admin/model_aliases/approvals"): Role.admin,
    ("GET", "/v1/admin/model_aliases/approvals/{approval_id}"): Role.admin,
    ("POST", "/v1/admin/model_aliases/approvals/{approval_id}/approve"): Role.admin,
    ("POST", "/v1/admin/model_aliases/approvals/{approval_id}/reject"): Role.admin,
    # The web console's pages (its actions are the API routes above, called with the session's key).
    ("GET", "/console/"): Role.analyst,
    ("GET", "/console/playground"): Role.analyst,
    ("GET", "/console/jobs"): Role.data,
    ("GET", "/console/jobs/{fine_tuning_job_id}"): Role.data,
    ("GET", "/console/datasets"): Role.data,
    ("GET", "/console/datasets/{file_id}"): Role.data,
    ("GET", "/console/models"): Role.admin,
    ("GET", "/console/keys"): Role.admin,
    ("GET", "/console/audit"): Role.admin,
}


INFERENCE_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
}


# How each route keeps projects apart (`server.services.access`). A route missing here fails
# `test_every_route_has_an_isolation_rule`.
OWN = "names one object: another project's answers exactly as a missing one"
LISTS = "lists the caller's project's objects only (admin keys: every project's)"
CREATES = "makes its object in the caller's project, from inputs the caller's project may use"
ADMIN = "admin keys only, which see every project"
NONE = "shows no project's objects"

ISOLATION = {
    ("GET", "/health"): NONE,
    ("GET", "/metrics"): ADMIN,
    ("GET", "/openapi.json"): NONE,
    ("GET", "/docs"): NONE,
    ("GET", "/docs/oauth2-redirect"): NONE,
    ("GET", "/redoc"): NONE,
    ("GET", "/v1/models"): LISTS,
    ("GET", "/v1/models/{model}"): OWN,
    ("GET", "/v1/models/{model}/tokenizer"): OWN,
    ("POST", "/v1/chat/completions"): CREATES,
    ("POST", "/v1/completions"): CREATES,
    ("POST", "/v1/files"): CREATES,
    ("GET", "/v1/files"): LISTS,
    ("GET", "/v1/files/{file_id}"): OWN,
    ("GET", "/v1/files/{file_id}/content"): OWN,
    ("DELETE", "/v1/files/{file_id}"): OWN,
    ("POST", "/v1/fine_tuning/jobs"): CREATES,
    ("POST", "/v1/fine_tuning/jobs/estimate"): CREATES,
    ("GET", "/v1/fine_tuning/jobs"): LISTS,
    ("GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}"): OWN,
    ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel"): OWN,
    ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/pause"): OWN,
    ("POST", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/resume"): OWN,
    ("GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/events"): OWN,
    ("GET", "/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints"): OWN,
    ("GET", "/console/"): NONE,
    ("GET", "/console/playground"): LISTS,
    ("GET", "/console/jobs"): LISTS,
    ("GET", "/console/jobs/{fine_tuning_job_id}"): OWN,
    ("GET", "/console/datasets"): LISTS,
    ("GET", "/console/datasets/{file_id}"): OWN,
}
# Admin keys see every project: the admin routes' rule is their role.
ISOLATION |= {route: ADMIN for route, role in REQUIRED_ROLE.items() if role is Role.admin and route not in ISOLATION}


def app_routes(app) -> set[tuple[str, str]]:
    routes = set()
    for route in app.routes:
        if isinstance(route, APIRoute | Route):
            routes.update((method, route.path) for method in route.methods - {"HEAD"})
    return routes


def test_every_route_is_in_the_matrix(app):
    assert app_routes(app) == set(REQUIRED_ROLE)


def test_every_route_has_an_isolation_rule(app):
    assert app_routes(app) == set(ISOLATION)
    assert all(REQUIRED_ROLE[route] is Role.admin for route, rule in ISOLATION.items() if rule is ADMIN)


class RequestFactory:
    """Builds a request that succeeds for a strong enough key: fresh objects for routes that consume them."""

    def __init__(
        self, client: TestClient, admin_headers: dict, valid_dataset: bytes, sessions, make_key, model_dir=None
    ) -> None:
        self.client, self.admin, self.dataset, self.sessions, self.make_key = (
            client,
            admin_headers,
            valid_dataset,
            sessions,
            make_key,
        )
        self.model_dir = model_dir
        # Models named in requests are limited to the default project (where the admin key's objects are).
        self.limited = False

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
        if self.limited:
            return self.limited_model()
        with self.sessions() as session:
            if session.query(ModelVersion).filter_by(name="zaya-tiny").count() == 0:
                session.add(ModelVersion(name="zaya-tiny", version=1, kind="full", path="/models/zaya-tiny"))
                session.commit()
        return "zaya-tiny"

    def limited_model(self) -> str:
        """A servable model version limited to the default project (as a fine-tuning job's result is to its job's)."""
        with self.sessions() as session:
            if session.query(ModelVersion).filter_by(name="matrix-limited").count() == 0:
                registry.register_version(
                    session, name="matrix-limited", path=self.model_dir, projects=[DEFAULT_PROJECT_ID]
                )
                session.commit()
        return "matrix-limited"

    def servable_model(self) -> str:
        if self.limited:
            return self.limited_model()
        with self.sessions() as session:
            if session.query(ModelVersion).filter_by(name="zaya-servable").count() == 0:
                session.add(ModelVersion(name="zaya-servable", version=1, kind="full", path=str(self.model_dir)))
                session.commit()
        return "zaya-servable"

    def new_job(self, *, paused: bool = False) -> str:
        """A queued job (its file validation passed), or a paused one."""
        body = {"model": self.servable_model(), "training_file": self.new_file()}
        job_id = self.client.post("/v1/fine_tuning/jobs", headers=self.admin, json=body).json()["id"]
        with self.sessions() as session:
            jobs.finish_validation(session, job_id, None)
        if paused:
            self.client.post(f"/v1/fine_tuning/jobs/{job_id}/pause", headers=self.admin)
        return job_id

    def new_version(self, name: str | None = None) -> str:
        name = name or f"matrix-{secrets.token_hex(4)}"
        with self.sessions() as session:
            version = registry.register_version(session, name=name, path=self.model_dir)
            session.commit()
            return version.id

    def moved_alias(self) -> str:
        """A model whose `production` alias moved twice, so it can be rolled back."""
        name = f"matrix-{secrets.token_hex(4)}"
        with self.sessions() as session:
            for _ in range(2):
                version = registry.register_version(session, name=name, path=self.model_dir)
                registry.promote(session, version, reason="matrix", actor=None)
            session.commit()
        return name

    def pending_approval(self) -> str:
        """A four-eyes request filed by another admin key, so the caller's key may approve it."""
        requester = self.make_key(Role.admin, "requester")[0]
        with self.sessions() as session:
            version = registry.get_version(session, self.new_version())
            move = registry.plan_promotion(session, version)
            approval = approvals.move_or_request(
                session, move, reason="matrix", force=False, actor=requester, four_eyes=True
            )
            session.commit()
            return approval.id

    def build(self, method: str, path: str) -> dict:
        kwargs: dict = {}
        if "{fine_tuning_job_id}" in path:
            path = path.replace("{fine_tuning_job_id}", self.new_job(paused=path.endswith("/resume")))
        if "{approval_id}" in path:
            path = path.replace("{approval_id}", self.pending_approval())
        if "{version_id}" in path:
            path = path.replace("{version_id}", self.new_version())
        if path in ("/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/estimate") and method == "POST":
            kwargs = {"json": {"model": self.servable_model(), "training_file": self.new_file()}}
        if path == "/v1/admin/models" and method == "POST":
            kwargs = {"json": {"name": f"matrix-{secrets.token_hex(4)}", "path": str(self.model_dir)}}
        if path.endswith("/promote"):
            kwargs = {"json": {"reason": "matrix"}}
        if path.endswith("/rollback"):
            kwargs = {"json": {"model_name": self.moved_alias(), "reason": "matrix"}}
        if "{file_id}" in path:
            path = path.replace("{file_id}", self.new_file())
        if "{key_id}" in path:
            path = path.replace("{key_id}", self.make_key(Role.analyst, "to revoke")[0])
        if "{model}" in path:
            # Its tokenizer is served from the version's directory: a model with files on disk.
            model = self.servable_model() if path.endswith("/tokenizer") else self.registered_model()
            path = path.replace("{model}", model)
        if path == "/v1/files" and method == "POST":
            kwargs = {"data": {"purpose": "fine-tune"}, "files": {"file": ("train.jsonl", self.dataset)}}
        if path == "/v1/admin/keys" and method == "POST":
            kwargs = {"json": {"name": "made in matrix", "role": "analyst"}}
        if path == "/v1/admin/projects" and method == "POST":
            kwargs = {"json": {"name": f"matrix-{secrets.token_hex(4)}"}}
        if "{project_id}" in path:
            path = path.replace("{project_id}", DEFAULT_PROJECT_ID)
        if path.endswith("/projects") and path.startswith("/v1/admin/models/"):
            kwargs = {"json": {"projects": ["default"]}}
        if path in INFERENCE_BODIES and method == "POST":
            kwargs = {"json": {"model": self.servable_model(), **INFERENCE_BODIES[path]}}
        return {"method": method, "url": path, **kwargs}


@pytest.mark.parametrize(("method", "path"), sorted(REQUIRED_ROLE))
def test_route_role_matrix(method, path, client, keys, auth, valid_dataset, sessions, make_key, tiny_model_dir):
    required = REQUIRED_ROLE[(method, path)]
    factory = RequestFactory(client, auth("admin"), valid_dataset, sessions, make_key, tiny_model_dir)

    anonymous = client.request(**factory.build(method, path))
    assert anonymous.status_code == (200 if required is PUBLIC else 401), anonymous.text

    for role in Role:
        response = client.request(**factory.build(method, path), headers=auth(role.value))
        if required is PUBLIC or role.allows(required):
            assert 200 <= response.status_code < 300, f"{role}: {response.status_code} {response.text}"
        else:
            assert response.status_code == 403, f"{role}: {response.status_code} {response.text}"
            assert response.json()["error"]["type"] == "permission_error"


@pytest.fixture
def other_project(make_project, make_key) -> dict[Role, str]:
    """A key of every role in a second project, `other` (the `keys` fixture's are in the default project)."""
    project_id = make_project("other")
    return {role: make_key(role, f"other {role.value}", project_id=project_id)[1] for role in Role}


@pytest.fixture
def factory(client, auth, valid_dataset, sessions, make_key, tiny_model_dir) -> RequestFactory:
    """Requests on objects of the default project (made with its admin key), naming a model limited to it."""
    built = RequestFactory(client, auth("admin"), valid_dataset, sessions, make_key, tiny_model_dir)
    built.limited = True
    return built


def named_object(template: str, request: dict) -> str:
    """The object a built request names: in its path where the route's template has a parameter, else in its body."""
    for part, value in zip(template.split("/"), request["url"].split("/"), strict=True):
        if part.startswith("{"):
            return value
    body = request["json"]
    return body.get("training_file") or body["model"]


def naming_instead(request: dict, name: str, other: str) -> dict:
    """`request` naming `other` where it named `name`."""
    renamed = {**request, "url": request["url"].replace(name, other)}
    if "json" in request:
        renamed["json"] = {key: other if value == name else value for key, value in request["json"].items()}
    return renamed


def assert_answered_as_missing(client, request: dict, name: str, headers: dict, status: int) -> None:
    """The request on another project's object gets, id aside, exactly the answer a request on a missing one gets."""
    missing = name[:-4] + secrets.token_hex(2)
    theirs = client.request(**request, headers=headers)
    absent = client.request(**naming_instead(request, name, missing), headers=headers)
    assert theirs.status_code == absent.status_code == status, (theirs.text, absent.text)
    assert theirs.text.replace(name, "<id>") == absent.text.replace(missing, "<id>")


@pytest.mark.parametrize(("method", "path"), sorted(route for route, rule in ISOLATION.items() if rule is OWN))
def test_another_projects_object_answers_as_a_missing_one(method, path, client, auth, factory, other_project):
    required = REQUIRED_ROLE[(method, path)]
    owner = client.request(**factory.build(method, path), headers=auth(required.value))
    assert 200 <= owner.status_code < 300, owner.text
    for role in Role:
        request = factory.build(method, path)
        if not role.allows(required):
            assert client.request(**request, headers=auth(other_project[role])).status_code == 403
        elif role is Role.admin:
            response = client.request(**request, headers=auth(other_project[role]))
            assert 200 <= response.status_code < 300, f"{role}: {response.text}"
        else:
            assert_answered_as_missing(client, request, named_object(path, request), auth(other_project[role]), 404)


def listed_object(factory: RequestFactory, path: str) -> str:
    if path in ("/v1/files", "/console/datasets"):
        return factory.new_file()
    if path in ("/v1/fine_tuning/jobs", "/console/jobs"):
        return factory.new_job()
    return factory.limited_model()


@pytest.mark.parametrize(("method", "path"), sorted(route for route, rule in ISOLATION.items() if rule is LISTS))
def test_lists_leave_out_another_projects_objects(method, path, client, auth, factory, other_project):
    required = REQUIRED_ROLE[(method, path)]
    shown = listed_object(factory, path)

    def listing(secret: str, **params) -> str:
        response = client.request(method, path, headers=auth(secret), params=params)
        assert response.status_code == 200, response.text
        return response.text

    assert shown in listing(required.value)
    for role in Role:
        if role.allows(required):
            assert (shown in listing(other_project[role])) is (role is Role.admin), role
    # Admin keys list one project with `project` (id or name); other keys only their own.
    assert shown not in listing(other_project[Role.admin], project="other")
    assert shown in listing(other_project[Role.admin], project="default")
    assert shown not in listing(other_project[required], project="other")
    named = client.request(method, path, headers=auth(other_project[required]), params={"project": "default"})
    unknown = client.request(method, path, headers=auth(other_project[required]), params={"project": "nothing"})
    assert named.status_code == unknown.status_code == 400
    assert named.json()["error"] == {**unknown.json()["error"], "message": "No such project: default"}


@pytest.mark.parametrize(("method", "path"), sorted(route for route, rule in ISOLATION.items() if rule is CREATES))
def test_creations_use_and_land_in_the_callers_project_only(method, path, client, auth, factory, other_project):
    required = REQUIRED_ROLE[(method, path)]
    if path == "/v1/files":
        made = client.request(**factory.build(method, path), headers=auth(other_project[required]))
        assert made.status_code == 200, made.text
        for role, visible in ((required.value, False), (other_project[required], True)):
            response = client.get(f"/v1/files/{made.json()['id']}", headers=auth(role))
            assert response.status_code == (200 if visible else 404)
        return
    # Jobs from another project's training file, inference on another project's model: as if they were missing.
    status = 404 if path in INFERENCE_BODIES else 400
    for role in Role:
        request = factory.build(method, path)
        if not role.allows(required):
            assert client.request(**request, headers=auth(other_project[role])).status_code == 403
        elif role is Role.admin:
            response = client.request(**request, headers=auth(other_project[role]))
            assert response.status_code == 200, response.text
        else:
            assert_answered_as_missing(client, request, named_object(path, request), auth(other_project[role]), status)
    owner = client.request(**factory.build(method, path), headers=auth(required.value))
    assert owner.status_code == 200, owner.text


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


def test_a_mutating_route_that_raises_is_audited_and_counted_as_500(app, auth, sessions):
    from server.db.models import AuditLog

    @app.post("/v1/boom", name="boom.create")
    def boom():
        raise RuntimeError("no response started")

    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.post("/v1/boom", headers=auth("admin")).status_code == 500
        metrics = client.get("/metrics", headers=auth("admin")).text
    with sessions() as session:
        assert ("boom.create", 500) in [(entry.action, entry.status_code) for entry in session.query(AuditLog)]
    assert 'method="POST",route="/v1/boom",status="500"' in metrics


def test_oversized_json_bodies_get_413(client, auth, settings):
    body = b"x" * (settings.max_request_bytes + 1)
    response = client.post(
        "/v1/admin/keys", headers={**auth("admin"), "Content-Type": "application/json"}, content=body
    )
    assert response.status_code == 413
