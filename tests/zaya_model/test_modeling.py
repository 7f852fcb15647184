"""Our ZAYA1 on its own: config preset, cache, padding, packing, generation, experts, skip modes."""

import pytest
import torch
from tiny_models import TINY_ZAYA, randomize_zaya

from zaya_model import ZayaCache, ZayaConfig, ZayaForCausalLM, count_parameters


def test_zaya1_base_parameter_counts_on_meta_device():
    config = ZayaConfig.zaya1_base()
    with torch.device("meta"):
        model = ZayaForCausalLM(config)
    counts = count_parameters(model)
    assert round(counts["total"] / 1e9, 2) == 8.84
    assert round(counts["non_embedding"] / 1e9, 2) == 8.30
    assert round(counts["active_non_embedding"] / 1e9, 3) == 0.754
    assert config.skip_expert_mode == "scaled_input"
    assert config.rope_theta == 1_000_000.0 and config.partial_rotary_factor == 0.5


def test_config_round_trips_and_rejects_bad_values(tmp_path):
    config = ZayaConfig(**TINY_ZAYA, skip_expert_mode="scaled_input")
    config.save_pretrained(tmp_path)
    loaded = ZayaConfig.from_pretrained(tmp_path)
    assert loaded.skip_expert_mode == "scaled_input" and loaded.rope_parameters == config.rope_parameters
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ZayaConfig(**TINY_ZAYA, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="skip_expert_mode"):
        ZayaConfig(**TINY_ZAYA, skip_expert_mode="identity")
    with pytest.raises(ValueError, match="cca_time0=0"):
        ZayaConfig(**TINY_ZAYA, cca_time0=0)


@pytest.mark.parametrize("kernels", [(1, 1), (3, 2)])
@torch.no_grad()
def test_other_cca_kernel_sizes_decode_and_pack_exactly(kernels):
    # (1, 1): the convolutions read no history, only the value shift does; (3, 2): longer than ZAYA1's (2, 2).
    torch.manual_seed(0)
    config = ZayaConfig(**TINY_ZAYA, cca_time0=kernels[0], cca_time1=kernels[1])
    model = randomize_zaya(ZayaForCausalLM(config)).eval()
    input_ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    full = model(input_ids).logits
    out = model(input_ids[:, :36], use_cache=True)  # long enough for the Conv1d path
    pieces, cache = [out.logits], out.past_key_values
    for step in range(36, 40):
        pieces.append(model(input_ids[:, step : step + 1], past_key_values=cache, use_cache=True).logits)
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-5

    for end in (20, 40):  # each token's receptive field; the convolutions, then the tokens after each start
        documents = [input_ids[0, :7], input_ids[0, 7:8], input_ids[0, 8:end]]
        position_ids = torch.cat([torch.arange(len(d)) for d in documents])[None]
        packed = model(torch.cat(documents)[None], position_ids=position_ids, use_cache=False).logits[0]
        separate = torch.cat([model(d[None], use_cache=False).logits[0] for d in documents])
        assert (packed - separate).abs().max() <= 1e-5


@pytest.mark.parametrize("skip_mode", ["zero", "scaled_input"])
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(skip_mode):
    torch.manual_seed(0)
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA, skip_expert_mode=skip_mode))).eval()
    for layer in model.model.layers:  # make the skip class common so both modes are exercised
        layer.mlp.gate.balancing_biases[-1] = 0.3
    input_ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    full = model(input_ids).logits
    out = model(input_ids[:, :10], use_cache=True)
    assert isinstance(out.past_key_values, ZayaCache)
    pieces = [out.logits]
    cache = out.past_key_values
    # A multi-token chunk continuing from the cache, then single-token steps.
    out = model(input_ids[:, 10:13], past_key_values=cache, use_cache=True)
    pieces.append(out.logits)
    for step in range(13, 30):
        pieces.append(model(input_ids[:, step : step + 1], past_key_values=cache, use_cache=True).logits)
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-5


@torch.no_grad()
def test_scaled_input_skip_returns_probability_times_input():
    torch.manual_seed(0)
    config = ZayaConfig(**TINY_ZAYA, skip_expert_mode="scaled_input")
    block = randomize_zaya(ZayaForCausalLM(config)).model.layers[1].mlp
    block.gate.balancing_biases.copy_(torch.tensor([-5.0] * config.num_experts + [5.0]))
    hidden = torch.randn(2, 5, config.hidden_size)
    router_states = torch.randn(2, 5, config.router_hidden_size)
    out, _, logits, choice = block(hidden, router_states)
    assert (choice == config.num_experts).all()
    skip_probability = torch.softmax(logits, -1)[..., -1:]
    torch.testing.assert_close(out, skip_probability * hidden)


@pytest.mark.parametrize("tokens", [50, 3, 1])  # grouped matmul: large and small groups, one token
@torch.no_grad()
def test_experts_match_per_token_reference(tiny_model, tokens):
    experts = tiny_model.model.layers[0].mlp.experts
    hidden = torch.randn(tokens, TINY_ZAYA["hidden_size"])
    index = torch.randint(0, TINY_ZAYA["num_experts"], (tokens,))
    index[: min(tokens, 7)] = 2  # uneven groups, and some experts may get none
    reference = []
    for token, expert in zip(hidden, index.tolist(), strict=True):
        gate, up = (experts.gate_up_proj[expert] @ token).chunk(2)
        reference.append(experts.down_proj[expert] @ (torch.nn.functional.silu(gate) * up))
    weights = torch.rand(tokens, 1)
    expected = torch.stack(reference) * weights
    torch.testing.assert_close(experts(hidden, index[:, None], weights), expected, rtol=1e-5, atol=1e-6)
    # Index E is the skip class: those tokens get zero, and the others their experts' outputs.
    skipped = torch.arange(tokens) % 3 == 1
    output = experts(hidden, index.masked_fill(skipped, TINY_ZAYA["num_experts"])[:, None], weights)
    torch.testing.assert_close(output, expected.masked_fill(skipped[:, None], 0.0), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_left_padding_does_not_change_any_sequence(tiny_model):
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=generator) for n in (12, 7, 3)]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        attention_mask[row, width - len(prompt) :] = 1
    kwargs = dict(
        max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    batched = tiny_model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    for row, prompt in enumerate(prompts):
        alone = tiny_model.generate(prompt[None], **kwargs)
        assert torch.equal(batched.sequences[row, width:], alone.sequences[0, len(prompt) :])
        for batched_step, alone_step in zip(batched.logits, alone.logits, strict=True):
            assert (batched_step[row] - alone_step[0]).abs().max() <= 1e-5


# 28 tokens gather each token's receptive field; 58 run the convolutions and recompute the tokens after each start.
@pytest.mark.parametrize("lengths", [(9, 1, 5, 13), (9, 1, 5, 13, 30)])
def test_packed_documents_do_not_leak(tiny_model, lengths):
    generator = torch.Generator().manual_seed(6)
    documents = [torch.randint(3, 128, (n,), generator=generator) for n in lengths]
    packed = torch.cat(documents)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in documents])[None]
    packed_logits = tiny_model(packed, position_ids=position_ids, use_cache=False).logits[0]
    separate = torch.cat([tiny_model(d[None], use_cache=False).logits[0] for d in documents])
    assert (packed_logits - separate).abs().max() <= 1e-5
    # Training on the pack gives each weight the gradient of training on the documents one by one.
    parameters = [p for p in tiny_model.parameters() if p.requires_grad]
    packed_grads = torch.autograd.grad(packed_logits.square().sum(), parameters, allow_unused=True)
    separate_grads = torch.autograd.grad(separate.square().sum(), parameters, allow_unused=True)
    for packed_grad, separate_grad in zip(packed_grads, separate_grads, strict=True):
        if packed_grad is not None:
            assert (packed_grad - separate_grad).abs().max() <= 1e-4 * max(1.0, separate_grad.abs().max().item())
    # Without the restart the documents would see each other, so the test can fail.
    with torch.no_grad():
        unpacked = tiny_model(packed, use_cache=False).logits[0]
    assert (unpacked - separate).abs().max() > 1e-3


@torch.no_grad()
def test_generation_modes(tiny_model):
    input_ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(7))
    greedy = tiny_model.generate(input_ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert greedy.shape == (2, 14)

    torch.manual_seed(123)
    sampled_a = tiny_model.generate(input_ids, max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.8)
    torch.manual_seed(123)
    sampled_b = tiny_model.generate(input_ids, max_new_tokens=8, do_sample=True, top_p=0.9, temperature=0.8)
    assert torch.equal(sampled_a, sampled_b)

    several = tiny_model.generate(input_ids, max_new_tokens=5, do_sample=True, num_return_sequences=3)
    assert several.shape[0] == 6

    # Stop on EOS: make the third greedy token the EOS token, generation ends there.
    eos = int(greedy[0, 8])
    stopped = tiny_model.generate(input_ids[:1], max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert stopped.shape[1] <= 9 and int(stopped[0, -1]) == eos


def test_gradient_checkpointing_gives_same_gradients(tiny_config):
    torch.manual_seed(0)
    model = randomize_zaya(ZayaForCausalLM(tiny_config)).train()
    input_ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(8))

    def gradients():
        model.zero_grad()
        model(input_ids, labels=input_ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = gradients()
    assert plain.keys() == checkpointed.keys() and len(plain) > 50
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_trains_from_scratch(tiny_config):
    torch.manual_seed(0)
    model = ZayaForCausalLM(tiny_config).train()
    for layer in model.model.layers:
        assert torch.equal(layer.self_attn.qk_norm.temp, torch.ones(2))  # 0 would make attention uniform
        assert layer.mlp.gate.balancing_biases[-1] == -1.0
    pattern = torch.arange(3, 35).repeat(4)[None].repeat(4, 1)  # a learnable repeating sequence
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(pattern, labels=pattern, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@torch.no_grad()
def test_save_and_load_round_trip_is_bit_exact(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path)
    loaded = ZayaForCausalLM.from_pretrained(tmp_path).eval()
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    input_ids = torch.randint(3, 128, (1, 10))
    # Equal up to rounding: MKL's reduction order follows the weights' alignment, which a memory-mapped load changes.
    torch.testing.assert_close(loaded(input_ids).logits, tiny_model(input_ids).logits, rtol=1e-6, atol=1e-6)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("num_items", [None, 23])
def test_skip_logits_gives_the_same_loss_and_gradients(tiny_config, num_items):
    """`skip_logits` runs the LM head only where a label is trained: same loss and gradients as the full head."""
    input_ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    labels = input_ids.clone()
    labels[0, :15] = -100  # a prompt, then the trained answer
    labels[1, 3:9] = -100
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    results = []
    for skip_logits in (False, True):
        torch.manual_seed(0)
        model = randomize_zaya(ZayaForCausalLM(tiny_config)).train()
        out = model(input_ids, labels=labels, skip_logits=skip_logits, **extra)
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (full, full_grads), (skipped, skipped_grads) = results
    assert skipped.logits is None and full.logits.shape == (2, 24, 128)
    assert torch.allclose(skipped.loss, full.loss, atol=1e-6, rtol=0)
    assert full_grads.keys() == skipped_grads.keys()
    for name, grad in full_grads.items():
        assert torch.allclose(skipped_grads[name], grad, atol=1e-6, rtol=1e-5), name
    with pytest.raises(ValueError, match="skip_logits"):
        model(input_ids, skip_logits=True)
