"""A job's checkpoints (`ft:...:ckpt-step-N`, the `fine_tuned_model_checkpoint` names its checkpoint list gives) are
servable in chat and completions like its final model, from the checkpoint's own weights, whatever the job's state."""

from __future__ import annotations

import pytest
import torch
from sqlalchemy import select, update

from server.db.models import Checkpoint, FineTuningJob, InferenceRecord, JobStatus
from server.jobs.worker import Worker, WorkerConfig
from server.services import registry
from zaya_model import ZayaForCausalLM

FAST = WorkerConfig(lease_seconds=20, heartbeat_seconds=0.2, max_attempts=3, poll_seconds=0.1)
PROMPT = [5, 9, 13, 21]


@pytest.fixture
def finished_job(client, auth, sessions, settings, tiny_model_dir, valid_dataset) -> dict:
    """A LoRA job (experts and attention, the default) of 4 steps with checkpoints at steps 2 and 4, run to success."""
    with sessions() as session:
        registry.register_version(session, name="zaya-tiny", path=tiny_model_dir)
        session.commit()
    upload = client.post(
        "/v1/files", headers=auth("data"), data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", valid_dataset)}
    )
    hyperparameters = {"n_epochs": 50, "batch_size": 1, "max_steps": 4, "eval_every": 2}
    body = {
        "model": "zaya-tiny",
        "training_file": upload.json()["id"],
        "suffix": "cases",
        "seed": 3,
        # A large step, so each checkpoint's answers differ measurably from the base model's.
        "method": {
            "type": "supervised",
            "supervised": {"hyperparameters": {**hyperparameters, "learning_rate_multiplier": 50}},
        },
    }
    created = client.post("/v1/fine_tuning/jobs", headers=auth("data"), json=body)
    assert created.status_code == 200, created.text
    assert Worker(settings, sessions, FAST, worker_id="test-worker").run_once() is True
    job = client.get(f"/v1/fine_tuning/jobs/{created.json()['id']}", headers=auth("data")).json()
    assert job["status"] == "succeeded", job
    return job


def checkpoint_names(client, auth, job_id: str) -> dict[int, str]:
    listed = client.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints", headers=auth("data")).json()["data"]
    return {entry["step_number"]: entry["fine_tuned_model_checkpoint"] for entry in listed}


def first_token(client, auth, model: str) -> tuple[str, float]:
    """The greedy first token after PROMPT and its log-probability, through /v1/completions."""
    response = client.post(
        "/v1/completions",
        headers=auth("analyst"),
        json={"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 0, "ignore_eos": True},
    )
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    return logprobs["tokens"][0], logprobs["token_logprobs"][0]


def reference_first_token(model: ZayaForCausalLM, tokenizer) -> tuple[str, float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)
    token = int(logprobs.argmax())
    return tokenizer.decode([token]), float(logprobs[token])


def test_each_checkpoint_answers_with_its_own_weights(client, auth, sessions, finished_job, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoTokenizer

    names = checkpoint_names(client, auth, finished_job["id"])
    assert sorted(names) == [2, 4]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base_token, base_logprob = reference_first_token(ZayaForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer)
    for step, name in names.items():
        assert name == f"{finished_job['fine_tuned_model']}:ckpt-step-{step}"
        with sessions() as session:
            path = session.scalars(select(Checkpoint.path).where(Checkpoint.step == step)).one()
        tuned = PeftModel.from_pretrained(ZayaForCausalLM.from_pretrained(tiny_model_dir), path).merge_and_unload()
        token, logprob = reference_first_token(tuned.eval(), tokenizer)
        assert abs(logprob - base_logprob) > 1e-3  # the checkpoint is not the base model
        served_token, served_logprob = first_token(client, auth, name)
        assert served_token == token and served_logprob == pytest.approx(logprob, abs=1e-4), (step, base_token)

        chat = client.post(
            "/v1/chat/completions",
            headers=auth("analyst"),
            json={"model": name, "messages": [{"role": "user", "content": "Case 4?"}], "max_tokens": 3},
        )
        assert chat.status_code == 200 and chat.json()["model"] == name, chat.text
    with sessions() as session:
        records = session.scalars(select(InferenceRecord).where(InferenceRecord.requested_model.like("%ckpt%"))).all()
    assert len(records) == 4 and {record.status_code for record in records} == {200}
    assert {record.model_version_id for record in records} == {None}  # checkpoints are not model versions


def test_a_paused_jobs_checkpoints_are_served_and_unknown_ones_are_404(client, auth, sessions, finished_job):
    names = checkpoint_names(client, auth, finished_job["id"])
    # As while the job waits or trains: no fine_tuned_model yet, its checkpoints named as the list names them.
    with sessions() as session:
        session.execute(
            update(FineTuningJob)
            .where(FineTuningJob.id == finished_job["id"])
            .values(status=JobStatus.paused, fine_tuned_model=None)
        )
        session.commit()
    assert checkpoint_names(client, auth, finished_job["id"]) == names
    assert first_token(client, auth, names[2])[1] < 0
    ft_model = finished_job["fine_tuned_model"]
    other_suffix = ft_model.replace(":cases:", ":other:")
    for missing in (
        f"{ft_model}:ckpt-step-3",  # no checkpoint at that step
        f"{other_suffix}:ckpt-step-2",  # not this job's name
        "ft:zaya-tiny:zaya:cases:ftjob-missing:ckpt-step-2",
        f"{ft_model}:ckpt-step-0",
    ):
        response = client.post(
            "/v1/completions", headers=auth("analyst"), json={"model": missing, "prompt": "x", "max_tokens": 1}
        )
        error = response.json()["error"]
        assert response.status_code == 404 and (error["param"], error["code"]) == ("model", "model_not_found"), missing
