"""A PEFT LoRA adapter merged into its base model (`merge_and_unload`: each adapted weight becomes `W + s B A`, the
tied LM head's rows included), the one way every package merges: fine-tuning's `merged/` output, the local engine
serving an adapter version, and registration writing the full checkpoint of an adapter that per-request LoRA cannot
apply (`write_merged_checkpoint`).

peft, transformers and the model are imported on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .atomic_io import atomic_directory

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class AdapterError(ValueError):
    """The adapter cannot be applied to, or served on, this base model (not LoRA, another base's shapes, unknown
    modules)."""


def merge_adapter(model: Any, adapter_dir: str | os.PathLike[str] | None = None) -> PreTrainedModel:
    """The base model with the adapter folded into its weights, as a plain model (no PEFT wrapper).

    `model`: a base model and `adapter_dir` the PEFT adapter to apply to it; or, without `adapter_dir`, a `PeftModel`
    (a fine-tuning run's trained model). The base model's weights are changed in place. `AdapterError` when the
    adapter does not fit the base (another base's shapes, unknown modules, no adapter there).
    """
    from peft import PeftModel

    if adapter_dir is None:
        if not isinstance(model, PeftModel):
            raise TypeError(f"merge_adapter needs a PeftModel or an adapter directory, got a {type(model).__name__}")
        return model.merge_and_unload()
    try:
        return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    except (RuntimeError, ValueError, KeyError) as error:
        base = getattr(model, "name_or_path", "") or "the base model"
        raise AdapterError(
            f"{adapter_dir}: cannot be applied to {base} (adapter for another base model?): {error}"
        ) from error


def write_merged_checkpoint(
    adapter_dir: str | os.PathLike[str], model_dir: str | os.PathLike[str], destination: str | os.PathLike[str]
) -> Path:
    """Write the ZAYA checkpoint in `model_dir` with the adapter merged into it (weights, tokenizer) to
    `destination`, atomically; `AdapterError` when the adapter does not fit the base."""
    from transformers import AutoTokenizer

    from ..modeling_zaya import ZayaForCausalLM

    destination = Path(destination)
    merged = merge_adapter(ZayaForCausalLM.from_pretrained(model_dir, dtype="auto"), adapter_dir)
    with atomic_directory(destination) as staging:
        merged.save_pretrained(staging)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(staging)
    return destination
