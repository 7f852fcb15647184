"""Our plugin behind vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, real HTTP).

The entry point registers ZAYA in the server's processes with no code of ours in them; greedy answers to a batch of
concurrent requests of mixed prompt lengths, for the base and a LoRA adapter (`--lora-modules`), must equal
`zaya_model`'s `generate()` (HF + PEFT) token for token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from vllm_helpers import ENGINE_ENV, build_adapter, build_checkpoint, hf_greedy, random_prompts

from benchmarks.load_test.stack import free_port, stop, wait_until_healthy

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_server")
    base = root / "base"
    model = build_checkpoint(base)
    adapter = build_adapter(base, root / "tuned", seed=20)
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(base), "--served-model-name", "zaya",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules", f"tuned={root / 'tuned'}",
    ]  # fmt: skip
    log_path = root / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 (open for the server's lifetime)
    process = subprocess.Popen(command, env={**os.environ, **ENGINE_ENV}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, STARTUP_TIMEOUT_S, poll_s=0.5, log=log_path)
        yield url, model, adapter
    finally:
        stop(process, grace_s=60)
        log.close()


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_greedy_answers_of_concurrent_mixed_requests_equal_generate(server):
    url, model, adapter = server
    # 1 token up to 45 (a prefill over two chunks); base and adapter requests interleaved, all sent at once.
    prompts = random_prompts([1, 5, 11, 23, 45, 3, 17, 8], model.config.vocab_size, seed=5)
    names = ["zaya", "tuned"] * 4
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda job: complete(url, job[0], job[1], 12), zip(names, prompts, strict=True)))
    expected = [
        hf_greedy(model if name == "zaya" else adapter, prompt, 12) for name, prompt in zip(names, prompts, strict=True)
    ]
    assert expected[1][0] != hf_greedy(model, prompts[1], 12)[0]  # the adapter changes the answer
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(answers, expected, strict=True):
        assert tokens == expected_tokens
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
