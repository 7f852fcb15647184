"""Score a model (base, full fine-tune, or base + adapter) on a held-out JSONL file.

Two kinds of scores:

- teacher-forced: `loss` and `token_accuracy`, token-weighted over the trained tokens that `tokenize_example` marks
  (assistant turns), exactly the tokens fine-tuning trains on;
- for preference (DPO) data, `preference`: the mean log-probability margin of the preferred over the non-preferred
  answer, and the share of pairs where it is positive;
- generated (`task_evaluation`, the task a user cares about): the model answers each held-out prompt greedily,
  stopping at the end of its turn, and the answer is compared with the reference: `exact_match` (the whole answer,
  whitespace at line ends aside) and, for references made of `Field: value` lines (`Disposition: FILE_SAR` /
  `Reasons: ...`), the accuracy of each field's value.

`task_evaluation` is a plain function of a loaded model, so the trainer (at the end of a job with a validation file),
`zaya evaluate` and the quality benchmark all score with the same code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from zaya_model import ZayaForCausalLM
from zaya_model.pretrain import generation_eos_token_ids

from .artifacts import BASE_MODEL_FILE, base_model_fingerprint
from .data import IGNORE_INDEX, labelled_features, make_collator, read_examples, token_statistics
from .datasets.formats import DatasetFormat, Example
from .datasets.validation import validate_dataset

# A line of a structured answer: a short field name, a colon, the value.
FIELD_LINE = re.compile(r"^([A-Za-z][A-Za-z0-9 _/-]{0,63}):\s*(.*)$")
EXTRA_TOKENS = 16  # generated past the reference's length: enough to see where a wrong answer goes
GENERATION_BATCH = 8


class EvaluationError(ValueError):
    """Bad model, adapter or data file; the message says which and why."""


@dataclass(frozen=True)
class TaskExample:
    """A held-out prompt (token ids, ready to continue) and the answer it should get."""

    prompt_ids: list[int]
    reference: str


@dataclass
class TaskScores:
    n_examples: int
    exact_match: float | None
    fields: dict[str, dict[str, float | int]] = field(default_factory=dict)  # name -> {"accuracy", "n"}

    def to_dict(self) -> dict[str, Any]:
        return {"n_examples": self.n_examples, "exact_match": self.exact_match, "fields": self.fields}


def answer_fields(text: str) -> dict[str, str] | None:
    """The `Field: value` pairs of an answer whose every non-empty line is one (the first of a repeated name
    counts), else None."""
    fields: dict[str, str] = {}
    for line in normalized(text).splitlines():
        match = FIELD_LINE.match(line)
        if match is None:
            return None
        fields.setdefault(match.group(1), match.group(2))
    return fields or None


def normalized(text: str) -> str:
    """The answer as compared: surrounding blank lines and each line's outer whitespace dropped."""
    return "\n".join(line.strip() for line in text.strip().splitlines() if line.strip())


def score_answers(references: list[str], answers: list[str]) -> TaskScores:
    """Exact match over every pair; per-field accuracy over the pairs whose reference is made of `Field: value`
    lines (an answer missing the field, or not made of such lines, is wrong for it)."""
    matches = [
        normalized(reference) == normalized(answer) for reference, answer in zip(references, answers, strict=True)
    ]
    correct: dict[str, int] = {}
    seen: dict[str, int] = {}
    for reference, answer in zip(references, answers, strict=True):
        expected = answer_fields(reference)
        if expected is None:
            continue
        given = answer_fields(answer) or {}
        for name, value in expected.items():
            seen[name] = seen.get(name, 0) + 1
            correct[name] = correct.get(name, 0) + (given.get(name) == value)
    fields = {name: {"accuracy": correct[name] / seen[name], "n": seen[name]} for name in seen}
    return TaskScores(len(matches), sum(matches) / len(matches) if matches else None, fields)


def describe(evaluation: dict[str, Any]) -> str:
    """A stored task evaluation in one line: "exact match 0.800 on 30 examples; Disposition 0.967 (30), ..."."""
    if evaluation["exact_match"] is None:
        return "no examples with an answer to generate"
    line = f"exact match {evaluation['exact_match']:.3f} on {evaluation['n_examples']} examples"
    if evaluation["fields"]:
        fields = evaluation["fields"].items()
        line += "; " + ", ".join(f"{name} {field['accuracy']:.3f} ({field['n']})" for name, field in fields)
    return line


def task_examples(examples: list[Example], tokenizer: Any) -> list[TaskExample]:
    """The examples that end in an answer to generate: chat examples ending with an assistant message (the prompt is
    the conversation before it) and prompt/completion examples."""
    tasks = []
    for example in examples:
        if example.format is DatasetFormat.CHAT and example.messages and example.messages[-1]["role"] == "assistant":
            tasks.append(_chat_task(example, tokenizer))
        elif example.format is DatasetFormat.PROMPT_COMPLETION:
            tasks.append(TaskExample(tokenizer.encode(example.prompt, add_special_tokens=False), example.completion))
        elif example.format is DatasetFormat.PREFERENCE:  # the preferred answer is the reference
            context = [{"role": m["role"], "content": m["content"]} for m in example.messages]
            prompt = tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=True, return_dict=True)
            tasks.append(TaskExample(list(prompt["input_ids"]), example.preferred))
    return tasks


def _chat_task(example: Example, tokenizer: Any) -> TaskExample:
    """The conversation before its last (assistant) message, and that message as the model should write it: its
    text, or for a message with tool calls the whole turn as the chat template renders it (calls included)."""
    messages, tools = example.template_messages(), example.tools or None
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    answer = messages[-1]
    reference = answer["content"]
    if answer.get("tool_calls"):
        opening = tokenizer.apply_chat_template(messages[:-1], tools=tools, add_generation_prompt=True, tokenize=False)
        turn = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)[len(opening) :]
        reference = tokenizer.decode(tokenizer.encode(turn, add_special_tokens=False), skip_special_tokens=True)
    return TaskExample(list(prompt["input_ids"]), reference)


@torch.no_grad()
def preference_margins(model: Any, tokenizer: Any, examples: list[Example]) -> list[float]:
    """For each preference example, log p(preferred answer) - log p(non-preferred answer) given its input: the
    log-probabilities of the answers' tokens (their end of turn included) summed, as DPO compares them."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    margins = []
    try:
        for example in examples:
            if example.format is not DatasetFormat.PREFERENCE:
                continue
            log_probabilities = []
            for conversation in example.conversations():
                features = labelled_features(conversation, tokenizer)
                input_ids = torch.tensor([features["input_ids"]], device=device)
                labels = torch.tensor([features["labels"]], device=device)
                logits = model(input_ids=input_ids, use_cache=False).logits
                log_probabilities.append(-float(token_statistics(logits, labels)[..., 0].sum()))
            margins.append(log_probabilities[0] - log_probabilities[1])
    finally:
        model.train(was_training)
    return margins


@torch.no_grad()
def generate_answers(
    model: Any, tokenizer: Any, tasks: list[TaskExample], batch_size: int = GENERATION_BATCH
) -> list[str]:
    """Greedy answers, stopping at the end of the turn (or EOS), at most the reference's length + EXTRA_TOKENS.
    Prompts of similar length are batched, padded on the left."""
    stop = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[-1]
    order = sorted(range(len(tasks)), key=lambda index: len(tasks[index].prompt_ids))
    answers: list[str] = [""] * len(tasks)
    device = next(model.parameters()).device
    for start in range(0, len(order), batch_size):
        batch = [tasks[index] for index in order[start : start + batch_size]]
        width = max(len(task.prompt_ids) for task in batch)
        input_ids = torch.tensor([[pad] * (width - len(t.prompt_ids)) + t.prompt_ids for t in batch], device=device)
        attention_mask = torch.tensor(
            [[0] * (width - len(t.prompt_ids)) + [1] * len(t.prompt_ids) for t in batch], device=device
        )
        limits = [len(tokenizer.encode(task.reference, add_special_tokens=False)) + EXTRA_TOKENS for task in batch]
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max(limits),
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=pad,
        )
        # Each answer is cut at its own limit, so it does not depend on the batch it ran in.
        for index, row, limit in zip(order[start : start + batch_size], output[:, width:], limits, strict=True):
            answers[index] = tokenizer.decode(row[:limit], skip_special_tokens=True)
    return answers


def task_evaluation(model: Any, tokenizer: Any, examples: list[Example]) -> TaskScores:
    """Generate an answer for each held-out example and score it (see the module's docstring)."""
    was_training = model.training
    model.eval()
    try:
        tasks = task_examples(examples, tokenizer)
        answers = generate_answers(model, tokenizer, tasks)
    finally:
        model.train(was_training)
    return score_answers([task.reference for task in tasks], answers)


def evaluate_file(model: Any, tokenizer: Any, data_file: str) -> dict[str, Any]:
    """The task evaluation of a (validated) JSONL file as it is stored and reported: the scores and the file's
    SHA-256, since two models' scores compare only on the same data."""
    examples = read_examples(data_file)
    evaluation = {**task_evaluation(model, tokenizer, examples).to_dict(), "data_sha256": _sha256(data_file)}
    margins = preference_margins(model, tokenizer, examples)
    if margins:  # preference data: how far the preferred answers are ahead
        evaluation["preference"] = {
            "n_pairs": len(margins),
            "mean_margin": sum(margins) / len(margins),
            "accuracy": sum(margin > 0 for margin in margins) / len(margins),
        }
    return evaluation


def evaluate_model(
    model_dir: str, data_file: str, adapter_dir: str | None = None, *, batch_size: int = 8
) -> dict[str, Any]:
    """`zaya evaluate`: the teacher-forced scores and the task evaluation of a model on a JSONL file."""
    model, tokenizer = load_model(model_dir, adapter_dir)
    report = validate_dataset(data_file, tokenizer=tokenizer, max_problems=10)
    if not report.is_valid:
        raise EvaluationError(f"data_file: {report.n_problems} problem(s): " + "; ".join(report.problem_lines()))
    examples = read_examples(data_file)
    loss, accuracy, n_trained = _token_scores(model, tokenizer, examples, batch_size)
    return {
        "n_examples": len(examples),
        "n_trained_tokens": n_trained,
        "loss": loss,
        "token_accuracy": accuracy,
        "task_evaluation": evaluate_file(model, tokenizer, data_file),
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
        base = ZayaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise EvaluationError(f"cannot load the model from {model_dir}: {error}") from None
    model = base if adapter_dir is None else _with_adapter(base, adapter_dir)
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
        adapted = PeftModel.from_pretrained(model, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as error:  # shape mismatches for another architecture size
        raise EvaluationError(f"the adapter in {adapter_dir} does not fit this base model: {error}") from None
    generation_config = os.path.join(adapter_dir, "generation_config.json")
    if os.path.isfile(generation_config):  # the wrapper reads the base model's (PEFT forwards attributes)
        model.generation_config = GenerationConfig.from_pretrained(adapter_dir)
    return adapted


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


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Where an answer ends: the chat end-of-turn token and EOS."""
    try:
        return generation_eos_token_ids(tokenizer)
    except ValueError:  # a tokenizer without a chat end-of-turn token stops on EOS only
        return [tokenizer.eos_token_id]
