"""Grouped expert matmuls: the row layout of tokens grouped by expert, and the padded layout of low precision."""

from __future__ import annotations

import torch

from zaya_model.configuration_zaya import ZayaConfig
from zaya_model.grouped_linear import FEW_ROWS, group_layout, group_row_multiple, grouped_linear
from zaya_model.modeling_zaya import ZayaExperts


def test_group_layout_keeps_each_group_contiguous_and_pads_only_large_groups():
    # Group 0 large (40 tokens), group 1 empty, group 2 small (5), group 3 large (33), interleaved in token order.
    index = torch.tensor([0] * 40 + [2] * 5 + [3] * 33)[torch.randperm(78, generator=torch.Generator().manual_seed(0))]
    for multiple, expected_sizes in ((1, [40, 0, 5, 33]), (32, [64, 0, 5, 64])):
        rows, sizes = group_layout(index, num_groups=4, multiple=multiple)
        assert sizes.tolist() == expected_sizes
        assert len(set(rows.tolist())) == len(index) and int(rows.max()) < int(sizes.sum())
        start = 0
        for group, size in enumerate(sizes.tolist()):
            tokens = (index == group).nonzero().squeeze(-1)  # in token order
            assert rows[tokens].tolist() == list(range(start, start + len(tokens)))
            start += size
    assert FEW_ROWS < 33  # the large groups above are the ones padded


def test_experts_under_bf16_autocast_pad_groups_and_match_the_per_token_computation():
    torch.manual_seed(0)
    config = ZayaConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4)
    experts = ZayaExperts(config)
    for weight in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(weight, std=0.2)
    hidden = torch.randn(90, 64, requires_grad=True)
    index = torch.randint(0, 4, (90,))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert group_row_multiple(torch.float32, hidden.device) > 1  # the padded layout is in use
        output = experts(hidden, index[:, None], torch.ones(90, 1))
    assert output.dtype == torch.bfloat16
    output.float().square().sum().backward()
    grads = [hidden.grad, experts.gate_up_proj.grad, experts.down_proj.grad]

    # Reference: every token through its own expert in fp32, from bf16-rounded inputs and weights.
    def bf16(t):
        return t.to(torch.bfloat16).float()

    leaves = [
        hidden.detach().clone().requires_grad_(),
        experts.gate_up_proj.detach().clone().requires_grad_(),
        experts.down_proj.detach().clone().requires_grad_(),
    ]
    x, gate_up, down = leaves
    gate, up = torch.einsum("th,toh->to", bf16(x), bf16(gate_up)[index]).chunk(2, dim=-1)
    intermediate = bf16(torch.nn.functional.silu(bf16(gate)) * bf16(up))
    expected = torch.einsum("ti,thi->th", intermediate, bf16(down)[index])
    # bf16 keeps 8 significant bits; a token sent through a wrong expert, or padding read as data, is off by O(1).
    torch.testing.assert_close(output.float(), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    expected.square().sum().backward()
    for got, leaf in zip(grads, leaves, strict=True):
        assert got.dtype == torch.float32  # master weights keep fp32 gradients
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=3e-2 * leaf.grad.abs().max().item())


def test_grouped_linear_under_autocast_equals_the_same_product_on_a_bf16_copy_of_the_weights():
    # Under autocast each routed expert's weights are cast on their own and the gradient is written back in fp32;
    # the result must equal running the same grouped matmul on a bf16 copy of the whole stack, bit for bit.
    torch.manual_seed(0)
    weight = torch.randn(4, 24, 16, requires_grad=True)
    inputs = torch.randn(40, 16)
    group_sizes = torch.tensor([20, 0, 3, 17])  # expert 1 gets no tokens, expert 2 few (the transposed product)
    packed = []  # what saved-tensor hooks (gradient checkpointing) see: they must see the cast weights too

    def pack(tensor):
        packed.append(tuple(tensor.shape))
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = grouped_linear(inputs, weight, group_sizes)
    assert packed.count((24, 16)) == 3  # one cast copy per routed expert, none for the expert without tokens
    grad_output = torch.randn_like(output)
    output.backward(grad_output)

    copy = weight.detach().to(torch.bfloat16).requires_grad_()
    expected = grouped_linear(inputs.to(torch.bfloat16), copy, group_sizes)
    expected.backward(grad_output)
    assert output.dtype == torch.bfloat16 and torch.equal(output, expected)
    assert weight.grad.dtype == torch.float32 and torch.equal(weight.grad, copy.grad.float())
    assert not weight.grad[1].any()
