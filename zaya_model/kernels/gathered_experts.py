"""Experts by gathering: each token's output from its own expert's weights, selected by index.

The reference groups tokens by expert, which needs the group sizes on the host: a compiled graph stops there. Here
every token multiplies by `weight[index]` as a product and a sum (not a matmul), so shapes never depend on the
routing and inductor fuses the indexing into its loops: the weights are read in place, a token at a time. Tokens
are first sorted by expert, so that consecutive tokens reading the same expert find its weights in cache.

Eagerly, indexing would copy every token's weights: outside a compiled graph this runs the reference.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..modeling_zaya import ZayaExperts


def gathered_experts_forward(
    experts: ZayaExperts,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    adapted: dict | None = None,
) -> torch.Tensor:
    """`ZayaExperts.forward`'s result, `[tokens, H]`, computed by gathering (see the module's docstring)."""
    if adapted or not torch.compiler.is_compiling():
        return inspect.unwrap(type(experts).forward)(experts, hidden_states, top_k_index, top_k_weights, adapted)
    return gathered_products(experts, hidden_states, top_k_index, top_k_weights)


def gathered_products(
    experts: ZayaExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The gathering computation itself, for code already inside a graph."""
    choice = top_k_index.reshape(-1)
    # A skipped token (index E) computes expert E-1, which `where` then drops whatever it holds.
    index = choice.clamp(max=experts.num_experts - 1)
    order = torch.argsort(index)
    states, index = hidden_states.index_select(0, order), index.index_select(0, order)
    # [tokens, out, in] * [tokens, 1, in], summed over `in`: a fused loop over each token's weight rows.
    gate_up = (experts.gate_up_proj[index] * states[:, None, :]).sum(-1)
    gate, up = gate_up.split(experts.intermediate_size, dim=-1)
    output = (experts.down_proj[index] * (experts.act_fn(gate) * up)[:, None, :]).sum(-1)
    output = torch.empty_like(output).index_copy_(0, order, output) * top_k_weights.to(output.dtype)
    return torch.where((choice < experts.num_experts)[:, None], output, 0.0)
