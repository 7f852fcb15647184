"""Governance of alias moves over HTTP: the four-eyes rule (a second admin key approves each promotion and rollback)
and the evaluation gate (a promotion may not make an alias worse on held-out loss or, on the same validation file,
on its task evaluation)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.db.models import AuditLog, ModelVersion
from server.jobs.worker import Worker, WorkerConfig
from server.services import registry
from server.services.model_resolution import find_version


@pytest.fixture
def checkpoint(tmp_path):
    """A registrable checkpoint dir whose `metrics.json` and `evaluation.json` (as the fine-tuning trainer writes
    them) hold `loss` and a task evaluation (`exact` match and Disposition accuracy on the file `data`)."""

    def make(name: str, loss: float | None = None, exact: float | None = None, disposition=None, data="a") -> str:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text('{"model_type": "zaya"}')
        if loss is not None:
            (directory / "metrics.json").write_text(json.dumps({"step": 4, "valid_loss": 9.9, "best_valid_loss": loss}))
        if exact is not None:
            fields = {"Disposition": {"accuracy": disposition, "n": 10}}
            evaluation = {"n_examples": 10, "exact_match": exact, "fields": fields, "data_sha256": data * 64}
            (directory / "evaluation.json").write_text(json.dumps(evaluation))
        return str(directory)

    return make


def governed_client(settings, **changes) -> Iterator[TestClient]:
    with TestClient(create_app(settings.model_copy(update=changes))) as client:
        yield client


@pytest.fixture
def four_eyes(settings):
    yield from governed_client(settings, four_eyes=True)


@pytest.fixture
def ungated(settings):
    yield from governed_client(settings, evaluation_gate=False)


def register(client, headers, path: str, name: str = "bank") -> str:
    response = client.post("/v1/admin/models", headers=headers, json={"name": name, "path": path})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def promote(client, headers, version_id: str, **body):
    return client.post(f"/v1/admin/models/{version_id}/promote", headers=headers, json={"reason": "eval ok", **body})


def holder(client, headers, name: str = "bank") -> str | None:
    aliases = client.get("/v1/admin/model_aliases", headers=headers, params={"model_name": name}).json()["data"]
    return next((alias["version_id"] for alias in aliases if alias["alias"] == "production"), None)


def test_four_eyes_needs_a_second_admin_key_to_approve(four_eyes, make_key, auth, checkpoint, sessions):
    alice_id, alice = make_key("admin", "alice")
    bob_id, bob = make_key("admin", "bob")
    alice, bob = auth(alice), auth(bob)
    first, second = register(four_eyes, alice, checkpoint("v1")), register(four_eyes, alice, checkpoint("v2"))

    requested = promote(four_eyes, alice, first, reason="passed review")
    assert requested.status_code == 202, requested.text
    request = requested.json()
    assert (request["object"], request["status"], request["action"]) == ("model_alias.approval", "pending", "promote")
    assert (request["requested_by"], request["to_version_id"], request["from_version_id"]) == (alice_id, first, None)
    assert holder(four_eyes, alice) is None  # nothing moves before approval

    own = four_eyes.post(f"/v1/admin/model_aliases/approvals/{request['id']}/approve", headers=alice)
    assert own.status_code == 403
    assert own.json()["error"]["code"] == "self_approval" and "different admin key" in own.json()["error"]["message"]
    duplicate = promote(four_eyes, alice, second)
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "approval_pending"
    pending = four_eyes.get("/v1/admin/model_aliases/approvals", headers=bob, params={"status": "pending"}).json()
    assert [item["id"] for item in pending["data"]] == [request["id"]]

    approved = four_eyes.post(
        f"/v1/admin/model_aliases/approvals/{request['id']}/approve", headers=bob, json={"reason": "looks good"}
    )
    assert approved.status_code == 200, approved.text
    body = approved.json()
    assert (body["status"], body["decided_by"], body["decision_reason"]) == ("approved", bob_id, "looks good")
    move = body["move"]
    assert (move["actor_key_id"], move["approved_by_key_id"], move["approval_id"]) == (alice_id, bob_id, request["id"])
    assert move["reason"] == "passed review" and move["requested_at"] <= move["created_at"]
    assert holder(four_eyes, alice) == first
    again = four_eyes.post(f"/v1/admin/model_aliases/approvals/{request['id']}/approve", headers=bob)
    assert again.status_code == 409 and again.json()["error"]["code"] == "approval_decided"

    # Rejected: nothing moves, and a decided request stays decided.
    rejected_id = promote(four_eyes, alice, second).json()["id"]
    rejected = four_eyes.post(
        f"/v1/admin/model_aliases/approvals/{rejected_id}/reject", headers=bob, json={"reason": "not yet"}
    )
    assert rejected.status_code == 200 and rejected.json()["status"] == "rejected"
    assert holder(four_eyes, alice) == first
    late = four_eyes.post(f"/v1/admin/model_aliases/approvals/{rejected_id}/approve", headers=bob)
    assert late.status_code == 409

    # A rollback is a request too.
    promoted_id = promote(four_eyes, alice, second).json()["id"]
    assert four_eyes.post(f"/v1/admin/model_aliases/approvals/{promoted_id}/approve", headers=bob).status_code == 200
    rollback = {"model_name": "bank", "reason": "regression"}
    rollback_request = four_eyes.post("/v1/admin/model_aliases/rollback", headers=bob, json=rollback)
    assert rollback_request.status_code == 202 and rollback_request.json()["to_version_id"] == first
    assert holder(four_eyes, alice) == second
    rolled = four_eyes.post(f"/v1/admin/model_aliases/approvals/{rollback_request.json()['id']}/approve", headers=alice)
    assert rolled.status_code == 200 and rolled.json()["move"]["action"] == "rollback"
    assert holder(four_eyes, alice) == first

    history = four_eyes.get("/v1/admin/model_aliases/history", headers=alice, params={"model_name": "bank"}).json()
    assert [(h["action"], h["actor_key_id"], h["approved_by_key_id"]) for h in history["data"]] == [
        ("rollback", bob_id, alice_id),
        ("promote", alice_id, bob_id),
        ("promote", alice_id, bob_id),
    ]
    assert four_eyes.get("/v1/admin/model_aliases/approvals/aliasreq-nope", headers=alice).status_code == 404

    with sessions() as session:
        audited = [(entry.action, entry.status_code, entry.target) for entry in session.query(AuditLog)]
    assert ("admin_models.promote", 202, request["id"]) in audited
    assert ("admin_models.approve", 403, request["id"]) in audited
    assert ("admin_models.approve", 200, request["id"]) in audited
    assert ("admin_models.reject", 200, rejected_id) in audited


def test_approving_a_request_after_the_alias_moved_otherwise_is_refused(four_eyes, client, make_key, auth, checkpoint):
    alice, bob = auth(make_key("admin", "alice")[1]), auth(make_key("admin", "bob")[1])
    first, second = register(four_eyes, alice, checkpoint("v1")), register(four_eyes, alice, checkpoint("v2"))
    request_id = promote(four_eyes, alice, second).json()["id"]
    # Meanwhile the alias moves on a server running without the four-eyes rule.
    assert promote(client, auth("admin"), first).status_code == 200

    stale = four_eyes.post(f"/v1/admin/model_aliases/approvals/{request_id}/approve", headers=bob)
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "alias_moved"
    assert holder(four_eyes, alice) == first
    assert four_eyes.get(f"/v1/admin/model_aliases/approvals/{request_id}", headers=bob).json()["status"] == "pending"


def test_the_evaluation_gate_refuses_a_worse_held_out_loss(client, auth, checkpoint):
    admin = auth("admin")
    holder_id = register(client, admin, checkpoint("v1", loss=1.25))
    assert promote(client, admin, holder_id).status_code == 200  # no holder yet: nothing to compare

    worse = register(client, admin, checkpoint("v2", loss=1.5))
    refused = promote(client, admin, worse)
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "evaluation_gate_failed"
    assert "1.5" in error["message"] and "1.25" in error["message"]
    assert worse in error["message"] and holder_id in error["message"]
    assert promote(client, admin, worse, force=True).status_code == 409  # force does not override a worse loss
    assert holder(client, admin) == holder_id

    better = register(client, admin, checkpoint("v3", loss=1.0))
    promoted = promote(client, admin, better)
    assert promoted.status_code == 200, promoted.text
    assert promoted.json()["evaluation"] == {
        "metric": "held_out_loss",
        "candidate_version_id": better,
        "candidate_loss": 1.0,
        "holder_version_id": holder_id,
        "holder_loss": 1.25,
        "candidate_task": None,
        "holder_task": None,
        "task_compared": False,
        "forced": False,
    }

    # No recorded held-out loss: refused unless forced (with the reason every move needs).
    unmeasured = register(client, admin, checkpoint("v4"))
    missing = promote(client, admin, unmeasured)
    assert missing.status_code == 409 and missing.json()["error"]["code"] == "evaluation_missing"
    assert missing.json()["error"]["param"] == "force" and "1" in missing.json()["error"]["message"]
    forced = promote(client, admin, unmeasured, force=True, reason="hotfix, evaluated offline")
    assert forced.status_code == 200 and forced.json()["evaluation"]["forced"] is True

    # A holder without a loss cannot be compared with: any candidate may follow it.
    assert promote(client, admin, worse).status_code == 200
    # Rolling back is not gated: it returns to a version that already held the alias.
    rollback = {"model_name": "bank", "reason": "undo"}
    assert client.post("/v1/admin/model_aliases/rollback", headers=admin, json=rollback).status_code == 200
    assert holder(client, admin) == unmeasured


def test_the_evaluation_gate_compares_task_scores_on_the_same_validation_file(client, auth, checkpoint):
    admin = auth("admin")
    holder_id = register(client, admin, checkpoint("v1", loss=1.0, exact=0.6, disposition=0.9))
    assert promote(client, admin, holder_id).status_code == 200
    version = client.get(f"/v1/admin/models/{holder_id}", headers=admin).json()
    assert version["evaluation"]["exact_match"] == 0.6  # recorded from evaluation.json at registration

    # A lower held-out loss, but worse answers on the same file: refused, naming the score that fell.
    worse = register(client, admin, checkpoint("v2", loss=0.9, exact=0.7, disposition=0.8))
    refused = promote(client, admin, worse, force=True)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "evaluation_gate_failed"
    assert "Disposition accuracy 0.8 < 0.9" in refused.json()["error"]["message"]

    # Scores on another file are recorded but not compared.
    elsewhere = register(client, admin, checkpoint("v3", loss=0.9, exact=0.1, disposition=0.1, data="b"))
    moved = promote(client, admin, elsewhere)
    assert moved.status_code == 200 and moved.json()["evaluation"]["task_compared"] is False

    better = register(client, admin, checkpoint("v4", loss=0.8, exact=0.9, disposition=1.0, data="b"))
    promoted = promote(client, admin, better)
    assert promoted.status_code == 200, promoted.text
    record = promoted.json()["evaluation"]
    assert record["task_compared"] is True
    assert record["candidate_task"] == {"exact_match": 0.9, "Disposition accuracy": 1.0}
    assert record["holder_task"] == {"exact_match": 0.1, "Disposition accuracy": 0.1}


def test_the_evaluation_gate_can_be_switched_off(ungated, auth, checkpoint):
    admin = auth("admin")
    assert promote(ungated, admin, register(ungated, admin, checkpoint("v1", loss=1.0))).status_code == 200
    worse = promote(ungated, admin, register(ungated, admin, checkpoint("v2", loss=2.0)))
    assert worse.status_code == 200 and worse.json()["evaluation"] is None


def test_held_out_loss_prefers_the_best_evaluation_and_ignores_non_numbers():
    def loss(metrics):
        return registry.held_out_loss(ModelVersion(metrics=metrics))

    assert loss({"valid_loss": 0.9, "best_valid_loss": 0.7}) == 0.7
    assert loss({"valid_loss": 0.9}) == 0.9
    assert loss({"best_valid_loss": None, "valid_loss": 2}) == 2.0
    assert loss({"train_loss": 0.1}) is None and loss(None) is None
    assert loss({"valid_loss": float("nan")}) is None and loss({"valid_loss": True}) is None


def test_a_fine_tuning_job_registers_the_held_out_loss_the_gate_reads(
    client, auth, settings, sessions, tiny_model_dir, valid_dataset
):
    with sessions() as session:
        registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        session.commit()

    def upload(content: bytes) -> str:
        files = {"file": ("data.jsonl", content)}
        return client.post("/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files=files).json()["id"]

    held_out = valid_dataset.replace(b"Balance of", b"Limit of")  # same shape, no overlap with the training file
    hyperparameters = {"n_epochs": 1, "batch_size": 1, "max_steps": 2, "eval_every": 1}
    body = {
        "model": "zaya-tiny",
        "training_file": upload(valid_dataset),
        "validation_file": upload(held_out),
        "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
    }
    job = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body).json()
    Worker(settings, sessions, WorkerConfig(heartbeat_seconds=1, lease_seconds=30)).run_forever(exit_when_idle=True)

    finished = client.get(f"/v1/fine_tuning/jobs/{job['id']}", headers=auth("data")).json()
    assert finished["status"] == "succeeded", finished
    with sessions() as session:
        version = find_version(session, finished["fine_tuned_model"])
        assert registry.held_out_loss(version) == version.metrics["best_valid_loss"] > 0
