"""`zaya run`: bootstraps a servable model once, then serves chat with a worker beside it; Ctrl-C stops both."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from sqlalchemy import select

from server.commands.run import BOOTSTRAP_MODEL_NAME, ensure_local_model
from server.db.models import ModelAlias, ModelVersion

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_model_is_bootstrapped_registered_and_reused(settings, sessions):
    assert ensure_local_model(settings, train_steps=2) == BOOTSTRAP_MODEL_NAME
    with sessions() as session:
        [version] = session.scalars(select(ModelVersion)).all()
        [alias] = session.scalars(select(ModelAlias)).all()
    assert (version.name, version.kind, alias.alias, alias.version_id) == (
        BOOTSTRAP_MODEL_NAME,
        "full",
        "production",
        version.id,
    )
    directory = settings.data_dir / "models" / BOOTSTRAP_MODEL_NAME
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")]  # no staging dir left behind

    assert ensure_local_model(settings, train_steps=2) == BOOTSTRAP_MODEL_NAME
    with sessions() as session:
        assert len(session.scalars(select(ModelVersion)).all()) == 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_zaya_run_serves_chat_and_stops_cleanly_on_ctrl_c(settings, sessions, make_key, tiny_model_dir):
    # A registered model is used as it is (bootstrapping is the test above): keeps this end-to-end run short.
    with sessions() as session:
        session.add(ModelVersion(name="bank-model", version=1, kind="full", path=str(tiny_model_dir)))
        session.commit()
    port = free_port()
    env = {**os.environ, "ZAYA_DATA_DIR": str(settings.data_dir), "ZAYA_DATABASE_URL": settings.database_url}
    process = subprocess.Popen(
        [sys.executable, "-m", "zaya_cli", "run", "--port", str(port), "--bootstrap-train-steps", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "zaya run did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=make_key("analyst")[1], max_retries=0)
        answer = client.chat.completions.create(
            model="bank-model", messages=[{"role": "user", "content": "Summarise case 1."}], max_tokens=4
        )
        assert answer.usage.completion_tokens >= 1
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    assert "keys create --role admin" in output and "using the registered model 'bank-model'" in output
    worker_pid = re.search(r"worker: started \(pid (\d+)\)", output).group(1)
    assert not os.path.exists(f"/proc/{worker_pid}")  # stopped and reaped


def make_run_plan(engine: str | None) -> list[str]:
    """The commands `make run` would run (`make -n`), with ZAYA_ENGINE set to `engine` or unset."""
    env = {name: value for name, value in os.environ.items() if name not in ("ZAYA_ENGINE", "MAKEFLAGS")}
    if engine is not None:
        env["ZAYA_ENGINE"] = engine
    # --no-print-directory: under an outer make (MAKELEVEL > 0) make would add "Entering/Leaving directory" lines.
    command = ["make", "--no-print-directory", "-n", "run"]
    plan = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True)
    return plan.stdout.splitlines()


def test_make_run_serves_from_the_environment_of_its_engine():
    # vLLM lives in its own environment (make install-vllm), installed first when missing.
    vllm = make_run_plan("vllm")
    assert vllm[-1] == ".venv-vllm/bin/python -m zaya_cli run"
    assert all(".venv/" not in command for command in vllm), vllm
    for default in (make_run_plan(None), make_run_plan("local")):
        assert default[-1] == ".venv/bin/python -m zaya_cli run"
        assert all(".venv-vllm" not in command for command in default), default
