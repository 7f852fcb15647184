"""`zaya_model.cpu.compiled_layers.enable_compiled_layers`: the attention, routing and merge parts of each block as
compiled graphs give what the eager model gives (logits, loss, every gradient), for training batches (plain, packed,
with LoRA or gradient checkpointing) and for prompts (prefill, with the experts gathered inside the compiled graph,
then eager decoding from the cache it wrote)."""

from __future__ import annotations

import copy

import pytest
import torch
from compile_helpers import compiled_calls, compiled_graphs, no_cpp_compiler
from tiny_models import TINY_ZAYA, randomize_zaya, skip_prone_model
from torch._dynamo.utils import counters

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.cpu import compiled_layers
from zaya_model.cpu.compiled_layers import compiled_layers_enabled, enable_compiled_layers
from zaya_model.training.balancing import BalancingBiasUpdater

gathers_experts = compiled_layers.gathers_experts

pytestmark = pytest.mark.slow  # each test compiles graphs (seconds each on one thread)


def model_pair(**config_overrides) -> tuple[ZayaForCausalLM, ZayaForCausalLM]:
    torch.manual_seed(0)
    eager = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA, **config_overrides)))
    compiled = copy.deepcopy(eager)
    enable_compiled_layers(compiled)
    return eager, compiled


def loss_and_gradients(model, input_ids, **kwargs):
    model.zero_grad()
    loss = model(input_ids, labels=input_ids, use_cache=False, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_training(eager, compiled, input_ids, **kwargs):
    before = compiled_calls()
    eager_loss, eager_grads = loss_and_gradients(eager.train(), input_ids, **kwargs)
    assert compiled_calls() == before
    compiled_loss, compiled_grads = loss_and_gradients(compiled.train(), input_ids, **kwargs)
    assert compiled_calls() > before
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys() and len(eager_grads) >= 20
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_layers_are_compiled_and_train_like_eager():
    eager, compiled = model_pair(skip_expert_mode="scaled_input")
    input_ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    # Packed: documents restart at position 0 (attention, convolutions and value shift cut at each start).
    position_ids = torch.cat([torch.arange(n) for n in (9, 1, 30)])[None].expand(2, -1)
    graph_breaks = sum(counters["graph_break"].values())
    updaters = [BalancingBiasUpdater(model) for model in (eager, compiled)]  # hooked after the layers were compiled
    for kwargs in ({}, {"position_ids": position_ids}):
        assert_same_training(eager, compiled, input_ids, **kwargs)
    # The routing the balancing update reads is counted under compiled layers as in the eager model.
    for eager_layer, compiled_layer in zip(eager.model.layers, compiled.model.layers, strict=True):
        counted = compiled_layer.mlp.gate.routed_token_counts
        assert counted is not None and counted.sum() == 2 * input_ids.numel()
        assert torch.equal(counted, eager_layer.mlp.gate.routed_token_counts)
    assert all(updater.step()["expert_load"] for updater in updaters)
    # Each part is one graph: the convolutions are cut at document starts inside it (a data-dependent `nonzero`
    # there would split it into a dozen graphs and slow a packed step by a third).
    assert sum(counters["graph_break"].values()) == graph_breaks
    # torch.compile made graphs of our two functions, with room for every combination a run needs.
    assert compiled_graphs() > 0
    assert torch._dynamo.config.recompile_limit >= 32
    # Turning it off restores the eager path.
    assert compiled_layers_enabled(compiled)
    enable_compiled_layers(compiled, False)
    assert not compiled_layers_enabled(compiled)


def test_gradient_checkpointing_and_lora_under_compiled_layers():
    peft = pytest.importorskip("peft")
    eager, compiled = model_pair()
    input_ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    for model in (eager, compiled):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_same_training(eager, compiled, input_ids)

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj"], target_parameters=["gate_up_proj"])
    adapted = []
    for model in (eager, compiled):
        torch.manual_seed(3)  # the same adapter initialisation for both
        adapted.append(peft.get_peft_model(model, peft.LoraConfig(**lora)))
        for name, parameter in adapted[-1].named_parameters():  # B starts at 0: move it so the adapters matter
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.1)
    eager_lora, compiled_lora = adapted
    assert_same_training(eager_lora, compiled_lora, input_ids)


@torch.no_grad()
def test_compiled_prefill_then_eager_decoding_equals_eager_generation(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    # Routers that pick the skip class for about half the tokens, which the input-scaling skip mode then merges.
    eager = skip_prone_model(torch.randint(3, 128, (2, 16), generator=generator), skip_expert_mode="scaled_input")
    compiled = copy.deepcopy(eager)
    enable_compiled_layers(compiled)
    gathered = []  # a prompt this short computes its experts inside the compiled graph, gathering their weights
    monkeypatch.setattr(
        compiled_layers, "gathers_experts", lambda *args: gathered.append(gathers_experts(*args)) or gathered[-1]
    )
    prompts = [torch.randint(3, 128, (n,), generator=generator) for n in (12, 7, 3)]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left-padded, as a batch of prompts is
        input_ids[row, width - len(prompt) :] = prompt
        attention_mask[row, width - len(prompt) :] = 1
    kwargs = dict(
        max_new_tokens=10, min_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    expected = eager.generate(input_ids, attention_mask=attention_mask, **kwargs)
    before = compiled_calls()
    got = compiled.generate(input_ids, attention_mask=attention_mask, **kwargs)
    assert compiled_calls() > before  # the prompt's prefill ran compiled, the decode steps eagerly
    assert gathered and all(gathered)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.logits, expected.logits, strict=True):
        assert (got_step - expected_step).abs().max() <= 1e-5


def test_without_a_cpp_compiler_enabling_fails_at_once_and_says_what_to_do(monkeypatch):
    model = ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))
    with no_cpp_compiler(monkeypatch), pytest.raises(RuntimeError, match="need a C\\+\\+ compiler.*install g\\+\\+"):
        enable_compiled_layers(model)
    assert not compiled_layers_enabled(model)
