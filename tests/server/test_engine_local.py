"""The `local` engine driven directly: batching, equality with `generate()`, sampling, stop strings, cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import peft
import pytest
import torch
from transformers import AutoTokenizer

from finetune.bootstrap import build_tiny_model
from server.engines import local
from server.engines.base import EngineError, EngineOverloaded, ModelLoadError, ModelRef, SamplingParams
from server.engines.local import LocalEngine
from server.engines.threads import THREAD_NAME_PREFIX
from server.settings import LocalEngineSettings
from zaya_model import ZayaForCausalLM

# Compiled decode steps have tests of their own (test_engine_compiled.py); these run eagerly, without compiling.
EAGER = LocalEngineSettings(compile=False)
PROMPTS = ["Case CASE-1 Customer: Maria", "Summarise", "Disposition: SAR\nReason: the customer wired funds to"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A few training steps make the logits peaked, so batched and unbatched float noise cannot flip a greedy token.
    return build_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", train_steps=8)


@pytest.fixture(scope="module")
def base(model_dir):
    return ModelRef("mv-base", model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def run(coroutine):
    return asyncio.run(coroutine)


async def collect(engine, model, prompt_ids, params, adapter=None) -> dict[int, dict]:
    choices: dict[int, dict] = {}
    async for delta in engine.generate(model, prompt_ids, params, adapter=adapter):
        choice = choices.setdefault(delta.index, {"text": "", "deltas": [], "logprobs": []})
        choice["text"] += delta.text
        choice["deltas"].append(delta.text)
        choice["logprobs"] += delta.logprobs
        choice["finish_reason"], choice["tokens"] = delta.finish_reason, delta.completion_tokens
    return choices


def reference_greedy(model_dir, tokenizer, prompt: str, max_tokens: int) -> tuple[str, int]:
    model = ZayaForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    output = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = output[0, ids.shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def test_concurrent_greedy_requests_share_batches_and_equal_generate(model_dir, base, tokenizer):
    params = SamplingParams(max_tokens=12, temperature=0.0)

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            results = await asyncio.gather(
                *(collect(engine, base, tokenizer.encode(p, add_special_tokens=False), params) for p in PROMPTS)
            )
            return results, engine.stats(base.version_id)
        finally:
            await engine.close()

    results, stats = run(scenario())
    assert stats.max_batch_size_seen > 1
    for prompt, result in zip(PROMPTS, results, strict=True):
        text, tokens = reference_greedy(model_dir, tokenizer, prompt, 12)
        assert result[0]["text"] == text
        assert result[0]["tokens"] == tokens
        assert result[0]["finish_reason"] == ("length" if tokens == 12 else "stop")


def test_seeded_sampling_is_reproducible_and_n_choices_differ(base, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            sampled = SamplingParams(max_tokens=16, n=2, temperature=1.0, top_p=0.9, seed=1234)
            first = await collect(engine, base, prompt, sampled)
            # The same seed again, this time batched next to another request.
            second, _ = await asyncio.gather(
                collect(engine, base, prompt, sampled), collect(engine, base, prompt, SamplingParams(max_tokens=16))
            )
            other_seed = await collect(engine, base, prompt, SamplingParams(max_tokens=16, n=2, seed=99))
            return first, second, other_seed
        finally:
            await engine.close()

    first, second, other_seed = run(scenario())
    assert [first[i]["text"] for i in (0, 1)] == [second[i]["text"] for i in (0, 1)]
    assert first[0]["text"] != first[1]["text"]
    assert [first[i]["text"] for i in (0, 1)] != [other_seed[i]["text"] for i in (0, 1)]


def test_stop_strings_end_the_choice_and_are_never_split_across_deltas(base, tokenizer):
    prompt = tokenizer.encode(PROMPTS[2], add_special_tokens=False)

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            full = (await collect(engine, base, prompt, SamplingParams(max_tokens=24, temperature=0.0)))[0]
            text = full["text"]
            # A stop string that spans several tokens, and one that starts matching but never completes.
            stop = text[6:12]
            stopped = (await collect(engine, base, prompt, SamplingParams(24, temperature=0.0, stop=(stop,))))[0]
            near_miss = text[6:12] + "\x00"
            held = (await collect(engine, base, prompt, SamplingParams(24, temperature=0.0, stop=(near_miss,))))[0]
            return full, stop, stopped, held
        finally:
            await engine.close()

    full, stop, stopped, held = run(scenario())
    assert len(full["deltas"]) > 8 and len(stop) == 6
    assert stopped["text"] == full["text"][: full["text"].index(stop)]
    assert stopped["finish_reason"] == "stop"
    assert all(stop not in delta for delta in stopped["deltas"])
    # Text that looked like the start of a stop string is released once it stops matching: nothing is lost.
    assert held["text"] == full["text"] and held["finish_reason"] == full["finish_reason"]
    assert len(held["deltas"]) < len(full["deltas"])


def test_logprobs_report_the_sampled_token_and_the_best_alternatives(base, tokenizer):
    prompt = tokenizer.encode(PROMPTS[1], add_special_tokens=False)

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            params = SamplingParams(6, temperature=0.0, logprobs=True, top_logprobs=3)
            return await collect(engine, base, prompt, params)
        finally:
            await engine.close()

    choice = run(scenario())[0]
    assert "".join(entry.token for entry in choice["logprobs"]) == choice["text"]
    for entry in choice["logprobs"]:
        assert len(entry.top) == 3 and entry.logprob <= 0.0
        assert entry.top[0] == (entry.token, pytest.approx(entry.logprob))
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def test_closing_the_stream_stops_decoding(base, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            stream = engine.generate(base, prompt, SamplingParams(max_tokens=1500, temperature=0.0))
            for _ in range(3):
                await anext(stream)
            await stream.aclose()
            stats = engine.stats(base.version_id)
            for _ in range(200):
                if stats.running == 0:
                    break
                await asyncio.sleep(0.01)
            decoded = stats.decoded_tokens
            await asyncio.sleep(0.3)
            return stats, decoded
        finally:
            await engine.close()

    stats, decoded = run(scenario())
    assert stats.running == 0
    assert stats.decoded_tokens == decoded < 100


def test_a_full_queue_is_refused_and_oversized_requests_are_errors(base, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    engine_settings = LocalEngineSettings(max_batch_size=1, max_queued_requests=1, compile=False)

    async def scenario():
        engine = LocalEngine(engine_settings)
        try:
            running = engine.generate(base, prompt, SamplingParams(max_tokens=1000, temperature=0.0))
            await anext(running)  # admitted: the batch (one row) is full
            waiting = asyncio.ensure_future(collect(engine, base, prompt, SamplingParams(max_tokens=2)))
            while engine.health()["queued_requests"] == 0:
                await asyncio.sleep(0.005)
            with pytest.raises(EngineOverloaded):
                await anext(engine.generate(base, prompt, SamplingParams(max_tokens=2)))
            with pytest.raises(EngineError) as too_many:
                await anext(engine.generate(base, prompt, SamplingParams(max_tokens=2, n=2)))
            assert too_many.value.param == "n"
            with pytest.raises(EngineError) as too_long:
                await anext(engine.generate(base, prompt, SamplingParams(max_tokens=5000)))
            assert too_long.value.param == "max_tokens"
            await running.aclose()
            return await waiting  # the queued request still gets its answer
        finally:
            await engine.close()

    assert run(scenario())[0]["tokens"] >= 1


def test_adapters_are_merged_per_version_and_bad_ones_fail_at_load(model_dir, base, tokenizer, tmp_path):
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    peft_model = peft.get_peft_model(ZayaForCausalLM.from_pretrained(model_dir), lora)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()
    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    expected = merged.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :]
    (tmp_path / "not-an-adapter").mkdir()

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            params = SamplingParams(max_tokens=10, temperature=0.0)
            adapter = ModelRef("mv-adapter", tmp_path / "adapter")
            with_adapter, without = await asyncio.gather(
                collect(engine, base, prompt, params, adapter=adapter), collect(engine, base, prompt, params)
            )
            with pytest.raises(ModelLoadError, match="adapter_config.json"):
                await engine.load_adapter(ModelRef("mv-bad", tmp_path / "not-an-adapter"), base)
            assert set(engine.health()["loaded_models"]) == {"mv-base", "mv-adapter"}
            await engine.unload_model(base.version_id)  # its adapters go with it
            assert engine.health()["loaded_models"] == []
            return with_adapter, without
        finally:
            await engine.close()

    with_adapter, without = run(scenario())
    assert with_adapter[0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert with_adapter[0]["text"] != without[0]["text"]


def test_all_models_decode_on_one_thread_and_loading_leaves_no_thread_behind(
    model_dir, base, tokenizer, tmp_path, monkeypatch
):
    """Torch work on a second long-lived thread slows every op of the decoding one (`server.engines.threads`)."""
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj"], init_lora_weights=False)
    peft.get_peft_model(ZayaForCausalLM.from_pretrained(model_dir), lora).save_pretrained(tmp_path / "adapter")
    adapter = ModelRef("mv-adapter", tmp_path / "adapter")
    load_threads: list[threading.Thread] = []
    forward_threads: set[threading.Thread] = set()

    def load_weights_on_its_thread(*args):
        load_threads.append(threading.current_thread())
        return load_weights(*args)

    load_weights = local._load_weights
    monkeypatch.setattr(local, "_load_weights", load_weights_on_its_thread)

    def record_forward_thread(module, args):
        if isinstance(module, ZayaForCausalLM):
            forward_threads.add(threading.current_thread())

    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    params = SamplingParams(max_tokens=6, temperature=0.0)

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            await asyncio.gather(engine.load_model(base), engine.load_adapter(adapter, base))
            await asyncio.gather(collect(engine, base, prompt, params), collect(engine, base, prompt, params, adapter))
            return engine._compute.thread
        finally:
            await engine.close()

    with torch.nn.modules.module.register_module_forward_pre_hook(record_forward_thread):
        compute_thread = run(scenario())
    assert len(load_threads) == 2
    assert all(thread.name.startswith(THREAD_NAME_PREFIX) for thread in load_threads)
    deadline = time.monotonic() + 10
    while any(thread.is_alive() for thread in load_threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(thread.is_alive() for thread in load_threads)
    assert forward_threads == {compute_thread}  # both models, one thread
    assert not compute_thread.is_alive()  # `close` stopped it
