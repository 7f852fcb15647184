"""What every engine reads from a model version's directory: its tokenizer, its config, its end-of-sequence ids; and
the merged checkpoint of an adapter that trains expert weights."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from server.engines.base import ModelLoadError, ModelRef
from zaya_model import ZayaConfig
from zaya_model.vllm_plugin.adapters import merge_expert_adapter, merged_checkpoint

END_OF_TURN_TOKEN = "<|im_end|>"


def end_of_sequence_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End of turn (chat answers) and end of text (raw completions): a choice stops at either."""
    ids = {tokenizer.eos_token_id}
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    return frozenset(i for i in ids if i is not None)


def load_model_tokenizer(model: ModelRef) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(model.path)
    except Exception as error:
        raise ModelLoadError(f"Model version {model.version_id} has no loadable tokenizer: {error}") from error


def load_model_config(model: ModelRef) -> ZayaConfig:
    try:
        return ZayaConfig.from_pretrained(model.path)
    except Exception as error:
        raise ModelLoadError(f"Model version {model.version_id} has no loadable config: {error}") from error


def write_merged_checkpoint(adapter_dir: Path, base_dir: Path) -> Path:
    """Merge an adapter that trains expert weights into its base, as the full checkpoint engines serve in its place
    (`merged_checkpoint(adapter_dir)`, written atomically); `AdapterError` when it does not fit the base."""
    from finetune.artifacts import atomic_directory

    with atomic_directory(merged_checkpoint(adapter_dir)) as staging:
        merge_expert_adapter(adapter_dir, base_dir, staging)
    return merged_checkpoint(adapter_dir)
