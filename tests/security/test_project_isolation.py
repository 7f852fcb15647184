"""Two teams in two projects, tried as an outside tester would: with keys of every role in project `fraud`, nothing
of project `risk` can be listed, read, downloaded, deleted, cancelled, trained on or chatted with, through the API
or the console, and whatever is tried answers exactly as a missing object would. Admin keys see both, and filter
by project. Runs on SQLite, and on PostgreSQL in the PostgreSQL pass.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import pytest
from sqlalchemy import select

from server.db.models import InferenceRecord, Role
from server.services import jobs
from server.services.access import Scope

CHAT = {"messages": [{"role": "user", "content": "Balance of account 3?"}], "max_tokens": 2}


@dataclass
class Team:
    project_id: str
    keys: dict[Role, str]

    def headers(self, role: Role) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}


@pytest.fixture
def teams(make_project, make_key) -> dict[str, Team]:
    made = {}
    for name in ("risk", "fraud"):
        project_id = make_project(name)
        made[name] = Team(
            project_id, {role: make_key(role, f"{name} {role.value}", project_id=project_id)[1] for role in Role}
        )
    return made


@pytest.fixture
def base_model(client, auth, tiny_model_dir) -> str:
    """A base model an admin registered: usable by every project."""
    response = client.post(
        "/v1/admin/models", headers=auth("admin"), json={"name": "zaya", "path": str(tiny_model_dir)}
    )
    assert response.status_code == 200, response.text
    return response.json()["id"]


def upload(client, team: Team, dataset: bytes) -> str:
    response = client.post(
        "/v1/files",
        headers=team.headers(Role.data),
        data={"purpose": "fine-tune"},
        files={"file": ("cases.jsonl", dataset)},
    )
    assert response.status_code == 200, response.text
    return response.json()["id"]


def create_job(client, team: Team, training_file: str, model: str = "zaya") -> str:
    body = {"model": model, "training_file": training_file, "metadata": {"team": "shared-label"}}
    response = client.post("/v1/fine_tuning/jobs", headers=team.headers(Role.data), json=body)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def finish_job(sessions, job_id: str, output_dir) -> str:
    """Run the job's queue steps as a worker does, its checkpoint at step 2 and its output being `output_dir`: its
    model version is registered."""
    with sessions() as session:
        assert jobs.finish_validation(session, job_id, None)
        lease = jobs.claim_next_job(session, worker_id="test-worker", lease_seconds=60)
        assert lease is not None and lease.job_id == job_id
        jobs.record_checkpoint(session, lease, step=2, path=str(output_dir), metrics=None)
        jobs.finish_succeeded(session, lease, output_dir=str(output_dir), metrics=None, trained_tokens=10)
        return jobs.get_job(session, Scope.everything(), job_id).fine_tuned_model


def same_answer(client, headers: dict, method: str, theirs: str, missing: str, **request) -> int:
    """`method` on the url (or json) naming `theirs`, and on one naming `missing`: identical answers, id aside."""

    def send(name: str):
        url = request["url"].replace("{}", name)
        json = {key: name if value == "{}" else value for key, value in request.get("json", {}).items()} or None
        return client.request(method, url, headers=headers, json=json, params=request.get("params"))

    answers = send(theirs), send(missing)
    assert answers[0].status_code == answers[1].status_code, [answer.text for answer in answers]
    assert answers[0].text.replace(theirs, "<>") == answers[1].text.replace(missing, "<>")
    return answers[0].status_code


def missing_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def ids(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [item["id"] for item in response.json()["data"]]


def test_another_projects_files_cannot_be_listed_read_downloaded_or_deleted(client, auth, teams, valid_dataset):
    risk, fraud = teams["risk"], teams["fraud"]
    risk_file = upload(client, risk, valid_dataset)
    fraud_file = upload(client, fraud, valid_dataset)

    headers = fraud.headers(Role.data)
    assert ids(client.get("/v1/files", headers=headers)) == [fraud_file]
    for method, url in (("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"), ("DELETE", "/v1/files/{}")):
        assert same_answer(client, headers, method, risk_file, missing_id("file-"), url=url) == 404
    # A page cursor naming their file is an unknown cursor.
    for cursor in (risk_file, missing_id("file-")):
        answer = client.get("/v1/files", headers=headers, params={"after": cursor})
        assert answer.status_code == 400 and answer.json()["error"]["message"].endswith(cursor)
    # The owner still has the file and its content: the attempts changed nothing.
    assert client.get(f"/v1/files/{risk_file}/content", headers=risk.headers(Role.data)).content == valid_dataset

    # Admin keys see every project's files, and one project's with `project` (id or name).
    assert set(ids(client.get("/v1/files", headers=auth("admin")))) == {risk_file, fraud_file}
    assert ids(client.get("/v1/files", headers=auth("admin"), params={"project": "risk"})) == [risk_file]
    assert ids(client.get("/v1/files", headers=fraud.headers(Role.admin), params={"project": risk.project_id})) == [
        risk_file
    ]


def test_a_file_in_use_by_another_projects_job_does_not_name_that_job(client, teams, valid_dataset, base_model):
    risk, fraud = teams["risk"], teams["fraud"]
    risk_file = upload(client, risk, valid_dataset)
    # An admin key of fraud trains on risk's file (admins see every project); the job belongs to fraud.
    body = {"model": "zaya", "training_file": risk_file}
    admin_job = client.post("/v1/fine_tuning/jobs", headers=fraud.headers(Role.admin), json=body)
    assert admin_job.status_code == 200, admin_job.text
    refused = client.delete(f"/v1/files/{risk_file}", headers=risk.headers(Role.data))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "file_in_use"
    assert admin_job.json()["id"] not in refused.text
    risk_job = create_job(client, risk, upload(client, risk, valid_dataset))
    own = client.get("/v1/fine_tuning/jobs/" + risk_job, headers=risk.headers(Role.data)).json()["training_file"]
    assert risk_job in client.delete(f"/v1/files/{own}", headers=risk.headers(Role.data)).json()["error"]["message"]


def test_another_projects_jobs_cannot_be_seen_controlled_or_trained_on(client, auth, teams, valid_dataset, base_model):
    risk, fraud = teams["risk"], teams["fraud"]
    risk_file = upload(client, risk, valid_dataset)
    risk_job = create_job(client, risk, risk_file)
    fraud_job = create_job(client, fraud, upload(client, fraud, valid_dataset))
    headers = fraud.headers(Role.data)

    assert ids(client.get("/v1/fine_tuning/jobs", headers=headers)) == [fraud_job]
    metadata = {"metadata[team]": "shared-label"}
    assert ids(client.get("/v1/fine_tuning/jobs", headers=headers, params=metadata)) == [fraud_job]
    for method, url in (
        ("GET", "/v1/fine_tuning/jobs/{}"),
        ("GET", "/v1/fine_tuning/jobs/{}/events"),
        ("GET", "/v1/fine_tuning/jobs/{}/checkpoints"),
        ("POST", "/v1/fine_tuning/jobs/{}/cancel"),
        ("POST", "/v1/fine_tuning/jobs/{}/pause"),
        ("POST", "/v1/fine_tuning/jobs/{}/resume"),
    ):
        assert same_answer(client, headers, method, risk_job, missing_id("ftjob-"), url=url) == 404
    for cursor in (risk_job, missing_id("ftjob-")):
        answer = client.get("/v1/fine_tuning/jobs", headers=headers, params={"after": cursor})
        assert answer.status_code == 400 and answer.json()["error"]["message"].endswith(cursor)
    status = client.get(f"/v1/fine_tuning/jobs/{risk_job}", headers=risk.headers(Role.data)).json()["status"]
    assert status == "validating_files"  # the cancel and pause attempts changed nothing

    # Training on their file, or estimating a job on it, is refused as for a file that does not exist.
    for url in ("/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/estimate"):
        body = {"model": "zaya", "training_file": "{}"}
        assert same_answer(client, headers, "POST", risk_file, missing_id("file-"), url=url, json=body) == 400
        body = {"model": "zaya", "training_file": upload(client, fraud, valid_dataset), "validation_file": "{}"}
        assert same_answer(client, headers, "POST", risk_file, missing_id("file-"), url=url, json=body) == 400

    everything = ids(client.get("/v1/fine_tuning/jobs", headers=auth("admin")))
    assert set(everything) == {risk_job, fraud_job}
    assert ids(client.get("/v1/fine_tuning/jobs", headers=auth("admin"), params={"project": "fraud"})) == [fraud_job]


def test_another_projects_fine_tuned_model_cannot_be_used_or_listed(
    client, auth, teams, valid_dataset, base_model, sessions, tiny_model_dir
):
    risk, fraud = teams["risk"], teams["fraud"]
    risk_job = create_job(client, risk, upload(client, risk, valid_dataset))
    tuned = finish_job(sessions, risk_job, tiny_model_dir)
    [version] = client.get("/v1/admin/models", headers=auth("admin"), params={"name": tuned}).json()["data"]
    assert version["projects"] == [risk.project_id]  # a job's result belongs to the job's project

    # Fraud's keys (every role but admin) get the answer an unknown model gets, in every form of its name.
    inference = {"/v1/chat/completions": CHAT, "/v1/completions": {"prompt": "Case", "max_tokens": 2}}
    forms = (
        (tuned, tuned[:-4] + "beef"),
        (f"{tuned}@{version['id']}", f"{tuned}@{missing_id('mv-')}"),
        (f"{tuned}:ckpt-step-2", f"{tuned}:ckpt-step-3"),  # its job's checkpoint
    )
    for role in (Role.analyst, Role.data):
        headers = fraud.headers(role)
        assert tuned not in [model["id"] for model in client.get("/v1/models", headers=headers).json()["data"]]
        for name, missing in forms:
            for url, body in inference.items():
                assert same_answer(client, headers, "POST", name, missing, url=url, json={"model": "{}", **body}) == 404
            if "ckpt" not in name:
                assert same_answer(client, headers, "GET", name, missing, url="/v1/models/{}") == 404
            assert same_answer(client, headers, "GET", name, missing, url="/v1/models/{}/tokenizer") == 404
    # Nor can they fine-tune it further.
    body = {"model": "{}", "training_file": upload(client, fraud, valid_dataset)}
    headers = fraud.headers(Role.data)
    assert (
        same_answer(client, headers, "POST", tuned, tuned[:-4] + "beef", url="/v1/fine_tuning/jobs", json=body) == 404
    )

    for name in (tuned, f"{tuned}:ckpt-step-2"):
        answered = client.post("/v1/chat/completions", headers=risk.headers(Role.analyst), json={"model": name, **CHAT})
        assert answered.status_code == 200, answered.text
    assert client.post("/v1/chat/completions", headers=auth("admin"), json={"model": tuned, **CHAT}).status_code == 200

    # Every inference record belongs to its key's project, refused ones too.
    with sessions() as session:
        records = session.execute(select(InferenceRecord.project_id, InferenceRecord.status_code)).all()
    assert {(project, status) for project, status in records} >= {(risk.project_id, 200), (fraud.project_id, 404)}


def test_a_base_model_is_shared_until_an_admin_limits_it(client, auth, teams, base_model):
    risk, fraud = teams["risk"], teams["fraud"]

    def usable(team: Team) -> bool:
        listed = "zaya" in [
            model["id"] for model in client.get("/v1/models", headers=team.headers(Role.analyst)).json()["data"]
        ]
        chat = client.post("/v1/chat/completions", headers=team.headers(Role.analyst), json={"model": "zaya", **CHAT})
        assert chat.status_code in (200, 404), chat.text
        assert listed is (chat.status_code == 200)
        return listed

    assert usable(risk) and usable(fraud)
    limited = client.post(f"/v1/admin/models/{base_model}/projects", headers=auth("admin"), json={"projects": ["risk"]})
    assert limited.status_code == 200 and limited.json()["projects"] == [risk.project_id]
    assert usable(risk) and not usable(fraud)
    unknown = client.post(f"/v1/admin/models/{base_model}/projects", headers=auth("admin"), json={"projects": ["x"]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "projects"
    opened = client.post(f"/v1/admin/models/{base_model}/projects", headers=auth("admin"), json={"projects": []})
    assert opened.status_code == 200 and opened.json()["projects"] == []
    assert usable(risk) and usable(fraud)

    # Registered limited from the start: an admin names the projects at registration.
    path = client.get(f"/v1/admin/models/{base_model}", headers=auth("admin")).json()["path"]
    body = {"name": "zaya-risk", "path": path, "projects": ["risk"]}
    assert client.post("/v1/admin/models", headers=auth("admin"), json=body).json()["projects"] == [risk.project_id]
    listing = client.get("/v1/admin/models", headers=auth("admin"), params={"project": "fraud"}).json()["data"]
    assert [version["name"] for version in listing] == ["zaya"]


def test_the_console_shows_a_signed_in_key_its_own_project_only(
    client, teams, valid_dataset, base_model, sessions, tiny_model_dir, sign_in, HTML
):
    risk, fraud = teams["risk"], teams["fraud"]
    risk_file = upload(client, risk, valid_dataset)
    risk_job = create_job(client, risk, risk_file)
    tuned = finish_job(sessions, risk_job, tiny_model_dir)
    fraud_file = upload(client, fraud, valid_dataset)

    sign_in(client, fraud.keys[Role.data])
    for page in ("/console/jobs", "/console/datasets", "/console/playground"):
        shown = client.get(page, headers=HTML)
        assert shown.status_code == 200
        assert risk_file not in shown.text and risk_job not in shown.text and tuned not in shown.text
    assert fraud_file in client.get("/console/datasets", headers=HTML).text
    for page, theirs, missing in (
        ("/console/jobs/{}", risk_job, missing_id("ftjob-")),
        ("/console/datasets/{}", risk_file, missing_id("file-")),
    ):
        assert same_answer(client, {}, "GET", theirs, missing, url=page) == 404
    # Their model cannot even tokenize our own file's preview.
    preview = client.get(f"/console/datasets/{fraud_file}", params={"model": tuned}, headers=HTML)
    assert preview.status_code == 200 and f"The model &#39;{tuned}&#39; does not exist" in preview.text

    client.cookies.clear()
    sign_in(client, risk.keys[Role.data])
    assert risk_job in client.get("/console/jobs", headers=HTML).text
    assert client.get(f"/console/datasets/{risk_file}", params={"model": tuned}, headers=HTML).status_code == 200


def test_the_audit_log_carries_each_actors_project(client, auth, teams, valid_dataset):
    risk, fraud = teams["risk"], teams["fraud"]
    risk_file = upload(client, risk, valid_dataset)
    assert client.delete(f"/v1/files/{risk_file}", headers=fraud.headers(Role.data)).status_code == 404

    def audited(**filters) -> list[tuple[str, str, int]]:
        entries = client.get("/v1/admin/audit", headers=auth("admin"), params=filters).json()["data"]
        return [(entry["action"], entry["project_id"], entry["status_code"]) for entry in entries]

    assert audited(project="fraud") == [("files.delete", fraud.project_id, 404)]
    assert audited(project="risk") == [("files.create", risk.project_id, 200)]
    assert len(audited()) == 2


def test_keys_are_made_in_a_named_project_and_listed_by_project(client, auth, teams):
    made = client.post(
        "/v1/admin/keys", headers=auth("admin"), json={"name": "risk bot", "role": "data", "project": "risk"}
    )
    assert made.status_code == 200 and made.json()["project_id"] == teams["risk"].project_id
    by_id = client.post(
        "/v1/admin/keys",
        headers=auth("admin"),
        json={"name": "fraud bot", "role": "data", "project": teams["fraud"].project_id},
    )
    assert by_id.json()["project_id"] == teams["fraud"].project_id
    unknown = client.post(
        "/v1/admin/keys", headers=auth("admin"), json={"name": "x", "role": "data", "project": "nope"}
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "project"
    extra = client.post("/v1/admin/keys", headers=auth("admin"), json={"name": "x", "role": "data", "team": "risk"})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "team"

    listed = client.get("/v1/admin/keys", headers=auth("admin"), params={"project": "risk"}).json()["data"]
    assert {key["project_id"] for key in listed} == {teams["risk"].project_id}
    assert "risk bot" in [key["name"] for key in listed]

    projects = client.get("/v1/admin/projects", headers=auth("admin")).json()["data"]
    assert [project["name"] for project in projects] == ["default", "risk", "fraud"]
    duplicate = client.post("/v1/admin/projects", headers=auth("admin"), json={"name": "risk"})
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "project_exists"
    for bad in ("Risk", "proj_x", "a b", ""):
        assert client.post("/v1/admin/projects", headers=auth("admin"), json={"name": bad}).status_code == 400
    assert client.get("/v1/admin/projects/proj_nothing", headers=auth("admin")).status_code == 404
