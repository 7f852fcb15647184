"""Compiled decode steps (`zaya_model.cpu.decode`): what the reference model gives, step for step."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import TINY_ZAYA, randomize_zaya

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.cpu.decode import (
    CompiledDecoder,
    StaticDecodeCache,
    batch_bucket,
    capacity_for,
    decode_step,
    greedy_generate,
)

pytestmark = pytest.mark.slow  # compiles a graph


@torch.inference_mode()
def test_compiled_decode_steps_generate_what_the_reference_generates():
    torch.manual_seed(0)
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))).eval()
    prompt = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )[:, 9:]  # fmt: skip
    decoder = CompiledDecoder(model)
    assert torch.equal(greedy_generate(model, decoder, prompt, 12), expected)
    assert decoder.batch_sizes == {2}


@torch.inference_mode()
def test_one_step_over_padded_buffers_gives_the_reference_logits_and_state():
    """Eagerly (no compiling), `decode_step` over buffers with a padding row and spare capacity computes what the
    reference forward computes from the cache, and leaves the cache the reference leaves."""
    torch.manual_seed(0)
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))).eval()
    prompt = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(2))
    cache = model(input_ids=prompt, use_cache=True).past_key_values
    reference_cache = copy.deepcopy(cache)
    token = torch.tensor([[5], [6], [7]])
    expected = model(input_ids=token, past_key_values=reference_cache, use_cache=True).logits[:, -1]

    bucket = batch_bucket(3, max_rows=16)
    buffers = StaticDecodeCache.adopt(cache, bucket, capacity_for(8))
    assert (bucket, buffers.capacity) == (4, 256)
    attend = torch.zeros(bucket, buffers.capacity, dtype=torch.bool)
    attend[:, :8] = True
    ids = torch.cat([token, torch.zeros(1, 1, dtype=torch.long)])
    positions = torch.full((bucket, 1), 7)
    logits = decode_step(
        model, ids, positions, attend, torch.tensor([7]), buffers.keys, buffers.values, buffers.conv_states,
        buffers.shift_states,
    )  # fmt: skip
    torch.testing.assert_close(logits[:3], expected, rtol=1e-5, atol=1e-5)
    for layer, reference in zip(cache.layers, reference_cache.layers, strict=True):  # the cache views the buffers
        torch.testing.assert_close(layer.keys[:, :, :8], reference.keys[:, :, :8])
        torch.testing.assert_close(layer.values[:, :, :8], reference.values[:, :, :8])
        torch.testing.assert_close(layer.conv_state, reference.conv_state)
        torch.testing.assert_close(layer.shift_state, reference.shift_state)
