"""Checks that a PEFT LoRA adapter can be served on a ZAYA checkpoint, before vLLM loads it, and expert merging.

vLLM applies LoRA per request to the attention projections only. Its own loader rejects some adapters it cannot
apply but silently skips others (PEFT stores a fused expert `gate_up_proj` adapter under `experts.base_layer`,
which vLLM ignores), and an adapter trained on another base fails late with a shape error. `check_adapter` reads
only the adapter's config and tensor shapes, so callers can refuse an adapter with a clear message at registration.

Adapters that vLLM's per-request LoRA cannot apply are merged at registration (`served_merged`): those that train
expert weights (PEFT `target_parameters`, the fine-tuning default) and those that train token embedding rows (PEFT
`trainable_token_indices`: the chat template's tokens, which fine-tuning trains by default; vLLM's LoRA has no
per-request embedding rows): `zaya_model.training.adapter_merge.write_merged_checkpoint` writes the base with the
adapter merged to `merged_checkpoint(adapter)`, a full checkpoint that engines serve as its own model.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from ..configuration_zaya import ZayaConfig
from ..training.adapter_merge import AdapterError

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj")
MERGED_DIR = "merged"


def projection_shapes(config: ZayaConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-capable projection."""
    query, key = config.query_width, config.key_width
    hidden = config.hidden_size
    return {
        "q_proj": (hidden, query),
        "k_proj": (hidden, key),
        "v_proj_current": (hidden, key // 2),
        "v_proj_delayed": (hidden, key // 2),
        "o_proj": (query, hidden),
    }


def check_adapter(adapter_dir: str | Path, model_dir: str | Path) -> None:
    """Raise `AdapterError` unless the adapter in `adapter_dir` is a LoRA on `model_dir`'s attention projections."""
    adapter_dir = Path(adapter_dir)
    adapter_config = read_adapter_config(adapter_dir)
    weights_path = adapter_dir / "adapter_model.safetensors"
    if adapter_config.get("target_parameters"):
        raise AdapterError(
            f"{adapter_dir}: the adapter trains expert weights ({adapter_config['target_parameters']}); per-request "
            "LoRA covers the attention projections only: merge it into the base (merge_and_unload) and serve that"
        )
    if adapter_config.get("trainable_token_indices"):
        raise AdapterError(
            f"{adapter_dir}: the adapter trains token embedding rows ({adapter_config['trainable_token_indices']}); "
            "per-request LoRA covers the attention projections only: merge it into the base (merge_and_unload) and "
            "serve that"
        )

    base = ZayaConfig.from_pretrained(model_dir)
    shapes = projection_shapes(base)
    with safe_open(str(weights_path), framework="pt") as tensors:
        for name in tensors.keys():  # noqa: SIM118 (safe_open is not a dict)
            _check_tensor(adapter_dir, name, tuple(tensors.get_slice(name).get_shape()), base, shapes)


def _check_tensor(adapter_dir: Path, name: str, shape: tuple[int, ...], base: ZayaConfig, shapes) -> None:
    module, _, kind = name.rpartition(".lora_")
    target = module.rsplit(".", 1)[-1]
    if target not in SUPPORTED_TARGETS:
        raise AdapterError(
            f"{adapter_dir}: tensor {name!r} targets {target!r}; per-request LoRA supports {list(SUPPORTED_TARGETS)}"
        )
    layer = _layer_index(module)
    if layer is not None and layer >= base.num_hidden_layers:
        raise AdapterError(
            f"{adapter_dir}: tensor {name!r} is for layer {layer}, the base has {base.num_hidden_layers} layers "
            "(adapter for another base model?)"
        )
    in_features, out_features = shapes[target]
    # lora_A: [rank, in]; lora_B: [out, rank].
    expected, actual = (in_features, shape[-1]) if kind.startswith("A") else (out_features, shape[0])
    if expected != actual:
        raise AdapterError(
            f"{adapter_dir}: tensor {name!r} has shape {list(shape)}, the base's {target} needs {expected} features "
            "there (adapter for another base model?)"
        )


def _layer_index(module: str) -> int | None:
    parts = module.split(".")
    for before, after in zip(parts, parts[1:], strict=False):
        if before == "layers" and after.isdigit():
            return int(after)
    return None


def read_adapter_config(adapter_dir: Path) -> dict:
    """The adapter's `adapter_config.json`; `AdapterError` unless it is a PEFT LoRA adapter in safetensors."""
    config_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(
            f"{adapter_dir}: not a PEFT adapter (needs adapter_config.json and adapter_model.safetensors)"
        )
    try:
        adapter_config = json.loads(config_path.read_text())
    except ValueError as error:
        raise AdapterError(f"{config_path}: not valid JSON ({error})") from error
    if adapter_config.get("peft_type") != "LORA":
        raise AdapterError(f"{adapter_dir}: only LoRA adapters can be served, got {adapter_config.get('peft_type')!r}")
    return adapter_config


def served_merged(adapter_dir: str | Path) -> bool:
    """Whether the adapter trains what per-request LoRA cannot apply (fused expert weights, token embedding rows),
    so it is served merged into its base."""
    config_path = Path(adapter_dir) / "adapter_config.json"
    try:
        adapter_config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return False
    return bool(adapter_config.get("target_parameters") or adapter_config.get("trainable_token_indices"))


def merged_checkpoint(adapter_dir: str | Path) -> Path:
    """Where registration writes the full checkpoint of an adapter merged into its base (`served_merged`)."""
    return Path(adapter_dir) / MERGED_DIR
