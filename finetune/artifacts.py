"""What a fine-tuning run writes besides the weights: the file names, the generation config, the base-model
fingerprint. Directories are published atomically (`zaya_model.training.atomic_io`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

BASE_MODEL_FILE = "base_model.json"  # in an adapter dir: which base model the adapter was trained on
METRICS_FILE = "metrics.json"  # in a checkpoint dir: step, train/valid loss, valid token accuracy
EVALUATION_FILE = "evaluation.json"  # in a fine-tuned model dir: the task evaluation of the validation file
TRAINED_TOKENS_FILE = "trained_tokens.json"  # in a checkpoint dir: tokens trained (carrying loss) up to its step
_CONFIG_KEYS_IGNORED = {"_name_or_path", "dtype", "torch_dtype", "transformers_version", "architectures", "use_cache"}
_FINGERPRINT_ROWS = 1024


def base_model_fingerprint(model: PreTrainedModel) -> str:
    """A short hash of the base model's config and a sample of its embedding rows: equal only for the same weights."""
    config = {key: value for key, value in model.config.to_dict().items() if key not in _CONFIG_KEYS_IGNORED}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    embeddings = model.get_input_embeddings().get_parameter("weight").detach()
    stride = max(1, embeddings.shape[0] // _FINGERPRINT_ROWS)
    digest.update(embeddings[::stride].to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def save_generation_files(
    directory: str | os.PathLike[str], model: PreTrainedModel | PeftModel, tokenizer: Any
) -> None:
    """Tokenizer and generation config (its `eos_token_id` lists the end-of-turn token) beside the weights."""
    generation_config = model.generation_config
    if generation_config is None:
        raise ValueError("the model has no generation config")
    tokenizer.save_pretrained(directory)
    generation_config.save_pretrained(directory)


def read_json(path: Path) -> Any:
    """A JSON file's value, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
