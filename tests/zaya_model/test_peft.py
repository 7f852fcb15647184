"""LoRA through PEFT: attention projections (target_modules) and fused 3-D experts (target_parameters)."""

import peft
import pytest
import torch
import transformers
from tiny_models import TINY_ZAYA, randomize_zaya

from zaya_model import ZayaConfig, ZayaForCausalLM

ATTENTION = ["q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def base_model():
    torch.manual_seed(0)
    return randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA)))


def test_lora_on_attention_and_experts_trains_saves_and_reloads(tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, target_parameters=EXPERTS)
    model = peft.get_peft_model(base_model(), config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert sum("mlp.experts" in n for n in trainable) >= 2 * 2 * TINY_ZAYA["num_hidden_layers"]
    assert any("qkv_proj.q_proj.lora_A" in n for n in trainable)
    assert all("lora_" in n for n in trainable)

    input_ids = torch.arange(3, 35).repeat(2)[None].repeat(2, 1)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    frozen_before = model.get_base_model().model.embed_tokens.weight.clone()
    losses = []
    for _ in range(15):
        loss = model(input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert torch.equal(model.get_base_model().model.embed_tokens.weight, frozen_before)

    model.eval()
    with torch.no_grad():
        expected = model(input_ids).logits
    model.save_pretrained(tmp_path)
    saved = set(peft.utils.load_peft_weights(str(tmp_path)))
    assert any("experts" in name for name in saved) and any("q_proj" in name for name in saved)

    reloaded = peft.PeftModel.from_pretrained(base_model(), tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, expected)
        # The adapter really changes the model: the bare base gives other logits.
        assert (base_model().eval()(input_ids).logits - expected).abs().max() > 1e-4


def lora_pair(tmp_path):
    """Ours and upstream `transformers` `zaya`: same base weights, same nonzero LoRA on attention and experts."""
    ours_base = base_model()
    ours_base.save_pretrained(tmp_path)
    upstream_base = transformers.ZayaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    config = dict(r=4, lora_alpha=8, target_modules=ATTENTION, target_parameters=EXPERTS)
    ours = peft.get_peft_model(ours_base, peft.LoraConfig(**config))
    upstream = peft.get_peft_model(upstream_base, peft.LoraConfig(**config))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    missing = upstream.load_state_dict({k: v for k, v in ours.state_dict().items() if "lora_" in k}, strict=False)
    assert not missing.unexpected_keys
    return ours, upstream


def autograd_node_names(tensor: torch.Tensor) -> set[str]:
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_expert_lora_stays_low_rank_and_matches_upstream_peft(tmp_path):
    """Our experts run LoRA as x W^T + s (x A^T) B^T instead of PEFT's materialised W + s B A: same loss and
    gradients as upstream + PEFT (which materialises), and no gradient through the adapted expert stack."""
    ours, upstream = lora_pair(tmp_path)
    input_ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(6))
    upstream_loss = upstream(input_ids, labels=input_ids, use_cache=False).loss
    ours_loss = ours(input_ids, labels=input_ids, use_cache=False).loss
    # PEFT's parametrization folds W + s·B·A with one baddbmm; none may be in our graph (upstream's has one per weight).
    assert "BaddbmmBackward0" not in autograd_node_names(ours_loss)
    assert "BaddbmmBackward0" in autograd_node_names(upstream_loss)
    ours_loss.backward()
    upstream_loss.backward()

    assert abs(ours_loss.item() - upstream_loss.item()) <= 1e-5
    upstream_grads = {n: p.grad for n, p in upstream.named_parameters() if p.requires_grad}
    expert_grads = 0
    for name, parameter in ours.named_parameters():
        if parameter.requires_grad:
            assert (parameter.grad - upstream_grads[name]).abs().max() <= 1e-5, name
            expert_grads += "experts" in name
    assert expert_grads == 2 * 2 * TINY_ZAYA["num_hidden_layers"]


@pytest.mark.parametrize("batch", [1, 2])  # decode steps: the one-token expert path, the grouped one
@torch.no_grad()
def test_expert_lora_decode_matches_upstream_peft(tmp_path, batch):
    """Decode steps apply the experts' low-rank update too: cached decode steps match upstream."""
    ours, upstream = lora_pair(tmp_path)
    ours.eval(), upstream.eval()
    input_ids = torch.randint(3, 128, (batch, 9), generator=torch.Generator().manual_seed(7))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True)
    ours_out = ours.generate(input_ids=input_ids, return_dict_in_generate=True, **kwargs)
    upstream_out = upstream.generate(input_ids=input_ids, return_dict_in_generate=True, **kwargs)
    for ours_logits, upstream_logits in zip(ours_out.logits, upstream_out.logits, strict=True):
        assert (ours_logits - upstream_logits).abs().max() <= 1e-5


def test_expert_lora_skips_peft_parametrization_and_falls_back_where_peft_must_run(tmp_path, monkeypatch):
    """Our MoE block reads the expert adapters' factors from PEFT's wrappers instead of letting them register (and
    evaluate) a parametrization of each expert stack per forward; PEFT's own path still runs where it must."""
    ours, upstream = lora_pair(tmp_path)
    ours.eval(), upstream.eval()
    registered = []
    register = torch.nn.utils.parametrize.register_parametrization
    monkeypatch.setattr(
        torch.nn.utils.parametrize,
        "register_parametrization",
        lambda module, name, *args, **kwargs: registered.append(name) or register(module, name, *args, **kwargs),
    )
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        upstream_logits = upstream(input_ids).logits
        assert registered  # upstream's experts take PEFT's path
        registered.clear()
        assert (ours(input_ids).logits - upstream_logits).abs().max() <= 1e-5
        assert registered == []
        with ours.disable_adapter():  # disabled adapters: the base model
            base_logits = ours(input_ids).logits
        assert (base_logits - upstream_logits).abs().max() > 1e-4

        # Two active adapters on the experts: PEFT sums them into one materialised delta, and we read that.
        config = dict(r=4, lora_alpha=8, target_parameters=EXPERTS)
        for model in (ours, upstream):
            model.add_adapter("second", peft.LoraConfig(**config))
            generator = torch.Generator().manual_seed(9)  # the same second adapter in both
            for name, parameter in model.named_parameters():
                if ".second." in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
            model.base_model.set_adapter(["default", "second"])
        registered.clear()
        expected = upstream(input_ids).logits
        assert (ours(input_ids).logits - expected).abs().max() <= 1e-5
        assert "gate_up_proj" in registered and (expected - upstream_logits).abs().max() > 1e-4
