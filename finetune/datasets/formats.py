"""The three dataset formats of the OpenAI fine-tuning API, parsed and checked one JSONL record at a time.

- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": str, "weight": 0|1 (assistant only)}]}`
- prompt/completion: `{"prompt": str, "completion": str}` (trained on the completion)
- text: `{"text": str}` for continued pretraining (trained on all of it)

`parse_record` never raises on bad data: it returns the example (or None) and a list of `FieldProblem`s that name
the offending field as a path such as `messages[2].role`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "weight", "name"}


class DatasetFormat(enum.StrEnum):
    CHAT = "chat"
    PROMPT_COMPLETION = "prompt_completion"
    TEXT = "text"


FORMAT_KEYS = {
    DatasetFormat.CHAT: {"messages"},
    DatasetFormat.PROMPT_COMPLETION: {"prompt", "completion"},
    DatasetFormat.TEXT: {"text"},
}


@dataclass(frozen=True)
class Example:
    """One valid record. `messages` holds chat messages; the other fields are set for their format only."""

    format: DatasetFormat
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str = ""
    completion: str = ""
    text: str = ""

    def strings(self) -> list[tuple[str, str]]:
        """Every user-visible string with its field path, for checks that look at content."""
        if self.format is DatasetFormat.CHAT:
            return [(f"messages[{i}].content", message["content"]) for i, message in enumerate(self.messages)]
        if self.format is DatasetFormat.PROMPT_COMPLETION:
            return [("prompt", self.prompt), ("completion", self.completion)]
        return [("text", self.text)]


@dataclass(frozen=True)
class FieldProblem:
    code: str
    field: str | None
    message: str


def detect_format(record: dict[str, Any]) -> DatasetFormat | None:
    for dataset_format, keys in FORMAT_KEYS.items():
        if keys & record.keys():
            return dataset_format
    return None


def parse_record(record: Any) -> tuple[Example | None, list[FieldProblem]]:
    """Check one decoded JSON value against the format its keys announce."""
    if not isinstance(record, dict):
        return None, [FieldProblem("wrong_type", None, f"each line must be a JSON object, got {_json_type(record)}")]
    dataset_format = detect_format(record)
    if dataset_format is None:
        keys = ", ".join(sorted(record)) or "none"
        message = f"missing keys: expected 'messages', 'prompt' + 'completion' or 'text' (found: {keys})"
        return None, [FieldProblem("missing_key", None, message)]

    problems = [
        FieldProblem("unknown_key", key, f"unknown key {key!r} for the {dataset_format.value} format")
        for key in record
        if key not in FORMAT_KEYS[dataset_format]
    ]
    if dataset_format is DatasetFormat.CHAT:
        problems += _check_messages(record["messages"])
        example = Example(dataset_format, messages=record["messages"])
    elif dataset_format is DatasetFormat.PROMPT_COMPLETION:
        for key in ("prompt", "completion"):
            problems += _check_string(record, key, allow_empty=key == "prompt")
        example = Example(dataset_format, prompt=record.get("prompt"), completion=record.get("completion"))
    else:
        problems += _check_string(record, "text", allow_empty=False)
        example = Example(dataset_format, text=record["text"])
    return (None if problems else example), problems


def _check_messages(messages: Any) -> list[FieldProblem]:
    if not isinstance(messages, list):
        return [FieldProblem("wrong_type", "messages", f"must be a list of messages, got {_json_type(messages)}")]
    if not messages:
        return [FieldProblem("empty_content", "messages", "the conversation has no messages")]
    problems: list[FieldProblem] = []
    for index, message in enumerate(messages):
        path = f"messages[{index}]"
        if not isinstance(message, dict):
            problems.append(FieldProblem("wrong_type", path, f"must be an object, got {_json_type(message)}"))
            continue
        problems += [
            FieldProblem("unknown_key", f"{path}.{key}", f"unknown message key {key!r}")
            for key in message
            if key not in MESSAGE_KEYS
        ]
        problems += _check_role(message, path)
        problems += _check_string(message, "content", allow_empty=False, path=path)
        if "weight" in message:
            problems += _check_weight(message, path)

    roles = [message.get("role") for message in messages if isinstance(message, dict)]
    if "assistant" not in roles:
        problems.append(FieldProblem("no_assistant_message", "messages", "the conversation has no assistant message"))
    elif not any(_is_trained(message) for message in messages):
        message = "every assistant message has weight 0, so this example trains nothing"
        problems.append(FieldProblem("no_assistant_message", "messages", message))
    return problems


def _check_role(message: dict[str, Any], path: str) -> list[FieldProblem]:
    if "role" not in message:
        return [FieldProblem("missing_key", f"{path}.role", "missing key 'role'")]
    role = message["role"]
    if not isinstance(role, str):
        return [FieldProblem("wrong_type", f"{path}.role", f"must be a string, got {_json_type(role)}")]
    if role not in ROLES:
        message = f"unknown role {role!r} (expected system, user or assistant)"
        return [FieldProblem("unknown_role", f"{path}.role", message)]
    return []


def _check_weight(message: dict[str, Any], path: str) -> list[FieldProblem]:
    weight = message["weight"]
    if message.get("role") != "assistant":
        return [FieldProblem("unknown_key", f"{path}.weight", "only assistant messages may carry a weight")]
    if isinstance(weight, bool) or weight not in (0, 1):
        return [FieldProblem("wrong_type", f"{path}.weight", f"weight must be 0 or 1, got {weight!r}")]
    return []


def _check_string(record: dict[str, Any], key: str, *, allow_empty: bool, path: str = "") -> list[FieldProblem]:
    where = f"{path}.{key}" if path else key
    if key not in record:
        return [FieldProblem("missing_key", where, f"missing key {key!r}")]
    value = record[key]
    if not isinstance(value, str):
        return [FieldProblem("wrong_type", where, f"must be a string, got {_json_type(value)}")]
    if not allow_empty and not value.strip():
        return [FieldProblem("empty_content", where, "is empty")]
    return []


def _is_trained(message: Any) -> bool:
    # An invalid weight is reported on its own; only an explicit 0 makes a turn untrained.
    return isinstance(message, dict) and message.get("role") == "assistant" and message.get("weight", 1) != 0


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return "a number" if isinstance(value, int | float) else type(value).__name__
