"""FSDP2 (ZeRO-3-style) sharding of a ZAYA model for data-parallel training: `torch.distributed.fsdp.fully_shard`.

Each decoder layer is its own FSDP unit (its parameters are all-gathered just before its forward and backward and
freed after), the root holds the embeddings, final norm and head. Parameters, gradients and optimizer state become
DTensors sharded along dim 0, so each rank holds 1/N of them.

Gradients are reduce-scattered with SUM, not FSDP's default mean: every rank's loss is already its share of the
global token mean (the trainer normalises by the global token count), so summing gives exactly the gradient of one
process on the whole batch, as the replicated path's all-reduce does.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

if TYPE_CHECKING:
    from ..modeling_zaya import ZayaForCausalLM

# The decoder layers return the router state as a view; FSDP2 warns because an in-place op on it would skip the
# pre-backward all-gather. Nothing modifies it in place (the 2-process test matches one process to 1e-5).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPZayaDecoderLayer\) returned a view tensor")


def shard_model(model: ZayaForCausalLM) -> FSDPModule:
    """Shard `model` in place over the default process group; returns it."""
    for layer in model.model.decoder_layers():
        fully_shard(layer)
    sharded = fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-scaled sum
    return sharded


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def local_scalar(value: torch.Tensor) -> torch.Tensor:
    """A DTensor result (e.g. `clip_grad_norm_` over sharded gradients) as a plain tensor; others unchanged."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
