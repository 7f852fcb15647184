"""Preference fine-tuning (DPO, `method.type == "dpo"`) with TRL's `DPOTrainer`.

Each preference example (`input` messages, `preferred_output`, `non_preferred_output`, OpenAI's format) becomes TRL's
conversational `prompt` / `chosen` / `rejected`. The policy is trained against the frozen starting model: for LoRA,
the same model with its adapter switched off (TRL does this when given the LoRA config); for full fine-tuning, a
second frozen copy loaded from the model directory. The run shares everything else with supervised fine-tuning
(`finetune.run`): checkpoints, hooks, rotation, evaluation, outputs.

TRL (and its `datasets` dependency) is imported here only, so supervised runs and the API never pay for it.
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from trl.trainer.dpo_config import DPOConfig
from trl.trainer.dpo_trainer import DPOTrainer

from zaya_model import ZayaForCausalLM

from .datasets.formats import Example
from .trainer_mixin import CheckpointedTraining


def preference_dataset(examples: list[Example]) -> Dataset:
    """TRL's conversational preference rows for (validated) preference examples."""
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": message["role"], "content": message["content"]} for message in example.messages],
                "chosen": [{"role": "assistant", "content": example.preferred}],
                "rejected": [{"role": "assistant", "content": example.non_preferred}],
            }
            for example in examples
        ]
    )


class PreferenceTrainer(CheckpointedTraining, DPOTrainer):
    def count_trained_tokens(self, inputs: dict[str, Any]) -> int:
        # TRL's batch holds each pair's chosen and rejected sequences; the loss reads their completion tokens.
        return int(inputs["completion_mask"][:, 1:].sum())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The DPO loss on the validation pairs is the run's validation loss (the best checkpoint is chosen by it).
        # TRL adds its metrics to `logs` in place, which is also the dict `evaluate` returns.
        if "eval_loss" in logs:
            logs["eval_valid_loss"] = logs["eval_loss"]
        super().log(logs, start_time)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """No Hub model card: a run writes its own artifacts (`finetune.artifacts`)."""


def preference_trainer(
    *,
    model: ZayaForCausalLM,
    lora_config: Any,
    reference_dir: str,
    arguments: dict[str, Any],
    beta: float,
    max_length: int,
    train_examples: list[Example],
    eval_examples: list[Example] | None,
    tokenizer: Any,
    **trainer_options: Any,
) -> PreferenceTrainer:
    """A DPO trainer for `model` (`lora_config`: train a LoRA adapter; None: every weight against a frozen copy
    read from `reference_dir`). `arguments` are the run's TrainingArguments; `trainer_options` the
    `CheckpointedTraining` and Trainer keywords (hooks, callbacks, ...)."""
    config = DPOConfig(
        **arguments,
        beta=beta,
        max_length=max_length,  # the data were validated against it: nothing is truncated
        bf16=False,  # as supervised runs: fp32 weights (TRL's default turns bf16 on)
        precompute_ref_log_probs=False,
    )
    reference = None
    if lora_config is None:
        reference = ZayaForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
        reference.requires_grad_(False)
    return PreferenceTrainer(
        model=model,
        ref_model=reference,
        args=config,
        train_dataset=preference_dataset(train_examples),
        eval_dataset=preference_dataset(eval_examples) if eval_examples is not None else None,
        processing_class=tokenizer,
        peft_config=lora_config,
        **trainer_options,
    )
