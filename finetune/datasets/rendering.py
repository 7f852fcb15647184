"""Turn a dataset example into token ids and the loss mask, the one place that decides which tokens are trained.

- chat: rendered with the tokenizer's chat template (with the line's tools, if any); trained tokens are the assistant
  turns with weight 1, their tool calls and end-of-turn token included, taken from the template's
  `{% generation %}` markers.
- prompt/completion: prompt and completion are encoded separately (as at inference, where the prompt is encoded and
  the completion generated), then EOS; trained: completion + EOS.
- text: BOS + text + EOS, all trained but BOS.
- preference: the input followed by the preferred answer, rendered as chat (`Example.conversations` gives both
  conversations a preference run compares).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .formats import DatasetFormat, Example

if TYPE_CHECKING:  # transformers is slow to import; only the type is needed here
    from transformers import PreTrainedTokenizerBase


class TemplateError(ValueError):
    """The tokenizer cannot render this example with a usable loss mask."""


@dataclass(frozen=True)
class TokenizedExample:
    input_ids: list[int]
    trained_mask: list[int]  # 1 where the token contributes to the loss

    @property
    def n_trained(self) -> int:
        return sum(self.trained_mask)


def tokenize_example(example: Example, tokenizer: PreTrainedTokenizerBase) -> TokenizedExample:
    if example.format is DatasetFormat.CHAT:
        return _tokenize_chat(example, tokenizer)
    if example.format is DatasetFormat.PREFERENCE:
        return _tokenize_chat(example.conversations()[0], tokenizer)
    if example.format is DatasetFormat.PROMPT_COMPLETION:
        prompt = tokenizer.encode(example.prompt, add_special_tokens=False)
        completion = tokenizer.encode(example.completion, add_special_tokens=False) + [_required_id(tokenizer, "eos")]
        return TokenizedExample(prompt + completion, [0] * len(prompt) + [1] * len(completion))
    text = tokenizer.encode(example.text, add_special_tokens=False) + [_required_id(tokenizer, "eos")]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return TokenizedExample(bos + text, [0] * len(bos) + [1] * len(text))


def _tokenize_chat(example: Example, tokenizer: PreTrainedTokenizerBase) -> TokenizedExample:
    if not tokenizer.chat_template:
        raise TemplateError("the tokenizer has no chat template")
    if uses_tools(example.messages, example.tools) and not renders_tools(tokenizer):
        raise TemplateError(TOOLS_NOT_RENDERED)
    # Render every assistant turn as trainable, then drop the weight-0 ones by position: this honours `weight` with
    # any template that has generation markers, not only ours.
    tools: list[dict[Any, Any] | Callable[..., Any]] = [*example.tools]
    rendered = tokenizer.apply_chat_template(
        example.template_messages(),
        tools=tools or None,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    if not isinstance(rendered, Mapping):  # a BatchEncoding
        raise TypeError(f"apply_chat_template(return_dict=True) gave a {type(rendered).__name__}")
    input_ids, mask = list(rendered["input_ids"]), list(rendered["assistant_masks"])
    spans = _runs_of_ones(mask)
    weights = [message.get("weight", 1) for message in example.messages if message["role"] == "assistant"]
    if len(spans) != len(weights):
        raise TemplateError(
            f"the chat template marks {len(spans)} assistant spans for {len(weights)} assistant messages; "
            "it needs {% generation %} markers around each assistant turn"
        )
    for (start, end), weight in zip(spans, weights, strict=True):
        if weight == 0:
            mask[start:end] = [0] * (end - start)
    return TokenizedExample(input_ids, mask)


TOOLS_NOT_RENDERED = (
    "the chat template does not render tools, tool calls and tool results in the <tool_call> format "
    "(a tokenizer trained by this version writes it)"
)
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# A conversation with every part of the tool format, and the call as a template that speaks the format renders it.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}
_PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "probe"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "probe_call", "arguments": {"a": 1}}}],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "probe_result"},
]
_PROBE_CALL = f'{TOOL_CALL_OPEN}\n{{"name": "probe_call", "arguments": {{"a": 1}}}}\n{TOOL_CALL_CLOSE}'


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether a conversation needs the template's tool format: tools, calls or results."""
    return bool(tools) or any(message.get("tool_calls") or message.get("role") == "tool" for message in messages)


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template lists tools, renders calls as
    `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` (the format the server decodes and parses) and
    renders tool results: a template that drops any of them would silently lose part of a conversation."""
    template = tokenizer.chat_template
    if template not in _RENDERS_TOOLS:
        try:
            text = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=[_PROBE_TOOL], tokenize=False)
            renders = '"probe_tool"' in text and _PROBE_CALL in text and "probe_result" in text
        except Exception:  # a template that refuses the roles or fields
            renders = False
        if len(_RENDERS_TOOLS) >= 64:  # a server sees a few templates; never grow without bound
            _RENDERS_TOOLS.clear()
        _RENDERS_TOOLS[template] = renders
    return _RENDERS_TOOLS[template]


_RENDERS_TOOLS: dict[str | None, bool] = {}  # by chat template: the probe's answer depends on nothing else


def _runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for index, value in enumerate([*mask, 0]):
        if value and start is None:
            start = index
        elif not value and start is not None:
            runs.append((start, index))
            start = None
    return runs


def _required_id(tokenizer: PreTrainedTokenizerBase, name: str) -> int:
    token_id = getattr(tokenizer, f"{name}_token_id")
    if not isinstance(token_id, int):
        raise TemplateError(f"the tokenizer has no {name} token")
    return token_id
