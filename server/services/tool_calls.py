"""Tool calls in a chat answer: the `<tool_call>` blocks of the model's text parsed back into OpenAI's `tool_calls`,
whole or as the text streams.

The chat template (`zaya_model.pretrain.tokenizer`; `finetune.datasets.rendering.renders_tools` checks a model's)
renders each call as `<tool_call>\\n{"name": "<name>", "arguments": {...}}\\n</tool_call>`, and decoding under
`tools` is held to that format (`OutputGrammar.tool_calls`), so a call the parser meets is well formed; a block
that is not (cut by `max_tokens` before its name, say) stays text. Whitespace between text and a call, or between
calls, is the format's, not the answer's: it is dropped.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from finetune.datasets.rendering import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from server.engines.base import ChoiceDelta, ToolCallDelta

# The start of a call, up to its arguments: the name is known once this matches.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> None:
        self.content += other.content
        for call in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index:
                last.arguments += call.arguments
            else:
                self.tool_calls.append(call)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


class ToolCallParser:
    """Splits one choice's text, fed as it streams, into content and tool calls.

    Text that may still turn out to be part of a call (a partial `<tool_call>`, a call's head before its name is
    complete) or whitespace that may border one is held back until the text after it decides.
    """

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []  # every call started, its arguments as received so far
        self.completed = 0  # calls whose closing tag arrived
        self._buffer = ""  # text not yet released
        self._state = "text"  # text | head | arguments | tail
        self._after_call = False  # the text state follows a call: its leading whitespace is the format's
        self._depth = 0  # arguments: nesting of objects and arrays
        self._in_string = self._escaped = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        parsed = ParsedDelta()
        while True:
            step = {"text": self._text, "head": self._head, "arguments": self._arguments, "tail": self._tail}
            progressed = step[self._state](parsed)
            if not progressed:
                return parsed

    def finish(self) -> ParsedDelta:
        """What is held back, once the text has ended: text is released; a call cut short stays as it streamed."""
        parsed = ParsedDelta()
        if self._state == "text":
            parsed.content = self._buffer.lstrip() if self._after_call else self._buffer
        elif self._state == "head":
            parsed.content = TOOL_CALL_OPEN + self._buffer
        self._buffer = ""
        return parsed

    def _text(self, parsed: ParsedDelta) -> bool:
        if self._after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._after_call = False
        start = self._buffer.find(TOOL_CALL_OPEN)
        if start >= 0:
            parsed.content += self._buffer[:start].rstrip()
            self._buffer, self._state = self._buffer[start + len(TOOL_CALL_OPEN) :], "head"
            return True
        # Keep back a trailing part of an opening tag and the whitespace before it (or at the end).
        keep = next(
            (size for size in range(len(TOOL_CALL_OPEN) - 1, 0, -1) if self._buffer.endswith(TOOL_CALL_OPEN[:size])), 0
        )
        release = self._buffer[: len(self._buffer) - keep]
        held = len(release) - len(release.rstrip())
        parsed.content += release[: len(release) - held]
        self._buffer = self._buffer[len(release) - held :]
        return False

    def _head(self, parsed: ParsedDelta) -> bool:
        head = _CALL_HEAD.match(self._buffer)
        if head is None or head.end() == len(self._buffer):  # the whitespace before the arguments may go on
            closed = self._buffer.find(TOOL_CALL_CLOSE)
            if closed < 0:
                return False
            # Not a call after all: the block is text.
            parsed.content += TOOL_CALL_OPEN + self._buffer[: closed + len(TOOL_CALL_CLOSE)]
            self._buffer, self._state = self._buffer[closed + len(TOOL_CALL_CLOSE) :], "text"
            return True
        call = ToolCall(new_call_id(), json.loads(head.group(1)), "")
        self.calls.append(call)
        parsed.add(ParsedDelta(tool_calls=[ToolCallDelta(len(self.calls) - 1, call.id, call.name)]))
        self._buffer, self._state = self._buffer[head.end() :], "arguments"
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _arguments(self, parsed: ParsedDelta) -> bool:
        """Releases the arguments' JSON text up to the end of the value: an object or array closing, or for a bare
        value the brace that closes the call's object."""
        for position, char in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                end = position + 1 if self._depth else position
                self._depth -= 1
                if self._depth <= 0:
                    self._release_arguments(parsed, end)
                    self._state = "tail"
                    return True
        self._release_arguments(parsed, len(self._buffer))
        return False

    def _release_arguments(self, parsed: ParsedDelta, end: int) -> None:
        piece, self._buffer = self._buffer[:end], self._buffer[end:]
        if not self.calls[-1].arguments:
            piece = piece.lstrip()
        if piece:
            self.calls[-1].arguments += piece
            parsed.add(ParsedDelta(tool_calls=[ToolCallDelta(len(self.calls) - 1, arguments=piece)]))

    def _tail(self, parsed: ParsedDelta) -> bool:
        closed = self._buffer.find(TOOL_CALL_CLOSE)
        if closed < 0:
            return False
        self._buffer, self._state = self._buffer[closed + len(TOOL_CALL_CLOSE) :], "text"
        self.completed += 1
        self._after_call = True
        return True


def parse_delta(delta: ChoiceDelta, parser: ToolCallParser) -> None:
    """Split `delta`'s text (the next of its choice, which `parser` reads) into text and tool calls, in place; a
    choice that made calls and then stopped finishes with "tool_calls"."""
    parsed = parser.feed(delta.text)
    if delta.finish_reason is not None:
        parsed.add(parser.finish())
        if delta.finish_reason == "stop" and parser.calls:
            delta.finish_reason = "tool_calls"
    delta.text, delta.tool_calls = parsed.content, parsed.tool_calls


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], bool]:
    """A whole answer's (content, calls, whether every call was completed)."""
    parser = ToolCallParser()
    parsed = parser.feed(text)
    parsed.add(parser.finish())
    return parsed.content, parser.calls, parser.completed == len(parser.calls)
