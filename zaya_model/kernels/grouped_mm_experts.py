"""ZAYA's top-1 experts as two grouped matmuls with no host synchronisation: the GPU path of the MoE half.

The reference (`ZayaExperts.forward`) drops skip-class tokens with `nonzero` and sizes its buffers from the routing
on the host, so every MoE layer waits for the device. Here the shapes never depend on the routing: tokens are sorted
by their class (the skip class, numbered `num_experts`, sorts last), `torch.histc` counts the tokens of each real
expert (the skip class falls outside its range), and `F.grouped_mm` multiplies each expert's rows up to the last
offset; the skip rows past it are masked before (their input gradient) and after (their output), since the kernel
leaves them unwritten. Nothing leaves the device, so the block runs asynchronously and compiles as one graph.

Under autocast the products run in the autocast dtype, as a built-in matmul would (`F.grouped_mm` is not autocast
aware). Registered as the experts implementation `"zaya_grouped_mm"`; `use_grouped_mm_experts(model)` selects it.
Experts that carry adapters (PEFT's LoRA wraps or parametrizes them) keep the reference path.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..modeling_zaya import ZayaExperts


def compute_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `hidden_states` runs in: the autocast dtype where autocast is on, else its own."""
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden_states.dtype


def grouped_mm_experts_forward(
    experts: ZayaExperts,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    adapted: dict | None = None,
) -> torch.Tensor:
    """`ZayaExperts.forward`'s result: `hidden_states` [tokens, H], `top_k_index`/`top_k_weights` [tokens, 1] (index
    E: skipped) -> the weighted expert outputs [tokens, H], zero for skipped tokens."""
    if adapted or has_adapters(experts):
        return inspect.unwrap(type(experts).forward)(experts, hidden_states, top_k_index, top_k_weights, adapted)
    num_experts = experts.num_experts
    flat_choice = top_k_index.reshape(-1)
    dtype = compute_dtype(hidden_states)

    order = torch.argsort(flat_choice)
    routed = (flat_choice.index_select(0, order) < num_experts)[:, None]
    # histc counts in floating point; classes are small integers, exact in fp32. Values past `max` (the skip
    # class) are not counted.
    counts = torch.histc(flat_choice.to(torch.float32), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)

    # `where` (not a product): garbage past the last offset may be NaN, and its gradient stops here.
    grouped = torch.where(routed, hidden_states.index_select(0, order).to(dtype), 0.0)
    gate_up = F.grouped_mm(grouped, experts.gate_up_proj.to(dtype).transpose(1, 2), offs=offsets)
    gate, up = gate_up.split(experts.intermediate_size, dim=-1)
    output = F.grouped_mm(experts.act_fn(gate) * up, experts.down_proj.to(dtype).transpose(1, 2), offs=offsets)
    output = torch.where(routed, output, 0.0)
    # Back to token order; `index_copy` with a permutation writes every row.
    output = torch.empty_like(output).index_copy(0, order, output)
    return output * top_k_weights.to(output.dtype)


def has_adapters(experts: nn.Module) -> bool:
    """Whether PEFT's expert LoRA is on `experts`: it wraps the module or parametrizes its weights."""
    return not hasattr(experts, "gate_up_proj") or parametrize.is_parametrized(experts)


def use_grouped_mm_experts(model: PreTrainedModel, enabled: bool = True) -> int:
    """Select `"zaya_grouped_mm"` as `model`'s experts implementation (or the reference with `enabled=False`).
    Returns the number of MoE blocks that then run it: those whose experts carry no adapters."""
    model.set_experts_implementation("zaya_grouped_mm" if enabled else "eager")
    if not enabled:
        return 0
    blocks = [module for module in model.modules() if type(module).__name__ == "ZayaSparseMoeBlock"]
    return sum(not has_adapters(block.get_submodule("experts")) for block in blocks)


__all__ = ["compute_dtype", "grouped_mm_experts_forward", "has_adapters", "use_grouped_mm_experts"]
