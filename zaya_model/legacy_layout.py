"""Zyphra's legacy ZAYA1-base checkpoint layout <-> the upstream `transformers` `zaya` layout.

ZAYA1-base was released in Zyphra's Megatron-style layout: `config.json` describes 80 alternating sub-layers with
per-layer lists (`zaya_layers`, `cca_num_q_heads`, ...), and the weights are named per sub-layer
(`model.layers.{2i}.self_attn.qkv.*` for attention, `model.layers.{2i+1}.zaya_block.*` for MoE, one expert per tensor).
The upstream layout (and ours) has 40 combined blocks, each an attention half and an MoE half, with the experts fused
into 3-D tensors. Both describe the same function; this module converts configs and state dicts between them, and
reads/writes legacy checkpoint directories.

Residual scaling is where the layouts differ most. Legacy sub-layer `l` starts by merging the previous sub-layer's
output into the residual with its own `res_scale` module (81 modules, the last one `model.res_scale`). In the block
layout the same merges happen after each half:

    legacy `model.layers.0.res_scale.hidden_states_*`   <-> `model.input_hidden_states_*`
    legacy `model.layers.{2i+1}.res_scale.*`            <-> `model.layers.{i}.post_attention_residual_scale.*`
    legacy `model.layers.{2i+2}.res_scale.*`            <-> `model.layers.{i}.post_mlp_residual_scale.*`
    legacy `model.res_scale.*`                          <-> `model.layers.{last}.post_mlp_residual_scale.*`

All conversions are pure renames, stacks and unbinds: no tensor value or dtype changes, so round trips are bit-exact.

Our models load the upstream layout only (a legacy config is refused, naming the command). Convert a legacy
checkpoint directory once, as a command:

    python -m zaya_model.legacy_layout LEGACY_DIR OUTPUT_DIR

which writes `OUTPUT_DIR` atomically: `config.json`, the weights as safetensors, and every other file of `LEGACY_DIR`
(tokenizer, generation config) copied along.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .configuration_zaya import LEGACY_LAYERS_FIELD, ZayaConfig
from .training.atomic_io import atomic_directory

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

ATTENTION_LAYER = "a"
# What Zyphra's original code did, and so what a legacy checkpoint means when its config says nothing.
LEGACY_SKIP_EXPERT_MODE = "scaled_input"
LEGACY_ROUTER_RMS_NORM_EPS = 1e-6  # ZT-nov reads a `layernorm_epsilon` field the configs never set, falling back here
UPSTREAM_SKIP_EXPERT_MODE = "zero"
SKIP_EXPERT_MODES = ("zero", "scaled_input")

RESIDUAL_SCALE_FIELDS = ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")
INPUT_SCALE_FIELDS = ("hidden_states_scale", "hidden_states_bias")

# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------

# Legacy switches for parts of the architecture that the upstream layout always has (or never has). Each maps to
# (the only supported value, the value assumed when the field is absent).
_LEGACY_FIXED_VALUES: dict[str, tuple[Any, Any]] = {
    "cca": (True, True),
    "zaya_use_mod": (True, True),
    "zaya_use_eda": (True, True),
    "scale_residual_merge": (True, True),
    "gated_linear_unit": (True, True),
    "activation_func": ("swiglu", "swiglu"),
    "add_bias_linear": (False, False),
    "normalization": ("RMSNorm", "RMSNorm"),
    "clamp_temp": (False, False),
    "moe_router_topk": (1, 1),
    "num_experts_per_tok": (1, 1),
}

# Legacy fields that pick Megatron kernels or reduced-precision paths; they do not change the function computed.
_LEGACY_IMPLEMENTATION_FIELDS = (
    "zaya_high_prec",
    "bias_activation_fusion",
    "fused_add_norm",
    "apply_rope_fusion",
    "activation_func_fp8_input_store",
    "mamba_cache_dtype",
)


@dataclass(frozen=True)
class _PerSubLayerField:
    """An upstream field that a legacy config lists per sub-layer: `factor` times the value on the attention (or the
    MoE) sub-layers, 0 on the others."""

    upstream: str
    legacy: tuple[str, ...]  # the legacy fields that may hold it, the first present read; the first one is written
    moe: bool  # held on the MoE sub-layers, else on the attention ones
    factor: int = 1


_PER_SUB_LAYER_FIELDS = (
    _PerSubLayerField("num_attention_heads", ("cca_num_q_heads", "num_attention_heads"), moe=False),
    _PerSubLayerField(
        "num_key_value_heads", ("num_query_groups_list", "num_query_groups", "num_key_value_heads"), moe=False
    ),
    # The legacy fc1 width holds the experts' gate and up projections together.
    _PerSubLayerField("moe_intermediate_size", ("ffn_hidden_size_list", "ffn_hidden_size"), moe=True, factor=2),
    _PerSubLayerField("router_hidden_size", ("zaya_mlp_expansion",), moe=True),
)

# Fields both layouts name alike, with the value either layout assumes when the field is absent.
_SHARED_FIELD_DEFAULTS = {"cca_time0": 2, "cca_time1": 2, "tie_word_embeddings": True}

# Legacy fields read (or checked) by `legacy_config_to_upstream`; everything else is carried over unchanged.
_LEGACY_CONSUMED_FIELDS = {
    *_LEGACY_FIXED_VALUES,
    *_LEGACY_IMPLEMENTATION_FIELDS,
    *(name for field in _PER_SUB_LAYER_FIELDS for name in field.legacy),
    *_SHARED_FIELD_DEFAULTS,
    "zaya_layers",
    "num_hidden_layers",
    "num_experts",
    "kv_channels",
    "head_dim",
    "norm_epsilon",
    "rms_norm_eps",
    "layernorm_epsilon",
    "rope_theta",
    "rotary_base",
    "partial_rotary_factor",
    "rope_scaling",
    "swa_layers",
    "swa_rotary_base",
    "skip_expert_mode",
    "residual_in_fp32",
    "model_type",
    "architectures",
}

# Upstream fields read by `upstream_config_to_legacy`; everything else is carried over unchanged.
_UPSTREAM_CONSUMED_FIELDS = {
    *(field.upstream for field in _PER_SUB_LAYER_FIELDS),
    *_SHARED_FIELD_DEFAULTS,
    "num_hidden_layers",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "num_experts",
    "num_experts_per_tok",
    "rope_parameters",
    "layer_types",
    "sliding_window",
    "skip_expert_mode",
    "router_rms_norm_eps",
    "residual_in_fp32",
    "model_type",
    "architectures",
}

# The fixed legacy switches a legacy config is written with (`num_experts_per_tok` is the upstream layout's own).
_LEGACY_WRITTEN_FIXED_VALUES = {
    field: supported for field, (supported, _) in _LEGACY_FIXED_VALUES.items() if field not in _UPSTREAM_CONSUMED_FIELDS
}


def is_legacy_config(config_dict: Mapping[str, Any]) -> bool:
    """True for Zyphra's per-sub-layer config (it lists the sub-layers in `zaya_layers`)."""
    return LEGACY_LAYERS_FIELD in config_dict


def _legacy_block_plan(zaya_layers: Any) -> tuple[int, int]:
    """Checks that `zaya_layers` is `["a", E] * N` and returns `(N, E)`."""
    if not isinstance(zaya_layers, list) or not zaya_layers or len(zaya_layers) % 2:
        raise ValueError(
            "zaya_layers: expected a non-empty list of sub-layers alternating attention ('a') and MoE (expert count), "
            f"got {zaya_layers!r:.200}"
        )
    for index, kind in enumerate(zaya_layers):
        if index % 2 == 0:
            ok, wanted = kind == ATTENTION_LAYER, "'a' (attention)"
        else:
            ok = isinstance(kind, int) and not isinstance(kind, bool) and kind > 0
            wanted = "an expert count (MoE)"
        if not ok:
            raise ValueError(
                f"zaya_layers: entry {index} is {kind!r}, expected {wanted}; only sub-layers strictly alternating "
                "attention and MoE, starting with attention, can be converted"
            )
    expert_counts = sorted(set(zaya_layers[1::2]))
    if len(expert_counts) != 1:
        raise ValueError(f"zaya_layers: MoE layers have differing expert counts {expert_counts}; one is supported")
    return len(zaya_layers) // 2, expert_counts[0]


def _one_value(config: Mapping[str, Any], field: str, sub_layers: range, num_sub_layers: int) -> Any:
    """A per-sub-layer list field's single value on `sub_layers` (a scalar field is returned as is)."""
    value = config[field]
    if not isinstance(value, list):
        return value
    if len(value) != num_sub_layers:
        raise ValueError(f"{field}: has {len(value)} entries but zaya_layers has {num_sub_layers}")
    distinct = sorted({value[index] for index in sub_layers})
    if len(distinct) != 1:
        raise ValueError(f"{field}: differs between layers ({distinct}); one value for all layers is supported")
    return distinct[0]


def _first_present(config: Mapping[str, Any], fields: tuple[str, ...]) -> str:
    for field in fields:
        if config.get(field) is not None:
            return field
    raise ValueError(f"legacy config has none of {', '.join(fields)}")


def legacy_config_to_upstream(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Zyphra's per-sub-layer config -> the upstream `zaya` config fields (plus our three extra fields).

    Raises `ValueError` naming the field when the legacy config describes something the block layout cannot hold:
    sub-layers not strictly alternating attention/MoE, differing expert counts or head counts between layers,
    top-k other than 1, no skip class or no EDA, rope scaling, sliding-window layers, ...
    Fields this function does not know are carried over unchanged.
    """
    legacy = dict(config_dict)
    if not is_legacy_config(legacy):
        raise ValueError("not a legacy ZAYA config: it has no zaya_layers")
    num_blocks, num_experts = _legacy_block_plan(legacy["zaya_layers"])
    _check_legacy_architecture(legacy, num_experts)
    upstream = {key: value for key, value in legacy.items() if key not in _LEGACY_CONSUMED_FIELDS}
    upstream.update(
        model_type="zaya",
        architectures=["ZayaForCausalLM"],
        num_hidden_layers=num_blocks,
        **_legacy_per_sub_layer_values(legacy, num_blocks),
        head_dim=_legacy_head_dim(legacy),
        hidden_act="silu",
        rms_norm_eps=legacy.get("norm_epsilon", legacy.get("rms_norm_eps", 1e-5)),
        num_experts=num_experts,
        num_experts_per_tok=1,
        rope_parameters={
            "hybrid": {
                "rope_type": "default",
                "rope_theta": legacy[_first_present(legacy, ("rope_theta", "rotary_base"))],
                "partial_rotary_factor": legacy.get("partial_rotary_factor", 0.5),
            }
        },
        layer_types=["hybrid"] * num_blocks,
        sliding_window=None,
        **{field: legacy.get(field, default) for field, default in _SHARED_FIELD_DEFAULTS.items()},
        skip_expert_mode=_legacy_skip_expert_mode(legacy),
        router_rms_norm_eps=legacy.get("layernorm_epsilon", LEGACY_ROUTER_RMS_NORM_EPS),
        residual_in_fp32=bool(legacy.get("residual_in_fp32", False)),
    )
    return upstream


def _check_legacy_architecture(legacy: Mapping[str, Any], num_experts: int) -> None:
    """Refuses legacy switches and fields for an architecture other than the block layout's."""
    for field, (supported, default) in _LEGACY_FIXED_VALUES.items():
        if legacy.get(field, default) != supported:
            raise ValueError(f"{field}={legacy[field]!r} is not supported (ZAYA1 uses {supported!r})")
    if legacy.get("num_experts") not in (None, num_experts):
        raise ValueError(f"num_experts={legacy['num_experts']} disagrees with zaya_layers ({num_experts} experts)")
    if legacy.get("rope_scaling") not in (None, False):
        raise ValueError(f"rope_scaling={legacy['rope_scaling']!r} is not supported (ZAYA1-base uses none)")
    if any(legacy.get("swa_layers") or []):
        raise ValueError("swa_layers: sliding-window attention layers are not supported")


def _legacy_per_sub_layer_values(legacy: Mapping[str, Any], num_blocks: int) -> dict[str, Any]:
    """The upstream fields of `_PER_SUB_LAYER_FIELDS`, each the one value its legacy list holds for every block."""
    num_sub_layers = 2 * num_blocks
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for field in _PER_SUB_LAYER_FIELDS:
        source = sources[field.upstream] = _first_present(legacy, field.legacy)
        sub_layers = range(1 if field.moe else 0, num_sub_layers, 2)
        value = _one_value(legacy, source, sub_layers, num_sub_layers)
        if field.factor != 1:
            if value % field.factor:
                raise ValueError(
                    f"{source}: {value} is not a multiple of {field.factor} ({field.upstream} x {field.factor})"
                )
            value //= field.factor
        values[field.upstream] = value
    num_kv_heads = values["num_key_value_heads"]
    if legacy.get("num_key_value_heads") not in (None, num_kv_heads):
        raise ValueError(
            f"num_key_value_heads={legacy['num_key_value_heads']} disagrees with {sources['num_key_value_heads']} "
            f"({num_kv_heads})"
        )
    return values


def _legacy_head_dim(legacy: Mapping[str, Any]) -> Any:
    if legacy.get("kv_channels") is not None:
        return legacy["kv_channels"]
    if legacy.get("head_dim") is not None:
        return legacy["head_dim"]
    # Zyphra's code derives it from the nominal (uncompressed) head count.
    return legacy["hidden_size"] // legacy["num_attention_heads"]


def _legacy_skip_expert_mode(legacy: Mapping[str, Any]) -> str:
    skip_expert_mode = legacy.get("skip_expert_mode", LEGACY_SKIP_EXPERT_MODE)
    if skip_expert_mode not in SKIP_EXPERT_MODES:
        raise ValueError(f"skip_expert_mode={skip_expert_mode!r} is not one of {SKIP_EXPERT_MODES}")
    return skip_expert_mode


def upstream_config_to_legacy(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The upstream `zaya` config fields -> Zyphra's per-sub-layer config (the inverse of `legacy_config_to_upstream`).

    Behaviour the legacy fields cannot say is written as extra fields that Zyphra's code ignores and
    `legacy_config_to_upstream` reads back: `skip_expert_mode` when it is not ZAYA1-base's `"scaled_input"` and
    `layernorm_epsilon` (the router's RMSNorm epsilon) when it is not ZAYA1-base's 1e-6. A config without our extra
    fields (stock `transformers`) means upstream behaviour: skip outputs zero, router eps = `rms_norm_eps`, and an
    fp32 residual stream.
    """
    upstream = dict(config_dict)
    num_blocks = upstream["num_hidden_layers"]
    rope = _check_upstream_writable(upstream, num_blocks)
    rms_norm_eps = upstream["rms_norm_eps"]
    legacy = {key: value for key, value in upstream.items() if key not in _UPSTREAM_CONSUMED_FIELDS}
    legacy.update(
        model_type="zaya",
        architectures=["ZayaForCausalLM"],
        num_hidden_layers=2 * num_blocks,
        zaya_layers=[ATTENTION_LAYER, upstream["num_experts"]] * num_blocks,
        **_upstream_per_sub_layer_lists(upstream, num_blocks),
        num_attention_heads=upstream["hidden_size"] // upstream["head_dim"],  # nominal: only used to derive head_dim
        num_key_value_heads=upstream["num_key_value_heads"],
        kv_channels=upstream["head_dim"],
        **_LEGACY_WRITTEN_FIXED_VALUES,
        zaya_high_prec=True,
        residual_in_fp32=bool(upstream.get("residual_in_fp32", True)),
        norm_epsilon=rms_norm_eps,
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
        rope_scaling=False,
        **{field: upstream.get(field, default) for field, default in _SHARED_FIELD_DEFAULTS.items()},
    )
    skip_expert_mode = upstream.get("skip_expert_mode", UPSTREAM_SKIP_EXPERT_MODE)
    if skip_expert_mode != LEGACY_SKIP_EXPERT_MODE:
        legacy["skip_expert_mode"] = skip_expert_mode
    router_eps = upstream.get("router_rms_norm_eps")
    router_eps = rms_norm_eps if router_eps is None else router_eps
    if router_eps != LEGACY_ROUTER_RMS_NORM_EPS:
        legacy["layernorm_epsilon"] = router_eps
    return legacy


def _check_upstream_writable(upstream: Mapping[str, Any], num_blocks: int) -> Mapping[str, Any]:
    """Refuses an upstream config the legacy fields cannot describe; returns its rope parameters."""
    layer_types = upstream.get("layer_types") or ["hybrid"] * num_blocks
    if list(layer_types) != ["hybrid"] * num_blocks:
        raise ValueError(f"layer_types={layer_types!r}: only full-attention 'hybrid' layers can be written as legacy")
    if upstream.get("num_experts_per_tok", 1) != 1:
        raise ValueError(f"num_experts_per_tok={upstream['num_experts_per_tok']} is not supported (must be 1)")
    if upstream.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={upstream['hidden_act']!r} is not supported (legacy experts are SwiGLU)")
    rope_parameters = upstream.get("rope_parameters")
    if not rope_parameters:
        raise ValueError("rope_parameters: missing; the legacy config needs rope_theta")
    rope = rope_parameters.get("hybrid", rope_parameters)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters: rope_type {rope['rope_type']!r} cannot be written as legacy")
    hidden_size, head_dim = upstream["hidden_size"], upstream["head_dim"]
    if hidden_size % head_dim:
        raise ValueError(
            f"head_dim={head_dim} must divide hidden_size={hidden_size}: legacy configs derive head_dim "
            "from a nominal head count"
        )
    return rope


def _upstream_per_sub_layer_lists(upstream: Mapping[str, Any], num_blocks: int) -> dict[str, list[Any]]:
    """The legacy lists of `_PER_SUB_LAYER_FIELDS`: each block's value on its attention or MoE sub-layer, 0 on the
    other."""
    lists = {}
    for field in _PER_SUB_LAYER_FIELDS:
        value = upstream[field.upstream] * field.factor
        lists[field.legacy[0]] = ([0, value] if field.moe else [value, 0]) * num_blocks
    return lists


# ---------------------------------------------------------------------------------------------------------------------
# State dict
# ---------------------------------------------------------------------------------------------------------------------

# Per-block tensors of the attention half: legacy name (after `model.layers.{2i}.`) -> upstream name (after
# `model.layers.{i}.`). The projections' biases exist only with `attention_bias`.
_ATTENTION_TENSORS = {
    "input_norm.weight": "input_layernorm.weight",
    "self_attn.qkv.linear_q.weight": "self_attn.qkv_proj.q_proj.weight",
    "self_attn.qkv.linear_k.weight": "self_attn.qkv_proj.k_proj.weight",
    "self_attn.qkv.val_proj1.weight": "self_attn.qkv_proj.v_proj_current.weight",
    "self_attn.qkv.val_proj2.weight": "self_attn.qkv_proj.v_proj_delayed.weight",
    "self_attn.qkv.conv_qk.0.weight": "self_attn.qkv_proj.conv_qk_depthwise.weight",
    "self_attn.qkv.conv_qk.0.bias": "self_attn.qkv_proj.conv_qk_depthwise.bias",
    "self_attn.qkv.conv_qk.1.weight": "self_attn.qkv_proj.conv_qk_grouped.weight",
    "self_attn.qkv.conv_qk.1.bias": "self_attn.qkv_proj.conv_qk_grouped.bias",
    "self_attn.qkv.temp": "self_attn.qk_norm.temp",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
}
_OPTIONAL_ATTENTION_TENSORS = {
    "self_attn.qkv.linear_q.bias": "self_attn.qkv_proj.q_proj.bias",
    "self_attn.qkv.linear_k.bias": "self_attn.qkv_proj.k_proj.bias",
    "self_attn.qkv.val_proj1.bias": "self_attn.qkv_proj.v_proj_current.bias",
    "self_attn.qkv.val_proj2.bias": "self_attn.qkv_proj.v_proj_delayed.bias",
    "self_attn.o_proj.bias": "self_attn.o_proj.bias",
}
# Per-block tensors of the MoE half (legacy after `model.layers.{2i+1}.`), experts aside.
_MOE_TENSORS = {
    "input_norm.weight": "post_attention_layernorm.weight",
    "zaya_block.router.down_proj.weight": "mlp.gate.down_proj.weight",
    "zaya_block.router.down_proj.bias": "mlp.gate.down_proj.bias",
    "zaya_block.router.rmsnorm_eda.weight": "mlp.gate.router_mlp.norm.weight",
    "zaya_block.router.router_mlp.0.weight": "mlp.gate.router_mlp.fc1.weight",
    "zaya_block.router.router_mlp.0.bias": "mlp.gate.router_mlp.fc1.bias",
    "zaya_block.router.router_mlp.2.weight": "mlp.gate.router_mlp.fc2.weight",
    "zaya_block.router.router_mlp.2.bias": "mlp.gate.router_mlp.fc2.bias",
    "zaya_block.router.router_mlp.4.weight": "mlp.gate.router_mlp.out_proj.weight",
    "zaya_block.router.balancing_biases": "mlp.gate.balancing_biases",
}
# The first MoE layer has no previous router state to average with, hence no EDA scale.
_EDA_TENSOR = ("zaya_block.router.router_states_scale", "mlp.gate.router_states_scale")
# The untied output head (absent when tied to the embedding) and its optional bias keep their names.
_OPTIONAL_TOP_LEVEL_TENSORS = ("lm_head.weight", "lm_head.bias")

_LEGACY_EXPERT_NAME = re.compile(
    r"model\.layers\.(?P<sub_layer>\d+)\.zaya_block\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc(?P<fc>[12])"
    r"\.weight"
)
# Legacy fc1 is [2I, H] (gate rows then up rows) and fc2 is [H, I], exactly one slice of the fused upstream tensors.
_EXPERT_PROJECTIONS = {"1": "gate_up_proj", "2": "down_proj"}


def _legacy_expert_name(block: int, expert: int, fc: str) -> str:
    return f"model.layers.{2 * block + 1}.zaya_block.experts.local_experts.{expert}.linear_fc{fc}.weight"


def _renamed_tensors(num_blocks: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(legacy, upstream) name pairs of every tensor but the experts: (required pairs, optional pairs)."""
    required = [
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.final_norm.weight", "model.norm.weight"),
    ]
    required += [(f"model.layers.0.res_scale.{f}", f"model.input_{f}") for f in INPUT_SCALE_FIELDS]
    last = num_blocks - 1
    required += [
        (f"model.res_scale.{f}", f"model.layers.{last}.post_mlp_residual_scale.{f}") for f in RESIDUAL_SCALE_FIELDS
    ]
    optional = [(name, name) for name in _OPTIONAL_TOP_LEVEL_TENSORS]
    for block in range(num_blocks):
        attention, moe = f"model.layers.{2 * block}.", f"model.layers.{2 * block + 1}."
        upstream = f"model.layers.{block}."
        required += [(attention + old, upstream + new) for old, new in _ATTENTION_TENSORS.items()]
        optional += [(attention + old, upstream + new) for old, new in _OPTIONAL_ATTENTION_TENSORS.items()]
        required += [(moe + old, upstream + new) for old, new in _MOE_TENSORS.items()]
        if block > 0:
            required.append((moe + _EDA_TENSOR[0], upstream + _EDA_TENSOR[1]))
            # Sub-layer 2i's residual merge takes the previous block's MoE output.
            required += [
                (f"{attention}res_scale.{f}", f"model.layers.{block - 1}.post_mlp_residual_scale.{f}")
                for f in RESIDUAL_SCALE_FIELDS
            ]
        required += [
            (f"{moe}res_scale.{f}", f"{upstream}post_attention_residual_scale.{f}") for f in RESIDUAL_SCALE_FIELDS
        ]
    return required, optional


def _names_preview(names: set[str], limit: int = 20) -> str:
    ordered = sorted(names)
    more = f" ... and {len(ordered) - limit} more" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more


def _check_names(layout: str, present: set[str], required: set[str], optional: set[str]) -> None:
    missing = required - present
    unexpected = present - required - optional
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {_names_preview(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} tensor(s): {_names_preview(unexpected)}")
        raise ValueError(f"{layout} state dict does not match the ZAYA layout: " + "; ".join(problems))


def _check_num_blocks(num_blocks: int) -> None:
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")


def _legacy_experts(state_dict: Mapping[str, torch.Tensor], num_blocks: int) -> dict[tuple[int, str], dict[int, str]]:
    """Groups legacy expert tensor names by (block, upstream projection), keyed by expert index."""
    groups: dict[tuple[int, str], dict[int, str]] = {
        (block, projection): {} for block in range(num_blocks) for projection in _EXPERT_PROJECTIONS.values()
    }
    for name in state_dict:
        match = _LEGACY_EXPERT_NAME.fullmatch(name)
        if match is None:
            continue
        sub_layer = int(match["sub_layer"])
        if sub_layer % 2 == 0 or sub_layer >= 2 * num_blocks:
            continue  # left over as unexpected by the name check
        groups[(sub_layer // 2, _EXPERT_PROJECTIONS[match["fc"]])][int(match["expert"])] = name
    return groups


def legacy_state_dict_to_upstream(state_dict: Mapping[str, torch.Tensor], num_blocks: int) -> dict[str, torch.Tensor]:
    """Legacy 2*`num_blocks` sub-layer tensors -> upstream `num_blocks` block tensors.

    Every tensor must be accounted for: unknown or missing names raise `ValueError` listing them. Per-expert
    `linear_fc1`/`linear_fc2` weights are stacked into `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I].
    """
    _check_num_blocks(num_blocks)
    required, optional = _renamed_tensors(num_blocks)
    expert_groups = _legacy_experts(state_dict, num_blocks)
    # Every MoE layer must hold experts 0..E-1 for both projections, E taken from the first layer's fc1.
    num_experts = max(expert_groups[(0, "gate_up_proj")], default=-1) + 1
    if num_experts == 0:
        raise ValueError("legacy state dict has no expert weights in model.layers.1.zaya_block.experts")
    required_experts = {
        _legacy_expert_name(block, expert, fc)
        for block in range(num_blocks)
        for expert in range(num_experts)
        for fc in _EXPERT_PROJECTIONS
    }
    _check_names(
        "legacy", set(state_dict), {old for old, _ in required} | required_experts, {old for old, _ in optional}
    )

    upstream = {new: state_dict[old] for old, new in [*required, *optional] if old in state_dict}
    for (block, projection), by_expert in expert_groups.items():
        per_expert = [state_dict[by_expert[expert]] for expert in range(num_experts)]
        if len({(tensor.shape, tensor.dtype) for tensor in per_expert}) != 1:
            raise ValueError(f"model.layers.{2 * block + 1}: experts' {projection} tensors differ in shape or dtype")
        upstream[f"model.layers.{block}.mlp.experts.{projection}"] = torch.stack(per_expert)
    return upstream


def upstream_state_dict_to_legacy(state_dict: Mapping[str, torch.Tensor], num_blocks: int) -> dict[str, torch.Tensor]:
    """Upstream `num_blocks` block tensors -> legacy 2*`num_blocks` sub-layer tensors.

    The inverse of `legacy_state_dict_to_upstream`. Expert tensors come back as views of the fused tensors (no copy);
    `save_legacy_checkpoint` copies them shard by shard.
    """
    _check_num_blocks(num_blocks)
    required, optional = _renamed_tensors(num_blocks)
    fused = [
        f"model.layers.{block}.mlp.experts.{projection}"
        for block in range(num_blocks)
        for projection in _EXPERT_PROJECTIONS.values()
    ]
    _check_names("upstream", set(state_dict), {new for _, new in required} | set(fused), {new for _, new in optional})

    legacy = {old: state_dict[new] for old, new in [*required, *optional] if new in state_dict}
    for block in range(num_blocks):
        for fc, projection in _EXPERT_PROJECTIONS.items():
            name = f"model.layers.{block}.mlp.experts.{projection}"
            if state_dict[name].dim() != 3:
                raise ValueError(
                    f"{name}: expected a 3-D [experts, out, in] tensor, got shape {tuple(state_dict[name].shape)}"
                )
            for expert, weight in enumerate(state_dict[name].unbind(0)):
                legacy[_legacy_expert_name(block, expert, fc)] = weight
    return legacy


# ---------------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------------


class _SafetensorsFiles(Mapping[str, torch.Tensor]):
    """The tensors of some safetensors files, each read from disk when asked for.

    Converting through this instead of a loaded dict keeps peak memory near one copy of the model: each legacy
    tensor is read once, and the per-expert tensors of one layer are dropped as soon as they are stacked.
    """

    def __init__(self, file_of: dict[str, Path]):
        self._file_of = file_of

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self._file_of[name], framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def _open_safetensors(directory: Path) -> _SafetensorsFiles:
    """`model.safetensors`, or the shards listed by `model.safetensors.index.json`, as one name -> tensor mapping."""
    index_path = directory / SAFE_WEIGHTS_INDEX_NAME
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = sorted({directory / shard for shard in weight_map.values()})
    elif (directory / SAFE_WEIGHTS_NAME).is_file():
        weight_map, files = {}, [directory / SAFE_WEIGHTS_NAME]
    else:
        raise FileNotFoundError(f"{directory} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}")
    file_of: dict[str, Path] = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            names = handle.keys()
        for name in names:
            if name in file_of:
                raise ValueError(f"{directory}: tensor {name} is stored in more than one shard")
            file_of[name] = path
    if weight_map and weight_map.keys() != file_of.keys():
        unlisted = set(weight_map) ^ set(file_of)
        raise ValueError(f"{index_path} and its shards disagree on tensors: {_names_preview(unlisted)}")
    return _SafetensorsFiles(file_of)


def load_legacy_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Reads a legacy ZAYA checkpoint directory as `(upstream config dict, upstream state dict)`.

    A tied output head is not in the file and not in the returned state dict (the model ties it on load).
    """
    directory = Path(path)
    legacy_config = json.loads((directory / CONFIG_NAME).read_text())
    if not is_legacy_config(legacy_config):
        raise ValueError(f"{directory / CONFIG_NAME} is not a legacy ZAYA config (it has no zaya_layers)")
    config = legacy_config_to_upstream(legacy_config)
    state_dict = legacy_state_dict_to_upstream(_open_safetensors(directory), config["num_hidden_layers"])
    num_experts = state_dict["model.layers.0.mlp.experts.gate_up_proj"].shape[0]
    if num_experts != config["num_experts"]:
        raise ValueError(
            f"{directory}: the weights hold {num_experts} experts per layer, config.json says {config['num_experts']}"
        )
    return config, state_dict


def _shard_files(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[tuple[str, list[str]]]:
    """Splits tensor names, in order, into shard files of at most `max_shard_bytes` (a larger tensor gets its own).

    One shard is named `model.safetensors`; several are `model-0000k-of-0000n.safetensors`, as `save_pretrained` does.
    """
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        return [(SAFE_WEIGHTS_NAME, shards[0])]
    return [(f"model-{k:05d}-of-{len(shards):05d}.safetensors", names) for k, names in enumerate(shards, start=1)]


def save_legacy_checkpoint(
    config_dict: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Writes an upstream-layout config and state dict as a legacy ZAYA checkpoint directory, atomically.

    Everything is written to a temporary directory beside `out_dir`, synced, then renamed into place, so `out_dir`
    never holds a partial checkpoint. An existing non-empty `out_dir` is an error unless `overwrite`.
    A tied `lm_head.weight` is left out (as `save_pretrained` does); weights larger than `max_shard_bytes` are split
    into shards with a `model.safetensors.index.json`.
    """
    out_dir = Path(out_dir)
    _check_writable(out_dir, overwrite)
    legacy_config = upstream_config_to_legacy(config_dict)
    tensors = dict(state_dict)
    if legacy_config["tie_word_embeddings"] and "lm_head.weight" in tensors:
        if not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ValueError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")
        del tensors["lm_head.weight"]
    legacy = upstream_state_dict_to_legacy(tensors, config_dict["num_hidden_layers"])
    config_json = json.dumps(legacy_config, indent=2) + "\n"
    return _write_checkpoint(config_json, legacy, out_dir, max_shard_bytes=max_shard_bytes)


def convert_legacy_checkpoint(
    legacy_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Writes the legacy checkpoint directory `legacy_dir` in the upstream `zaya` layout (what `from_pretrained`,
    stock transformers and the vLLM plugin read) as `out_dir`, atomically, as `save_legacy_checkpoint` writes.

    Tensors keep their values and dtypes; the other files of `legacy_dir` (tokenizer, generation config, ...) are
    copied along, so `out_dir` is a complete checkpoint. A non-empty `out_dir` is an error unless `overwrite`.
    """
    legacy_dir, out_dir = Path(legacy_dir), Path(out_dir)
    _check_writable(out_dir, overwrite)
    if out_dir.resolve() == legacy_dir.resolve():
        raise ValueError(f"{out_dir}: the converted checkpoint needs a directory of its own")
    config_dict, state_dict = load_legacy_checkpoint(legacy_dir)
    config_json = ZayaConfig(**config_dict).to_json_string()  # checked as the model will read it
    extra_files = [path for path in sorted(legacy_dir.iterdir()) if not _is_checkpoint_file(path.name)]
    return _write_checkpoint(config_json, state_dict, out_dir, max_shard_bytes=max_shard_bytes, copied=extra_files)


def _is_checkpoint_file(name: str) -> bool:
    """The config and weight files a conversion writes anew (everything else of a checkpoint is copied)."""
    return name in (CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME) or name.endswith(".safetensors")


def _check_writable(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty")


def _write_checkpoint(
    config_json: str,
    tensors: Mapping[str, torch.Tensor],
    out_dir: Path,
    *,
    max_shard_bytes: int,
    copied: Sequence[Path] = (),
) -> Path:
    """`config.json`, the tensors as (sharded) safetensors and copies of `copied`, published atomically as `out_dir`
    (an existing `out_dir` is replaced)."""
    with atomic_directory(out_dir) as staging:
        (staging / CONFIG_NAME).write_text(config_json)
        weight_map: dict[str, str] = {}
        total_bytes = 0
        for file_name, names in _shard_files(tensors, max_shard_bytes):
            # Copies: expert slices are views of one fused tensor, and safetensors refuses tensors sharing memory.
            shard = {name: tensors[name].detach().clone().contiguous() for name in names}
            save_file(shard, staging / file_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file_name))
            total_bytes += sum(t.numel() * t.element_size() for t in shard.values())
        if len(set(weight_map.values())) > 1:
            index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        for source in copied:
            if source.is_dir():
                shutil.copytree(source, staging / source.name)
            else:
                shutil.copy2(source, staging / source.name)
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zaya_model.legacy_layout",
        description="Convert a checkpoint directory of Zyphra's legacy ZAYA1-base layout into the upstream `zaya` "
        "layout that ZayaForCausalLM.from_pretrained, stock transformers and the vLLM plugin load. Other files "
        "(tokenizer, generation config) are copied along; the output is written atomically.",
    )
    parser.add_argument("legacy_dir", type=Path, help="the legacy checkpoint (config.json with zaya_layers)")
    parser.add_argument("out_dir", type=Path, help="where to write the converted checkpoint (new or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    parser.add_argument(
        "--max-shard-gib", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1024**3, help="largest weight file (GiB)"
    )
    args = parser.parse_args(argv)
    if not args.max_shard_gib > 0:
        parser.error("--max-shard-gib must be positive")
    try:
        out_dir = convert_legacy_checkpoint(
            args.legacy_dir, args.out_dir, max_shard_bytes=int(args.max_shard_gib * 1024**3), overwrite=args.overwrite
        )
    except (OSError, ValueError, KeyError) as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    print(out_dir)
    return 0


__all__ = [
    "convert_legacy_checkpoint",
    "is_legacy_config",
    "legacy_config_to_upstream",
    "upstream_config_to_legacy",
    "legacy_state_dict_to_upstream",
    "upstream_state_dict_to_legacy",
    "load_legacy_checkpoint",
    "save_legacy_checkpoint",
]


if __name__ == "__main__":
    sys.exit(main())
