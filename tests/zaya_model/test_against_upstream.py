"""Our ZAYA1 against the `zaya` model shipped in transformers (the oracle): same random weights, same logits."""

import pytest
import torch
import transformers
from tiny_models import TINY_ZAYA, randomize_zaya

from zaya_model import ZayaConfig, ZayaForCausalLM

TOLERANCE = 1e-5
ROUNDING = 1e-6


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    torch.manual_seed(0)
    ours = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))).eval()
    path = tmp_path_factory.mktemp("ours")
    ours.save_pretrained(path)
    upstream = transformers.ZayaForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    return ours, upstream


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_full_forward_matches(model_pair):
    ours, upstream = model_pair
    input_ids = torch.randint(3, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    assert max_diff(ours(input_ids).logits, upstream(input_ids).logits) <= TOLERANCE


@torch.no_grad()
def test_recorded_hidden_states_and_router_logits_match(model_pair):
    ours, upstream = model_pair
    input_ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(4))
    flags = dict(output_hidden_states=True, output_router_logits=True)
    ours_out, upstream_out = ours(input_ids, **flags), upstream(input_ids, **flags)
    layers = TINY_ZAYA["num_hidden_layers"]
    assert len(ours_out.hidden_states) == layers + 1 and len(ours_out.router_logits) == layers
    for mine, theirs in zip(ours_out.hidden_states, upstream_out.hidden_states, strict=True):
        assert mine.shape == theirs.shape and max_diff(mine, theirs) <= TOLERANCE
    for mine, theirs in zip(ours_out.router_logits, upstream_out.router_logits, strict=True):
        assert mine.shape == theirs.shape == (2 * 11, TINY_ZAYA["num_experts"] + 1)
        assert max_diff(mine, theirs) <= TOLERANCE
    # The last hidden state is the final norm's output, which the LM head reads.
    assert max_diff(ours.lm_head(ours_out.hidden_states[-1]), ours_out.logits) <= ROUNDING

    plain = ours(input_ids)
    assert plain.hidden_states is None and plain.router_logits is None
    as_tuple = ours(input_ids, use_cache=False, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], plain.logits)
    ours.config.output_router_logits = True  # the config's value when the call gives none (or None, as PEFT does)
    try:
        assert len(ours(input_ids).router_logits) == len(ours(input_ids, output_router_logits=None).router_logits)
        assert ours(input_ids, output_router_logits=False).router_logits is None
    finally:
        ours.config.output_router_logits = False


@torch.no_grad()
def test_prefill_then_32_cached_decode_steps_match(model_pair):
    ours, upstream = model_pair
    input_ids = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(2))
    ours_out = ours(input_ids, use_cache=True)
    upstream_out = upstream(input_ids, use_cache=True)
    assert max_diff(ours_out.logits, upstream_out.logits) <= TOLERANCE
    ours_cache, upstream_cache = ours_out.past_key_values, upstream_out.past_key_values
    next_tokens = ours_out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(32):
        ours_out = ours(next_tokens, past_key_values=ours_cache, use_cache=True)
        upstream_out = upstream(next_tokens, past_key_values=upstream_cache, use_cache=True)
        assert max_diff(ours_out.logits, upstream_out.logits) <= TOLERANCE
        next_tokens = ours_out.logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def test_left_padded_batch_matches(model_pair):
    ours, upstream = model_pair
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 128, (3, 24), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate((0, 5, 11)):
        attention_mask[row, :pad] = 0
        input_ids[row, :pad] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    ours_gen = ours.generate(input_ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    upstream_gen = upstream.generate(input_ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    assert torch.equal(ours_gen.sequences, upstream_gen.sequences)
    for ours_step, upstream_step in zip(ours_gen.logits, upstream_gen.logits, strict=True):
        assert max_diff(ours_step, upstream_step) <= TOLERANCE

    # Prefill logits at every real (non-pad) position agree too.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    ours_logits = ours(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    upstream_logits = upstream(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    real = attention_mask.bool()
    assert max_diff(ours_logits[real], upstream_logits[real]) <= TOLERANCE


@torch.no_grad()
def test_checkpoints_move_both_ways(model_pair, tmp_path):
    ours, upstream = model_pair
    upstream.save_pretrained(tmp_path / "upstream")
    reloaded = ZayaForCausalLM.from_pretrained(tmp_path / "upstream").eval()
    for name, tensor in upstream.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    input_ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    assert torch.equal(reloaded(input_ids).logits, ours(input_ids).logits)


@torch.no_grad()
def test_skip_mode_zero_gives_upstreams_logits_and_exactly_the_residual_path(tmp_path):
    """Force every token to the skip class. In `zero` mode the MoE half of each block then adds nothing: a block is its
    attention half and the residual merge of a zero output. Ours equals that path, computed here from the blocks'
    parts, and upstream's logits. Our experts are then filled with NaN, which would poison any token that reached one;
    upstream keeps the random ones (it runs expert 0 on skipped tokens with weight 0, where NaN would poison)."""
    torch.manual_seed(0)
    config = ZayaConfig(**TINY_ZAYA)
    assert config.skip_expert_mode == "zero"
    model = randomize_zaya(ZayaForCausalLM(config)).eval()
    for layer in model.model.layers:
        layer.mlp.gate.balancing_biases.copy_(torch.tensor([-5.0] * config.num_experts + [5.0]))
    model.save_pretrained(tmp_path)
    upstream = transformers.ZayaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    for layer in model.model.layers:
        layer.mlp.experts.gate_up_proj.fill_(float("nan"))
    input_ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))

    attention = {}  # layer index -> (the attention half's input, its output) in our forward

    def record(index):
        return lambda module, args, output: attention.__setitem__(index, (args[0], output))

    hooks = [layer.self_attn.register_forward_hook(record(i)) for i, layer in enumerate(model.model.layers)]
    try:
        logits = model(input_ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.isfinite(logits).all()

    inner = model.model
    residual = (inner.embed_tokens(input_ids) + inner.input_hidden_states_bias) * inner.input_hidden_states_scale
    for index, layer in enumerate(inner.layers):
        attention_input, attention_output = attention[index]
        # This path is what fed the attention half (to float rounding: the model merges in another order).
        assert max_diff(attention_input, layer.input_layernorm(residual)) < ROUNDING
        residual = layer.post_attention_residual_scale(attention_output, residual)
        residual = layer.post_mlp_residual_scale(torch.zeros_like(residual), residual)
    residual_path = model.lm_head(inner.norm(residual))
    assert max_diff(logits, residual_path) < ROUNDING  # an expert's output would be ~0.1
    assert max_diff(upstream(input_ids).logits, logits) < TOLERANCE
