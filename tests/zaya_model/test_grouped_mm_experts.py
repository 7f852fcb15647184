"""The grouped-matmul experts path (`zaya_model.kernels.grouped_mm_experts`) equals the reference experts: outputs and
gradients, skip class included, in fp32 and under bf16 autocast; adapters keep the reference path."""

import pytest
import torch
from tiny_models import TINY_ZAYA, randomize_zaya, skip_prone_model

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.kernels.grouped_mm_experts import use_grouped_mm_experts


def _block_inputs(seed: int, tokens: int = 40):
    torch.manual_seed(seed)
    model = randomize_zaya(ZayaForCausalLM(ZayaConfig(**TINY_ZAYA)))
    block = model.model.layers[0].mlp
    states = torch.randn(2, tokens // 2, TINY_ZAYA["hidden_size"])
    # Every class, the skip class (index E) included, and one expert left without tokens.
    choice = torch.randint(0, TINY_ZAYA["num_experts"], (2, tokens // 2))
    choice[0, :5] = TINY_ZAYA["num_experts"]
    choice[choice == 1] = 2
    return block, states, choice


def _outputs_and_grads(block, states, choice, implementation):
    states = states.clone().requires_grad_()
    weights = torch.randn(*states.shape, generator=torch.Generator().manual_seed(9))  # the same for both calls
    routing_weights = torch.rand(*choice.shape, 1, generator=torch.Generator().manual_seed(8))
    block.experts.config._experts_implementation = implementation
    out = block.expert_outputs(states, choice, routing_weights)
    (out.float() * weights).sum().backward()
    grads = [states.grad, block.experts.gate_up_proj.grad, block.experts.down_proj.grad]
    block.zero_grad(set_to_none=True)
    return out.detach(), grads


def test_block_outputs_and_gradients_equal_the_reference_in_fp32():
    block, states, choice = _block_inputs(seed=0)
    ours, ours_grads = _outputs_and_grads(block, states, choice, "eager")
    kernel, kernel_grads = _outputs_and_grads(block, states, choice, "zaya_grouped_mm")
    torch.testing.assert_close(kernel, ours, rtol=1e-5, atol=1e-6)
    assert kernel[0, :5].abs().max() == 0  # skipped tokens output zero
    for got, want in zip(kernel_grads, ours_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ours_grads[1][1].abs().max() == 0 and kernel_grads[1][1].abs().max() == 0  # the unused expert
    assert torch.isfinite(kernel_grads[0]).all()  # skipped rows' gradient is zero, not the kernel's unwritten rows
    assert kernel_grads[0][0, :5].abs().max() == 0


def test_block_under_bf16_autocast_matches_the_reference():
    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()  # bf16 matmuls on AMX CPUs need the permission first
    block, states, choice = _block_inputs(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, ours_grads = _outputs_and_grads(block, states, choice, "eager")
        kernel, kernel_grads = _outputs_and_grads(block, states, choice, "zaya_grouped_mm")
    assert kernel.dtype == torch.bfloat16  # as a matmul under autocast gives
    torch.testing.assert_close(kernel.float(), ours.float(), rtol=2e-2, atol=2e-3)
    for got, want in zip(kernel_grads, ours_grads, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


def test_model_loss_and_gradients_equal_the_reference():
    ids = torch.randint(3, TINY_ZAYA["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    model = skip_prone_model(ids).train()  # about half the tokens take the skip class

    def loss_and_grads():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    reference = loss_and_grads()
    assert use_grouped_mm_experts(model) == TINY_ZAYA["num_hidden_layers"]
    kernel = loss_and_grads()
    torch.testing.assert_close(kernel[0], reference[0], rtol=1e-5, atol=1e-6)
    assert kernel[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(kernel[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert use_grouped_mm_experts(model, enabled=False) == 0
    assert model.config._experts_implementation == "eager"  # back on the reference


def test_expert_adapters_keep_the_reference_path():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = ZayaForCausalLM(ZayaConfig(**TINY_ZAYA))
    config = peft.LoraConfig(r=2, target_modules=["o_proj"], target_parameters=["experts.gate_up_proj"])
    adapted = peft.get_peft_model(model, config)
    assert use_grouped_mm_experts(adapted) == 0
