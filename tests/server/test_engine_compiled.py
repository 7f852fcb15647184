"""The local engine's compiled decode steps (`zaya_model.cpu.decode`): compiled in the background after load, with
`/health` saying "warming" meanwhile; greedy output equal to eager decoding; without a C++ compiler, eager."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch._inductor.config
from transformers import AutoTokenizer

from finetune.bootstrap import build_tiny_model
from server.app import create_app
from server.db.models import ModelVersion
from server.engines.base import ModelRef, SamplingParams
from server.engines.local import LocalEngine
from server.settings import LocalEngineSettings

PROMPTS = ["Case CASE-1 Customer: Maria", "Summarise", "Disposition: SAR\nReason: the customer wired funds to"]
COMPILED = LocalEngineSettings(max_batch_size=4)  # buckets 1, 2 and 4: three prompts run at 4 with a padding row
WARM_TIMEOUT_S = 900  # compiling on two busy cores


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A few training steps make the logits peaked, so batched and unbatched float noise cannot flip a greedy token.
    return build_tiny_model(tmp_path_factory.mktemp("compiled") / "tiny", train_steps=8)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


async def greedy(engine: LocalEngine, model: ModelRef, prompt_ids: list[int], max_tokens: int) -> str:
    text = ""
    async for delta in engine.generate(model, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
        text += delta.text
    return text


async def generate_all(settings: LocalEngineSettings, model: ModelRef, prompts: list[list[int]], wait_warm: bool):
    """Each prompt alone, then all at once; with `wait_warm`, only after every batch size is compiled, and then
    nothing may compile again (a request would wait for it): torch's "fail_on_recompile" stance fails the step."""
    engine = LocalEngine(settings)
    try:
        await engine.load_model(model)
        deadline = time.monotonic() + WARM_TIMEOUT_S
        while wait_warm and engine.health()["status"] == "warming":
            assert time.monotonic() < deadline, "compiling the decode steps took too long"
            await asyncio.sleep(0.5)
        with torch.compiler.set_stance("fail_on_recompile") if wait_warm else contextlib.nullcontext():
            alone = [await greedy(engine, model, prompt, 16) for prompt in prompts]
            together = await asyncio.gather(*(greedy(engine, model, prompt, 16) for prompt in prompts))
        return alone, list(together), engine.health(), engine.stats(model.version_id)
    finally:
        await engine.close()


def test_compiled_decoding_gives_the_eager_engines_greedy_tokens(model_dir, tokenizer):
    model = ModelRef("mv-compiled", model_dir)
    prompts = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in PROMPTS]
    eager_alone, eager_together, _, eager_stats = asyncio.run(
        generate_all(LocalEngineSettings(compile=False), model, prompts, wait_warm=False)
    )
    alone, together, health, stats = asyncio.run(generate_all(COMPILED, model, prompts, wait_warm=True))
    assert health["status"] == "ok" and health["compiled_batch_sizes"] == {"mv-compiled": [1, 2, 4]}
    assert eager_stats.compiled_steps == 0
    assert stats.compiled_steps == stats.steps > 0  # every decode step ran compiled, batch 3 in the bucket of 4
    assert alone == eager_alone and together == eager_together
    assert together == alone and all(alone)


@pytest.fixture
def app(settings):
    return create_app(settings.model_copy(update={"local_engine": COMPILED}))


@pytest.fixture
def uncached_compilation():
    """Dynamo's and inductor's caches hold the graphs compiled by the test above: without them the warm-up takes
    long enough to be seen."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield


def test_health_says_warming_while_the_decode_steps_compile_then_ready(
    live_server, keys, sessions, model_dir, uncached_compilation
):
    with sessions() as session:
        version = ModelVersion(name="zaya-tiny", version=1, kind="full", path=str(model_dir))
        session.add(version)
        session.commit()
        version_id = version.id
    headers = {"Authorization": f"Bearer {keys['analyst']}"}
    admin = {"Authorization": f"Bearer {keys['admin']}"}  # `/health`'s engine details are for admins
    with httpx.Client(base_url=live_server, timeout=120) as http:
        body = {
            "model": f"zaya-tiny@{version_id}",
            "prompt": "Summarise",
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)  # the model is loaded and serving (eagerly) while it compiles
            warming = http.get("/health", headers=admin)
            list(lines)
        assert warming.status_code == 503 and warming.json()["engine"]["status"] == "warming"
        deadline = time.monotonic() + WARM_TIMEOUT_S
        while (health := http.get("/health", headers=admin)).status_code != 200:
            assert health.json()["engine"]["status"] == "warming" and time.monotonic() < deadline
            time.sleep(1)
        engine = health.json()["engine"]
        assert engine["status"] == "ready" and list(engine["compiled_batch_sizes"].values()) == [[1, 2, 4]]
        answer = http.post("/v1/completions", json={**body, "stream": False}, headers=headers)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]


FALLBACK_SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from tests.server.test_engine_compiled import COMPILED, generate_all
from transformers import AutoTokenizer
from server.engines.base import ModelRef
from server.settings import LocalEngineSettings

model_dir = Path(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(model_dir)
prompts = [tokenizer.encode(p, add_special_tokens=False) for p in json.loads(sys.argv[2])]
model = ModelRef("mv-fallback", model_dir)
alone, together, health, stats = asyncio.run(generate_all(COMPILED, model, prompts, wait_warm=True))
eager = asyncio.run(generate_all(LocalEngineSettings(compile=False), model, prompts, wait_warm=False))
print(json.dumps({"same": [alone, together] == list(eager[:2]), "health": health, "compiled": stats.compiled_steps}))
"""


def test_without_a_cpp_compiler_the_engine_warns_and_decodes_eagerly(model_dir, tmp_path):
    # torch's inductor builds C++ with $CXX; a fresh cache directory makes it compile rather than reuse a build.
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT, str(model_dir), json.dumps(PROMPTS)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=WARM_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "compiling decode steps failed, decoding eagerly" in result.stderr
    assert report["same"] and report["compiled"] == 0
    assert report["health"]["status"] == "ok" and report["health"]["compiled_batch_sizes"] == {"mv-fallback": []}
    assert report["health"]["compile_errors"]["mv-fallback"]
