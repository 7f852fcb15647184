"""The compiled decode step (`zaya_model.decode_step`): the same tokens and logits as eager decoding."""

import peft
import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY_ZAYA, randomize_zaya, skip_prone_model
from torch._inductor.compile_fx import compile_fx

from zaya_model import ZayaConfig, ZayaForCausalLM, decode_step
from zaya_model.decode_step import _attend_one_query, _routed_experts, reserved_capacity


@pytest.mark.parametrize("skip_mode", ["zero", "scaled_input"])
def test_routed_experts_equal_the_moe_block(skip_mode):
    torch.manual_seed(1)
    ids = torch.randint(3, TINY_ZAYA["vocab_size"], (1, 16))
    model = skip_prone_model(ids, skip_expert_mode=skip_mode)
    captured = {}
    block = model.model.layers[1].mlp
    # The router sees the block's inputs: its normed hidden states and the previous layer's router states.
    hook = block.gate.register_forward_pre_hook(lambda _module, args: captured.update(args=args))
    with torch.no_grad():
        model(ids)
    hook.remove()
    # This layer's real inputs for 16 tokens, as 16 one-token rows (a decode step's shape).
    hidden, router_states = (tensor.reshape(16, 1, -1) for tensor in captured["args"])
    with torch.no_grad():
        expected, expected_states, _, choice = block(hidden, router_states)
        got, states = _routed_experts(block, hidden, router_states)
    skipped = choice == TINY_ZAYA["num_experts"]
    assert skipped.any() and not skipped.all()  # both the skip class and experts are exercised
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(states, expected_states, rtol=0, atol=0)


def test_one_query_attention_equals_sdpa_over_the_attended_slots():
    torch.manual_seed(0)
    query, keys, values = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 10, 16), torch.randn(3, 2, 10, 16)
    attend = torch.rand(3, 10) > 0.4
    attend[:, 0] = True
    expected = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=attend[:, None, None], scale=0.25, enable_gqa=True
    ).transpose(1, 2)
    # Slots not attended to are cache memory never written: they may hold anything, NaN and infinity included.
    unwritten = ~attend[:, None, :, None]
    keys, values = keys.masked_fill(unwritten, float("nan")), values.masked_fill(unwritten, float("inf"))
    torch.testing.assert_close(_attend_one_query(query, keys, values, attend, 0.25), expected, rtol=0, atol=1e-6)


def test_capacity_is_reserved_in_whole_steps():
    assert [reserved_capacity(n) for n in (1, 256, 257, 700)] == [256, 256, 512, 768]


def greedy(model, input_ids, attention_mask, new_tokens=12):
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.slow
def test_compiled_decode_generates_what_eager_decoding_does(monkeypatch):
    torch.manual_seed(1)
    model = skip_prone_model(torch.randint(3, TINY_ZAYA["vocab_size"], (2, 16)), skip_expert_mode="scaled_input")
    # A left-padded batch of three prompt lengths, then a single prompt: two batch sizes, two compiled graphs.
    batch = torch.randint(3, TINY_ZAYA["vocab_size"], (3, 9))
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    mask[2, :7] = 0
    batch[mask == 0] = 0
    single = torch.randint(3, TINY_ZAYA["vocab_size"], (1, 5))
    cases = [(batch, mask), (single, torch.ones_like(single)), (batch, mask)]
    eager = [greedy(model, ids, m) for ids, m in cases]

    model.enable_compiled_decode()
    compiles = []
    monkeypatch.setattr(
        decode_step, "compile_fx", lambda *args, **kwargs: compiles.append(args) or compile_fx(*args, **kwargs)
    )
    compiled = [greedy(model, ids, m) for ids, m in cases]
    for (eager_tokens, eager_logits), (tokens, logits) in zip(eager, compiled, strict=True):
        assert torch.equal(tokens, eager_tokens)
        torch.testing.assert_close(logits, eager_logits, rtol=0, atol=1e-5)
    # Every step after the first of a generation reused the program of its batch size: one per batch size, and the
    # repeated batch compiled nothing new.
    assert model.compiled_decode.compiled_for == {
        (3, reserved_capacity(9 + 12), torch.float32, torch.device("cpu")),
        (1, reserved_capacity(5 + 12), torch.float32, torch.device("cpu")),
    }
    assert len(compiles) == 2


@pytest.mark.slow
def test_weights_changed_after_compiling_are_the_ones_decoded():
    torch.manual_seed(2)
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))).eval()
    other = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))).eval()
    prompt = torch.randint(3, TINY_ZAYA["vocab_size"], (1, 6))
    mask = torch.ones_like(prompt)
    model.enable_compiled_decode()
    greedy(model, prompt, mask)  # compiles the program of this shape

    # Replaced tensors (a loaded state dict, an LM head untied from the embeddings) and tensors changed in place
    # (an optimizer step) are all read by the program compiled before.
    model.load_state_dict(other.state_dict(), assign=True)
    head = torch.randn_like(other.lm_head.weight)
    for m in (model, other):
        m.lm_head.weight = torch.nn.Parameter(head.clone())
        with torch.no_grad():
            m.model.layers[0].mlp.experts.down_proj.mul_(-1)
    tokens, logits = greedy(model, prompt, mask)
    expected_tokens, expected_logits = greedy(other, prompt, mask)
    assert len(model.compiled_decode.programs) == 1
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_weight_laid_out_anew_gets_a_program_of_its_own(monkeypatch):
    torch.manual_seed(3)
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))).eval()
    prompt = torch.randint(3, TINY_ZAYA["vocab_size"], (1, 6))
    mask = torch.ones_like(prompt)
    expected_tokens, expected_logits = greedy(model, prompt, mask)
    model.enable_compiled_decode()
    greedy(model, prompt, mask)
    compiles = []
    monkeypatch.setattr(
        decode_step, "compile_fx", lambda *args, **kwargs: compiles.append(args) or compile_fx(*args, **kwargs)
    )
    # The same values, column-major: read with the row-major strides compiled before, they would be transposed.
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj.weight = torch.nn.Parameter(o_proj.weight.detach().t().contiguous().t())
    tokens, logits = greedy(model, prompt, mask)
    assert len(compiles) == 1
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)


def test_models_with_adapters_decode_eagerly():
    input_ids = torch.randint(3, TINY_ZAYA["vocab_size"], (2, 6))
    model = skip_prone_model(input_ids)
    adapter = peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, adapter)
    lora.eval()
    expected = greedy(lora, input_ids, torch.ones_like(input_ids))
    model.enable_compiled_decode()
    assert model.compiled_decode.new_cache(32) is None  # the adapter's weights would be bypassed
    tokens, logits = greedy(lora, input_ids, torch.ones_like(input_ids))
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1], rtol=0, atol=0)
    assert not model.compiled_decode.compiled_for
