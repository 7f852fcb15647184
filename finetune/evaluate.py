"""Score a model (base, full fine-tune, or base + adapter) on a held-out JSONL file.

- `loss`, `token_accuracy`: token-weighted over the trained tokens that `tokenize_example` marks (assistant turns),
  exactly the tokens fine-tuning trains on.
- `disposition_accuracy`: for the bank `disposition` task (reference answers that start with "Disposition: LABEL"),
  the share of greedy answers whose label (`parse_disposition`) equals the reference's.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from zaya_model import ZayaForCausalLM

from .artifacts import BASE_MODEL_FILE, base_model_fingerprint
from .data import IGNORE_INDEX, labelled_features, make_collator, read_examples, token_statistics
from .datasets.formats import DatasetFormat, Example
from .datasets.synthetic import parse_disposition
from .datasets.validation import validate_dataset

DISPOSITION_PREFIX = "Disposition:"


class EvaluationError(ValueError):
    """Bad model, adapter or data file; the message says which and why."""


def evaluate_model(
    model_dir: str,
    data_file: str,
    adapter_dir: str | None = None,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 16,
) -> dict[str, Any]:
    model, tokenizer = load_model(model_dir, adapter_dir)
    report = validate_dataset(data_file, tokenizer=tokenizer, max_problems=10)
    if not report.is_valid:
        raise EvaluationError(f"data_file: {report.n_problems} problem(s): " + "; ".join(report.problem_lines()))
    examples = read_examples(data_file)
    loss, accuracy, n_trained = _token_scores(model, tokenizer, examples, batch_size)
    disposition_accuracy, n_dispositions = _disposition_accuracy(model, tokenizer, examples, max_new_tokens)
    return {
        "n_examples": len(examples),
        "n_trained_tokens": n_trained,
        "loss": loss,
        "token_accuracy": accuracy,
        "disposition_accuracy": disposition_accuracy,
        "n_disposition_examples": n_dispositions,
    }


def load_model(model_dir: str, adapter_dir: str | None = None) -> tuple[torch.nn.Module, Any]:
    """The model in eval mode and its tokenizer (the adapter's, when it has one). Refuses an adapter trained on
    another base model."""
    if not os.path.isdir(model_dir):
        raise EvaluationError(f"model directory not found: {model_dir}")
    if adapter_dir is not None and not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
        raise EvaluationError(f"not an adapter directory (no adapter_config.json): {adapter_dir}")
    has_own_tokenizer = adapter_dir is not None and os.path.isfile(os.path.join(adapter_dir, "tokenizer.json"))
    tokenizer_dir = adapter_dir if has_own_tokenizer else model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        model = ZayaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise EvaluationError(f"cannot load the model from {model_dir}: {error}") from None
    if adapter_dir is not None:
        model = _with_adapter(model, adapter_dir)
    return model.eval(), tokenizer


def _with_adapter(model: ZayaForCausalLM, adapter_dir: str) -> torch.nn.Module:
    from peft import PeftModel

    info_path = os.path.join(adapter_dir, BASE_MODEL_FILE)
    if os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as file:
            expected = json.load(file)["fingerprint"]
        if base_model_fingerprint(model) != expected:
            raise EvaluationError(
                f"the adapter in {adapter_dir} was trained on a different base model than the one given "
                f"(fingerprint {expected} expected); pass the base model it was fine-tuned from"
            )
    try:
        model = PeftModel.from_pretrained(model, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as error:  # shape mismatches for another architecture size
        raise EvaluationError(f"the adapter in {adapter_dir} does not fit this base model: {error}") from None
    generation_config = os.path.join(adapter_dir, "generation_config.json")
    if os.path.isfile(generation_config):
        model.generation_config = GenerationConfig.from_pretrained(adapter_dir)
    return model


@torch.no_grad()
def _token_scores(model: Any, tokenizer: Any, examples: list[Example], batch_size: int) -> tuple[float, float, int]:
    collate = make_collator(tokenizer, packing=True)
    features = [labelled_features(example, tokenizer) for example in examples]
    totals = torch.zeros(2, dtype=torch.float64)
    n_trained = 0
    for start in range(0, len(features), batch_size):
        batch = collate(features[start : start + batch_size])
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        totals += token_statistics(logits, batch["labels"]).sum(dim=(0, 1)).double()
        n_trained += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    n = max(n_trained, 1)
    return float(totals[0] / n), float(totals[1] / n), n_trained


@torch.no_grad()
def _disposition_accuracy(
    model: Any, tokenizer: Any, examples: list[Example], max_new_tokens: int
) -> tuple[float | None, int]:
    correct = total = 0
    for example in examples:
        reference = _reference_disposition(example)
        if reference is None:
            continue
        prompt = tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in example.messages[:-1]],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        output = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
        answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += parse_disposition(answer) == reference
        total += 1
    return (correct / total if total else None), total


def _reference_disposition(example: Example) -> str | None:
    if example.format is not DatasetFormat.CHAT or example.messages[-1]["role"] != "assistant":
        return None
    answer = example.messages[-1]["content"]
    return parse_disposition(answer) if answer.startswith(DISPOSITION_PREFIX) else None
