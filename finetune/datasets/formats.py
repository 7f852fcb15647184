"""The three dataset formats of the OpenAI fine-tuning API, parsed and checked one JSONL record at a time.

- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": str, "weight": 0|1 (assistant only)}]}`;
  with tools as OpenAI writes them: `"tools": [{"type": "function", "function": {"name", "description",
  "parameters"}}]` (and optionally `"parallel_tool_calls": false`) beside `messages`, assistant messages with
  `"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]` (content optional), and
  `{"role": "tool", "tool_call_id", "content"}` messages with the results
- prompt/completion: `{"prompt": str, "completion": str}` (trained on the completion)
- text: `{"text": str}` for continued pretraining (trained on all of it)
- preference (DPO): `{"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", "content": str}],
  "non_preferred_output": [{"role": "assistant", "content": str}]}`: the conversation so far, ending with a user
  message, and a better and a worse next assistant message

`parse_record` never raises on bad data: it returns the example (or None) and a list of `FieldProblem`s that name
the offending field as a path such as `messages[2].role`.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "weight", "name", "tool_calls", "tool_call_id"}
# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class DatasetFormat(enum.StrEnum):
    CHAT = "chat"
    PROMPT_COMPLETION = "prompt_completion"
    TEXT = "text"
    PREFERENCE = "preference"


FORMAT_KEYS = {
    DatasetFormat.CHAT: {"messages", "tools", "parallel_tool_calls"},
    DatasetFormat.PROMPT_COMPLETION: {"prompt", "completion"},
    DatasetFormat.TEXT: {"text"},
    DatasetFormat.PREFERENCE: {"input", "preferred_output", "non_preferred_output"},
}
PREFERENCE_OUTPUTS = ("preferred_output", "non_preferred_output")


@dataclass(frozen=True)
class Example:
    """One valid record. `messages` holds chat messages (a preference example's input); the other fields are set for
    their format only."""

    format: DatasetFormat
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # chat: the functions the assistant may call
    prompt: str = ""
    completion: str = ""
    text: str = ""
    preferred: str = ""
    non_preferred: str = ""

    def strings(self) -> list[tuple[str, str]]:
        """Every user-visible string with its field path, for checks that look at content."""
        if self.format is DatasetFormat.CHAT:
            # The tools' definitions are rendered into the prompt too, as JSON.
            tools = [(f"tools[{i}].function", json.dumps(tool["function"])) for i, tool in enumerate(self.tools)]
            return tools + [
                (f"messages[{i}].{where}", text)
                for i, message in enumerate(self.messages)
                for where, text in _message_strings(message)
            ]
        if self.format is DatasetFormat.PROMPT_COMPLETION:
            return [("prompt", self.prompt), ("completion", self.completion)]
        if self.format is DatasetFormat.PREFERENCE:
            context = [(f"input.messages[{i}].content", message["content"]) for i, message in enumerate(self.messages)]
            answers = zip(PREFERENCE_OUTPUTS, self.outputs(), strict=True)
            return context + [(f"{key}[0].content", answer) for key, answer in answers]
        return [("text", self.text)]

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them (transformers' convention): role, content, tool calls with
        their arguments as objects, the call a tool message answers; no weights."""
        return [_template_message(message) for message in self.messages]

    def outputs(self) -> tuple[str, str]:
        """A preference example's (preferred, non-preferred) assistant answers."""
        return self.preferred, self.non_preferred

    def conversations(self) -> tuple[Example, Example]:
        """A preference example as the two chat examples it compares: the input followed by each answer."""
        preferred, non_preferred = (
            Example(DatasetFormat.CHAT, messages=[*self.messages, {"role": "assistant", "content": answer}])
            for answer in self.outputs()
        )
        return preferred, non_preferred


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
        tools, tool_problems = _check_tools(record)
        problems += tool_problems + _check_messages(record["messages"], tools=tools)
        problems += _check_parallel_calls(record)
        example = Example(dataset_format, messages=record["messages"], tools=record.get("tools", []))
    elif dataset_format is DatasetFormat.PROMPT_COMPLETION:
        for key in ("prompt", "completion"):
            problems += _check_string(record, key, allow_empty=key == "prompt")
        example = Example(dataset_format, prompt=record.get("prompt", ""), completion=record.get("completion", ""))
    elif dataset_format is DatasetFormat.PREFERENCE:
        messages, answers, preference_problems = _check_preference(record)
        problems += preference_problems
        example = Example(dataset_format, messages=messages, preferred=answers[0], non_preferred=answers[1])
    else:
        problems += _check_string(record, "text", allow_empty=False)
        example = Example(dataset_format, text=record["text"])
    return (None if problems else example), problems


def _check_preference(record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str], list[FieldProblem]]:
    """OpenAI's preference format: `input.messages` ending with a user message, and each output a list of one
    assistant message. Returns the input messages, the two answers and the problems."""
    problems: list[FieldProblem] = []
    messages: list[dict[str, Any]] = []
    context = record.get("input")
    if "input" not in record:
        problems.append(FieldProblem("missing_key", "input", "missing key 'input'"))
    elif not isinstance(context, dict):
        problems.append(FieldProblem("wrong_type", "input", f"must be an object, got {_json_type(context)}"))
    elif "messages" not in context:
        problems.append(FieldProblem("missing_key", "input.messages", "missing key 'messages'"))
    else:
        problems += [
            FieldProblem("unknown_key", f"input.{key}", f"unknown key {key!r} (the input holds 'messages')")
            for key in context
            if key != "messages"
        ]
        messages = context["messages"]
        input_problems = _check_messages(messages, needs_assistant=False)
        problems += [FieldProblem(p.code, f"input.{p.field}", p.message) for p in input_problems]
        if not input_problems and messages[-1]["role"] != "user":
            message = "must end with a user message (the answers are the assistant's next message)"
            problems.append(FieldProblem("wrong_role", "input.messages", message))
        problems += [
            FieldProblem("unknown_key", f"input.messages[{index}].weight", "weights have no meaning in preference data")
            for index, message in enumerate(messages)
            if isinstance(message, dict) and "weight" in message
        ]
    answers = []
    for key in PREFERENCE_OUTPUTS:
        answer, answer_problems = _check_output(record, key)
        answers.append(answer)
        problems += answer_problems
    if not problems and answers[0] == answers[1]:
        problems.append(FieldProblem("same_outputs", "non_preferred_output", "is the same as preferred_output"))
    return messages, answers, problems


def _check_output(record: dict[str, Any], key: str) -> tuple[str, list[FieldProblem]]:
    if key not in record:
        return "", [FieldProblem("missing_key", key, f"missing key {key!r}")]
    output = record[key]
    if not isinstance(output, list) or len(output) != 1:
        found = f"{len(output)} messages" if isinstance(output, list) else _json_type(output)
        return "", [FieldProblem("wrong_type", key, f"must be a list of one assistant message, got {found}")]
    message, path = output[0], f"{key}[0]"
    if not isinstance(message, dict):
        return "", [FieldProblem("wrong_type", path, f"must be an object, got {_json_type(message)}")]
    problems = _unknown_keys(message, ("role", "content"), path, "message")
    problems += _check_role(message, path)
    if not problems and message["role"] != "assistant":
        problems.append(FieldProblem("wrong_role", f"{path}.role", f"must be 'assistant', got {message['role']!r}"))
    problems += _check_string(message, "content", allow_empty=False, path=path)
    return (message.get("content", "") if not problems else ""), problems


def _check_messages(
    messages: Any, *, needs_assistant: bool = True, tools: frozenset[str] = frozenset()
) -> list[FieldProblem]:
    """`tools`: the names of the functions the line declares, which tool calls may name."""
    if not isinstance(messages, list):
        return [FieldProblem("wrong_type", "messages", f"must be a list of messages, got {_json_type(messages)}")]
    if not messages:
        return [FieldProblem("empty_content", "messages", "the conversation has no messages")]
    problems: list[FieldProblem] = []
    call_ids: set[str] = set()  # of the calls so far, which tool messages answer
    for index, message in enumerate(messages):
        path = f"messages[{index}]"
        if not isinstance(message, dict):
            problems.append(FieldProblem("wrong_type", path, f"must be an object, got {_json_type(message)}"))
            continue
        problems += _unknown_keys(message, MESSAGE_KEYS, path, "message")
        problems += _check_role(message, path)
        role = message.get("role")
        if "tool_calls" in message and role == "assistant":
            call_problems, ids = _check_tool_calls(message["tool_calls"], f"{path}.tool_calls", tools)
            problems += call_problems
            call_ids |= ids
            if message.get("content") is not None:  # text before the calls is optional
                problems += _check_string(message, "content", allow_empty=True, path=path)
        else:
            problems += _check_string(message, "content", allow_empty=role == "tool", path=path)
        problems += _check_tool_fields(message, path, call_ids)
        if "weight" in message:
            problems += _check_weight(message, path)

    roles = [message.get("role") for message in messages if isinstance(message, dict)]
    if not needs_assistant:
        return problems
    if "assistant" not in roles:
        problems.append(FieldProblem("no_assistant_message", "messages", "the conversation has no assistant message"))
    elif not any(_is_trained(message) for message in messages):
        message = "every assistant message has weight 0, so this example trains nothing"
        problems.append(FieldProblem("no_assistant_message", "messages", message))
    return problems


def _check_tool_fields(message: dict[str, Any], path: str, call_ids: set[str]) -> list[FieldProblem]:
    """`tool_calls` only on assistant messages; `tool_call_id` on every tool message, naming an earlier call."""
    role = message.get("role")
    if "tool_calls" in message and role != "assistant":
        return [FieldProblem("unknown_key", f"{path}.tool_calls", "only assistant messages may carry tool calls")]
    if "tool_call_id" in message and role != "tool":
        return [FieldProblem("unknown_key", f"{path}.tool_call_id", "only tool messages answer a tool call")]
    if role != "tool":
        return []
    if "tool_call_id" not in message:
        return [FieldProblem("missing_key", f"{path}.tool_call_id", "missing key 'tool_call_id'")]
    if message["tool_call_id"] not in call_ids:
        message_text = f"answers {message['tool_call_id']!r}, which no earlier assistant message calls"
        return [FieldProblem("unknown_tool_call", f"{path}.tool_call_id", message_text)]
    return []


def _check_tool_calls(calls: Any, path: str, tools: frozenset[str]) -> tuple[list[FieldProblem], set[str]]:
    """An assistant message's calls, OpenAI's shape; returns the problems and the calls' ids."""
    if not isinstance(calls, list) or not calls:
        found = "an empty list" if isinstance(calls, list) else _json_type(calls)
        return [FieldProblem("wrong_type", path, f"must be a list of tool calls, got {found}")], set()
    problems: list[FieldProblem] = []
    ids: set[str] = set()
    for index, call in enumerate(calls):
        where = f"{path}[{index}]"
        if not isinstance(call, dict):
            problems.append(FieldProblem("wrong_type", where, f"must be an object, got {_json_type(call)}"))
            continue
        problems += _unknown_keys(call, ("id", "type", "function"), where, "tool call")
        problems += _check_string(call, "id", allow_empty=False, path=where)
        if call.get("type") != "function":
            problems.append(FieldProblem("wrong_type", f"{where}.type", "must be 'function'"))
        function = call.get("function")
        if not isinstance(function, dict):
            problems.append(FieldProblem("wrong_type", f"{where}.function", "must be an object with name, arguments"))
            continue
        problems += _unknown_keys(function, ("name", "arguments"), f"{where}.function", "function call")
        name_problems = _check_string(function, "name", allow_empty=False, path=f"{where}.function")
        if not name_problems and function["name"] not in tools:
            message = f"calls {function['name']!r}, which is not among the line's tools"
            name_problems.append(FieldProblem("unknown_tool", f"{where}.function.name", message))
        problems += name_problems + _check_arguments(function, f"{where}.function")
        if isinstance(call.get("id"), str):
            ids.add(call["id"])
    return problems, ids


def _check_arguments(function: dict[str, Any], path: str) -> list[FieldProblem]:
    problems = _check_string(function, "arguments", allow_empty=False, path=path)
    if problems:
        return problems
    try:
        arguments = json.loads(function["arguments"])
    except ValueError as error:
        return [FieldProblem("invalid_json", f"{path}.arguments", f"is not valid JSON: {error}")]
    if not isinstance(arguments, dict):
        return [FieldProblem("wrong_type", f"{path}.arguments", f"must be a JSON object, got {_json_type(arguments)}")]
    return []


def _check_tools(record: dict[str, Any]) -> tuple[frozenset[str], list[FieldProblem]]:
    """The line's `tools`, OpenAI's function definitions; returns their names and the problems."""
    if "tools" not in record:
        return frozenset(), []
    tools = record["tools"]
    if not isinstance(tools, list):
        return frozenset(), [FieldProblem("wrong_type", "tools", f"must be a list of tools, got {_json_type(tools)}")]
    problems: list[FieldProblem] = []
    names: set[str] = set()
    for index, tool in enumerate(tools):
        path = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            problems.append(FieldProblem("wrong_type", path, 'must be {"type": "function", "function": {...}}'))
            continue
        function = tool["function"]
        problems += _unknown_keys(tool, ("type", "function"), path, "tool")
        problems += _unknown_keys(function, FUNCTION_KEYS, f"{path}.function", "function")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            message = "must be 1 to 64 letters, digits, underscores or dashes"
            problems.append(FieldProblem("wrong_type", f"{path}.function.name", message))
        elif name in names:
            problems.append(FieldProblem("duplicate", f"{path}.function.name", f"{name!r} is defined twice"))
        else:
            names.add(name)
        if "description" in function:
            problems += _check_string(function, "description", allow_empty=True, path=f"{path}.function")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            problems.append(FieldProblem("wrong_type", f"{path}.function.parameters", "must be a JSON schema object"))
        if "strict" in function and not isinstance(function["strict"], bool):
            problems.append(FieldProblem("wrong_type", f"{path}.function.strict", "must be true or false"))
    return frozenset(names), problems


def _check_parallel_calls(record: dict[str, Any]) -> list[FieldProblem]:
    """`parallel_tool_calls: false` promises at most one call per assistant message."""
    if "parallel_tool_calls" not in record:
        return []
    if not isinstance(record["parallel_tool_calls"], bool):
        return [FieldProblem("wrong_type", "parallel_tool_calls", "must be true or false")]
    messages = record["messages"] if isinstance(record["messages"], list) else []
    return [
        FieldProblem("too_many_tool_calls", f"messages[{index}].tool_calls", "parallel_tool_calls is false")
        for index, message in enumerate(messages)
        if not record["parallel_tool_calls"]
        and isinstance(message, dict)
        and isinstance(message.get("tool_calls"), list)
        and len(message["tool_calls"]) > 1
    ]


def _message_strings(message: dict[str, Any]) -> list[tuple[str, str]]:
    """A valid message's text, with each string's path inside the message."""
    strings = [("content", message["content"])] if isinstance(message.get("content"), str) else []
    for index, call in enumerate(message.get("tool_calls") or []):
        strings.append((f"tool_calls[{index}].function.arguments", call["function"]["arguments"]))
    return strings


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    rendered = {"role": message["role"], "content": message.get("content")}
    if "tool_calls" in message:
        rendered["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])},
            }
            for call in message["tool_calls"]
        ]
    if "tool_call_id" in message:
        rendered["tool_call_id"] = message["tool_call_id"]
    return rendered


def _check_role(message: dict[str, Any], path: str) -> list[FieldProblem]:
    if "role" not in message:
        return [FieldProblem("missing_key", f"{path}.role", "missing key 'role'")]
    role = message["role"]
    if not isinstance(role, str):
        return [FieldProblem("wrong_type", f"{path}.role", f"must be a string, got {_json_type(role)}")]
    if role not in ROLES:
        expected = f"unknown role {role!r} (expected system, user, assistant or tool)"
        return [FieldProblem("unknown_role", f"{path}.role", expected)]
    return []


def _check_weight(message: dict[str, Any], path: str) -> list[FieldProblem]:
    weight = message["weight"]
    if message.get("role") != "assistant":
        return [FieldProblem("unknown_key", f"{path}.weight", "only assistant messages may carry a weight")]
    if isinstance(weight, bool) or weight not in (0, 1):
        return [FieldProblem("wrong_type", f"{path}.weight", f"weight must be 0 or 1, got {weight!r}")]
    return []


def _unknown_keys(item: dict[str, Any], known: Collection[str], path: str, what: str) -> list[FieldProblem]:
    """A problem for each key of `item` (the `what` at `path`) that is not among the `known` ones."""
    return [
        FieldProblem("unknown_key", f"{path}.{key}", f"unknown {what} key {key!r}") for key in item if key not in known
    ]


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
