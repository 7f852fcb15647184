"""ZAYA's top-1 experts as two grouped matmuls with no host synchronisation: the GPU path of the MoE half.

The reference (`ZayaSparseMoeBlock.expert_outputs`) drops skip-class tokens with `nonzero` and sizes its buffers
from the routing on the host, so every MoE layer waits for the device. Here the shapes never depend on the routing:
tokens are sorted by their class (the skip class, numbered `num_experts`, sorts last), `torch.histc` counts the
tokens of each real expert (the skip class falls outside its range), and `F.grouped_mm` multiplies each expert's
rows up to the last offset; the skip rows past it are masked before (their input gradient) and after (their output),
since the kernel leaves them unwritten. Nothing leaves the device, so the block runs asynchronously and compiles as
one graph.

Under autocast the products run in the autocast dtype, as a built-in matmul would (`F.grouped_mm` is not autocast
aware). `use_grouped_mm_experts(model)` switches a model's MoE blocks to this path; blocks whose experts carry
adapters (PEFT's LoRA wraps or parametrizes them) keep the reference path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize


def compute_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `hidden_states` runs in: the autocast dtype where autocast is on, else its own."""
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden_states.dtype


def grouped_mm_expert_outputs(block: nn.Module, hidden_states: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """Each token's expert output, unweighted, zero where the skip class was chosen: `hidden_states` [..., H],
    `choice` [...] in [0, E] -> [..., H], as `ZayaSparseMoeBlock.expert_outputs` computes it."""
    experts = block.experts
    num_experts = experts.num_experts
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_choice = choice.reshape(-1)
    dtype = compute_dtype(flat)

    order = torch.argsort(flat_choice)
    routed = (flat_choice.index_select(0, order) < num_experts)[:, None]
    # histc counts in floating point; classes are small integers, exact in fp32. Values past `max` (the skip
    # class) are not counted.
    counts = torch.histc(flat_choice.to(torch.float32), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)

    # `where` (not a product): garbage past the last offset may be NaN, and its gradient stops here.
    grouped = torch.where(routed, flat.index_select(0, order).to(dtype), 0.0)
    gate_up = F.grouped_mm(grouped, experts.gate_up_proj.to(dtype).transpose(1, 2), offs=offsets)
    gate, up = gate_up.split(experts.intermediate_size, dim=-1)
    output = F.grouped_mm(experts.act_fn(gate) * up, experts.down_proj.to(dtype).transpose(1, 2), offs=offsets)
    output = torch.where(routed, output, 0.0)
    # Back to token order; `index_copy` with a permutation writes every row.
    return torch.empty_like(output).index_copy(0, order, output).view(*hidden_states.shape[:-1], -1)


def has_adapters(experts: nn.Module) -> bool:
    """Whether PEFT's expert LoRA is on `experts`: it wraps the module or parametrizes its weights."""
    return not hasattr(experts, "gate_up_proj") or parametrize.is_parametrized(experts)


def use_grouped_mm_experts(model: nn.Module, enabled: bool = True) -> int:
    """Switch every ZAYA MoE block of `model` without expert adapters to `grouped_mm_expert_outputs` (or back to the
    reference with `enabled=False`). Returns the number of blocks switched."""
    switched = 0
    for module in model.modules():
        if not hasattr(module, "expert_outputs") or not hasattr(module, "experts"):
            continue
        if "expert_outputs" in module.__dict__:
            del module.expert_outputs  # back to the class's reference method
        if enabled and not has_adapters(module.experts):
            module.expert_outputs = functools.partial(grouped_mm_expert_outputs, module)
            switched += 1
    return switched


__all__ = ["compute_dtype", "grouped_mm_expert_outputs", "has_adapters", "use_grouped_mm_experts"]
