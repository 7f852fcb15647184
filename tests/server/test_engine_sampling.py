"""The local engine's sampler honours OpenAI's `logit_bias`, `frequency_penalty`, `presence_penalty` and vLLM's
`repetition_penalty`, `top_k`, `min_tokens`: greedy tokens equal transformers' `generate()` with the same logits
adjustment (its own processors where it has them, OpenAI's formula where it has none), and each adjustment changes
the tokens."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from sampling_reference import OpenAIPenalties
from transformers import AutoTokenizer, LogitsProcessorList

from server.engines.base import EngineError, ModelRef, SamplingParams, end_of_sequence_ids
from server.engines.local import LocalEngine
from server.settings import LocalEngineSettings
from zaya_model import ZayaForCausalLM

PROMPT = "Case CASE-7 Customer: Maria wired funds to"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT, add_special_tokens=False)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    model = ZayaForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.generation_config.eos_token_id = None  # fixed-length outputs (the engine side: ignore_eos)
    return model


@pytest.fixture(scope="module")
def engine_results(tiny_model_dir, prompt):
    """Every scenario's greedy tokens (as strings) from one local engine, batched together."""

    async def generate(engine, model, params):
        tokens, finish = [], None
        async for delta in engine.generate(model, prompt, params):
            tokens += [entry.token for entry in delta.logprobs]
            finish = delta.finish_reason or finish
        return tokens, finish

    async def main():
        engine = LocalEngine(LocalEngineSettings(compile=False))
        model = ModelRef("mv-tiny", tiny_model_dir)
        try:
            results = await asyncio.gather(*(generate(engine, model, params) for params in SCENARIOS.values()))
            return dict(zip(SCENARIOS, results, strict=True))
        finally:
            await engine.close()

    return asyncio.run(main())


def greedy(**fields) -> SamplingParams:
    return SamplingParams(MAX_TOKENS, temperature=0.0, logprobs=True, ignore_eos=True, **fields)


FAVOURED = 77  # a token id the model does not pick by itself
SCENARIOS = {
    "plain": greedy(),
    "favoured": greedy(logit_bias={FAVOURED: 100.0}),
    "frequency": greedy(frequency_penalty=2.0),
    "presence": greedy(presence_penalty=2.0),
    "negative_presence": greedy(presence_penalty=-2.0),
    "repetition": greedy(repetition_penalty=2.0),
    # Only the most likely token stays: sampling at any temperature is greedy.
    "top_k_1": SamplingParams(MAX_TOKENS, temperature=1.5, top_k=1, seed=7, logprobs=True, ignore_eos=True),
}


def hf_tokens(hf_model, tokenizer, prompt, **generate) -> list[str]:
    output = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, **generate
    )
    return [tokenizer.decode([token]) for token in output[0, len(prompt) :].tolist()]


def test_the_scenarios_start_from_repeating_greedy_tokens(engine_results, hf_model, tokenizer, prompt):
    plain, _ = engine_results["plain"]
    assert plain == hf_tokens(hf_model, tokenizer, prompt)
    assert len(set(plain)) < len(plain)  # repeats: the penalties have something to act on
    assert tokenizer.decode([FAVOURED]) not in plain


def test_logit_bias_100_forces_its_token(engine_results, tokenizer):
    tokens, _ = engine_results["favoured"]
    assert tokens == [tokenizer.decode([FAVOURED])] * MAX_TOKENS


@pytest.mark.parametrize(
    ("scenario", "frequency", "presence"),
    [("frequency", 2.0, 0.0), ("presence", 0.0, 2.0), ("negative_presence", 0.0, -2.0)],
)
def test_frequency_and_presence_penalties_follow_openais_definition(
    engine_results, hf_model, tokenizer, prompt, scenario, frequency, presence
):
    tokens, _ = engine_results[scenario]
    penalties = LogitsProcessorList([OpenAIPenalties(len(prompt), frequency, presence)])
    assert tokens == hf_tokens(hf_model, tokenizer, prompt, logits_processor=penalties)
    if frequency > 0 or presence > 0:  # a negative penalty only reinforces the repeats
        assert tokens != engine_results["plain"][0]


def test_repetition_penalty_is_transformers_and_vllms(engine_results, hf_model, tokenizer, prompt):
    tokens, _ = engine_results["repetition"]
    assert tokens == hf_tokens(hf_model, tokenizer, prompt, repetition_penalty=2.0)
    assert tokens != engine_results["plain"][0]


def test_top_k_1_samples_the_greedy_tokens(engine_results):
    assert engine_results["top_k_1"] == engine_results["plain"]


def test_min_tokens_holds_back_end_of_sequence_and_stop_strings(tiny_model_dir, tokenizer, prompt):
    end = min(end_of_sequence_ids(tokenizer))
    forced_end = SamplingParams(12, temperature=0.0, logit_bias={end: 100.0})

    async def main():
        engine = LocalEngine(LocalEngineSettings(compile=False))
        model = ModelRef("mv-tiny", tiny_model_dir)

        async def last(params):
            return [delta async for delta in engine.generate(model, prompt, params)][-1]

        try:
            plain = await last(SamplingParams(8, temperature=0.0))
            stop = (plain.text[:2],)  # ends the choice within its first tokens
            results = [
                await last(params)
                for params in (
                    forced_end,
                    replace(forced_end, min_tokens=5),
                    SamplingParams(8, temperature=0.0, stop=stop),
                    SamplingParams(8, temperature=0.0, stop=stop, min_tokens=3),
                )
            ]
            with pytest.raises(EngineError) as refused:
                await anext(engine.generate(model, prompt, replace(forced_end, min_tokens=13)))
            return results, refused.value
        finally:
            await engine.close()

    (ended, held_end, stopped, held_stop), refused = asyncio.run(main())
    assert (ended.completion_tokens, ended.finish_reason) == (1, "stop")
    assert (held_end.completion_tokens, held_end.finish_reason) == (6, "stop")  # 5 tokens, then the forced end
    assert stopped.completion_tokens <= 2 < 3 < held_stop.completion_tokens
    assert refused.param == "min_tokens"


def test_logit_bias_ids_outside_the_vocabulary_are_refused(tiny_model_dir, tokenizer, prompt):
    async def main():
        engine = LocalEngine(LocalEngineSettings(compile=False))
        try:
            stream = engine.generate(
                ModelRef("mv-tiny", tiny_model_dir), prompt, greedy(logit_bias={len(tokenizer): 1.0})
            )
            with pytest.raises(EngineError) as refused:
                await anext(stream)
            return refused.value
        finally:
            await engine.close()

    assert asyncio.run(main()).param == "logit_bias"
