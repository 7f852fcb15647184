"""Compiled block parts for training steps and prompt prefill: `enable_compiled_layers(model)`.

A ZAYA block runs in three parts: attention and routing, the experts, and the weighted merge. For a chunk that starts
its sequences (a training batch, a prompt) the first and last are functions of tensors alone, which `torch.compile`
takes whole; the experts, whose shapes follow the routing, and anything that reads a cache stay eager. At inference a
chunk of a few tokens computes its experts by gathering each token's expert weights instead
(`zaya_model.kernels.gathered_experts`), which needs no host step: experts and merge then run as one compiled graph.

`enable_compiled_layers` gives each decoder layer of the model this forward (an attribute of the layer instance; the
reference model's class is unchanged) and `enable_compiled_layers(model, False)` removes it. Decoding steps that read
a cache run the reference forward (the local engine compiles them separately: `zaya_model.cpu.decode`).

Each combination of layer kind (the first router has no EDA input), grad mode, autocast, mask kinds and shape kind is a
graph of its own; a training run with evaluation and packed and unpacked batches makes about ten, so torch.compile's
per-function limit (8, then eager) is raised to `COMPILED_GRAPHS_LIMIT`.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn

from ..cache_zaya import ZayaCache
from ..kernels.gathered_experts import gathered_products
from ..kernels.grouped_mm_experts import has_adapters
from ..modeling_zaya import ZayaDecoderLayer, ZayaSparseMoeBlock

COMPILED_GRAPHS_LIMIT = 32

# Up to this many tokens gathering each token's expert weights beats grouped matmuls on CPU (model_bench's model);
# beyond it grouped matmuls win.
GATHERED_EXPERTS_MAX_TOKENS = 256


def require_cpp_compiler() -> None:
    """torch.compile's CPU backend (inductor) builds C++: without a compiler, say so now rather than at the first
    compiled step."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # inductor's InvalidCxxCompiler
        raise RuntimeError(
            f"compiled layers on CPU need a C++ compiler (torch.compile builds C++ kernels): {error}; install g++ "
            "or point CXX at one"
        ) from None


@functools.cache
def compiled_function(function: Callable) -> Callable:
    """One compiled wrapper per function, shared by every layer and model: the module is an argument, so its
    weights are graph inputs and all layers of a shape reuse one graph. Shapes start static; a shape that changes
    is recompiled once as dynamic (torch.compile's default)."""
    return torch.compile(function)


def decoder_layers(model: nn.Module) -> list[ZayaDecoderLayer]:
    return [module for module in model.modules() if isinstance(module, ZayaDecoderLayer)]


def enable_compiled_layers(model: nn.Module, enabled: bool = True) -> None:
    """Run each decoder layer of `model` through `compiled_layer_forward` (or, with `enabled=False`, the reference
    forward again). On CPU a missing C++ compiler raises here, before anything runs."""
    layers = decoder_layers(model)
    if enabled:
        if any(parameter.device.type == "cpu" for parameter in model.parameters()):
            require_cpp_compiler()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_GRAPHS_LIMIT)
    for layer in layers:
        if enabled:
            layer.__dict__["forward"] = types.MethodType(compiled_layer_forward, layer)
        else:
            layer.__dict__.pop("forward", None)


def compiled_layers_enabled(model: nn.Module) -> bool:
    """Whether `enable_compiled_layers` is in effect on every decoder layer of `model`."""
    layers = decoder_layers(model)
    return bool(layers) and all("forward" in layer.__dict__ for layer in layers)


def gathers_experts(block: ZayaSparseMoeBlock, hidden_states: torch.Tensor) -> bool:
    """Whether the compiled path computes these tokens' experts by gathering: at inference on CPU, for up to
    `GATHERED_EXPERTS_MAX_TOKENS` tokens (a prompt's prefill), and without adapters."""
    return (
        not torch.is_grad_enabled()
        and hidden_states.device.type == "cpu"
        and hidden_states.shape[:-1].numel() <= GATHERED_EXPERTS_MAX_TOKENS
        and not has_adapters(block.experts)  # PEFT's expert LoRA wraps the module or parametrizes its weights
    )


def compiled_layer_forward(
    layer: ZayaDecoderLayer,
    residual: torch.Tensor,
    router_states: torch.Tensor | None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    lag_masks: torch.Tensor | None,
    past_key_values: ZayaCache | None = None,
    padding_mask: torch.Tensor | None = None,
    **kwargs,
):
    """`ZayaDecoderLayer.forward` with the block's parts compiled where the chunk starts its sequences."""
    continuing = past_key_values is not None and past_key_values.cca_state(layer.layer_idx) is not None
    if continuing or kwargs:
        return type(layer).forward(
            layer, residual, router_states, position_embeddings, attention_mask, lag_masks, past_key_values,
            padding_mask, **kwargs,
        )  # fmt: skip
    routed, state = compiled_function(attention_and_routing)(
        layer, residual, router_states, position_embeddings, attention_mask, lag_masks, padding_mask
    )
    if past_key_values is not None:
        layer.self_attn.cache_state(past_key_values, *state)
    residual, moe_input, router_logits, choice, weight, router_states = routed
    if gathers_experts(layer.mlp, moe_input):
        residual = compiled_function(gathered_experts_and_merge)(layer, moe_input, choice, weight, residual)
    else:
        moe_out = layer.mlp.expert_outputs(moe_input, choice, weight)
        residual = compiled_function(merge_experts)(layer, moe_out, residual)
    return residual, router_states, router_logits, choice


def attention_and_routing(
    layer: ZayaDecoderLayer,
    residual: torch.Tensor,
    router_states: torch.Tensor | None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    lag_masks: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
):
    """A block's first part for a chunk that starts its sequences: `(residual, moe_input, router logits, choice,
    weight, router_states)` and the attention's cache state."""
    hidden_states = layer.input_layernorm(residual.to(layer.input_layernorm.weight.dtype))
    attn_out, state = layer.self_attn.attend_chunk(
        hidden_states, position_embeddings, attention_mask, lag_masks, padding_mask
    )
    return layer.route(attn_out, residual, router_states), state


def merge_experts(layer: ZayaDecoderLayer, moe_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A block's last part: merge the MoE output into the residual."""
    return layer.post_mlp_residual_scale(moe_out, residual)


def gathered_experts_and_merge(
    layer: ZayaDecoderLayer, moe_input: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """A block's last two parts in one compiled graph where `gathers_experts`."""
    experts = functools.partial(gathered_products, layer.mlp.experts)
    return merge_experts(layer, layer.mlp.expert_outputs(moe_input, choice, weight, experts), residual)


__all__ = [
    "COMPILED_GRAPHS_LIMIT",
    "GATHERED_EXPERTS_MAX_TOKENS",
    "compiled_layers_enabled",
    "enable_compiled_layers",
    "require_cpp_compiler",
]
