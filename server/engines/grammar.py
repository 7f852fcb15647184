"""Constrained decoding: a choice's text held to a grammar, with xgrammar in both engines.

An `OutputGrammar` is what a request asks the text to be: JSON matching a schema (`response_format`), or tool calls
in the chat template's format (`tools` with `tool_choice`), written as one xgrammar structural tag. It is plain data,
checked against xgrammar when it is made, so a grammar xgrammar cannot compile or would not enforce is refused before
any engine sees it. The vLLM engine hands the tag to vLLM's structured-output backend (xgrammar); the local engine
compiles it here for the model's tokenizer and masks each constrained row's logits before sampling
(`GrammarMatcher`): one language, whichever engine serves the request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

# Tool calls are written as in Qwen/Hermes-style chat templates (ours among them):
#   <tool_call>\n{"name": "<name>", "arguments": <JSON object>}\n</tool_call>
# xgrammar's "qwen_3" structural tag describes exactly this format; the chat template renders past calls the same way.
TOOL_CALL_FORMAT = "qwen_3"
# Whitespace JSON may have between two tokens, in characters: enough for indented output, and a model that would
# write whitespace for ever (a small model, greedy) must write JSON after this many.
MAX_WHITESPACE_RUN = 16
# Compiling a schema costs more the deeper it nests; vLLM refuses schemas nested deeper than 64 levels.
MAX_SCHEMA_NESTING = 64

# The string formats xgrammar enforces; it ignores any other.
_STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)

# Where JSON Schema nests schemas: maps of name -> schema, lists of schemas, and single schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
_SCHEMA_VALUES = frozenset(
    {
        "items",
        "additionalProperties",
        "additionalItems",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "propertyNames",
    }
)

# A character a JSON string holds unescaped (no quote, backslash or control character), as a regex class of code
# point ranges: xgrammar turns such ranges into well-formed UTF-8 only, where a negated class or `.` would also let
# through overlong and surrogate byte sequences (each decodes to replacement characters, breaking length bounds).
_UNESCAPED_CHARACTER = r"[ !#-\[\]-\x7F\u0080-\uD7FF\uE000-\U0010FFFF]"

# xgrammar's C++ errors start with "[time] file.cc:line: ": the client gets the message after it.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarError(ValueError):
    """A grammar xgrammar cannot build; `param` names the request field it came from."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class OutputGrammar:
    """The language a choice's text must belong to, as an xgrammar structural tag (JSON text)."""

    structural_tag: str
    param: str  # the request field it came from, for errors

    @classmethod
    def json_object(cls) -> OutputGrammar:
        """Any JSON object (`response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> OutputGrammar:
        """JSON matching `schema` (`response_format: {"type": "json_schema", ...}`)."""
        from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag

        _check_enforceable(schema, "response_format.json_schema.schema", "response_format")
        content = JSONSchemaFormat(
            json_schema=_length_bounds_as_patterns(schema), max_whitespace_cnt=MAX_WHITESPACE_RUN
        )
        return cls._checked(StructuralTag(format=content), "response_format")

    @classmethod
    def tool_calls(
        cls,
        tools: list[dict[str, Any]],
        tool_choice: Literal["none", "auto", "required"] | dict[str, Any],
        *,
        parallel: bool,
    ) -> OutputGrammar:
        """Text with tool calls for `tools` (OpenAI's function tools): under `tool_choice` "auto" free text where any
        call's arguments match its function's parameters, "required" at least one call, a named function exactly
        one call of it. With `parallel` false, at most one call."""
        import xgrammar

        for index, tool in enumerate(tools):
            _check_enforceable(tool["function"].get("parameters"), f"tools[{index}].function.parameters", "tools")
        try:
            tag = xgrammar.get_model_structural_tag(
                TOOL_CALL_FORMAT,
                tools=[_enforced_tool(tool) for tool in tools],
                tool_choice=tool_choice,
                reasoning="disabled",
                exclude_special_tokens=False,
                max_whitespace_cnt=MAX_WHITESPACE_RUN,
                parallel_tool_calls=parallel,
            )
        except ValueError as error:
            raise GrammarError(f"tools: {_message(error)}", param="tools") from error
        return cls._checked(tag, "tools")

    @classmethod
    def _checked(cls, tag: xgrammar.StructuralTag, param: str) -> OutputGrammar:
        import xgrammar

        try:
            xgrammar.Grammar.from_structural_tag(tag)
        except (RuntimeError, ValueError, TypeError) as error:
            raise GrammarError(f"{param}: {_message(error)}", param=param) from error
        return cls(tag.model_dump_json(), param)


def _check_enforceable(schema: Any, path: str, param: str) -> None:
    if _nesting(schema) > MAX_SCHEMA_NESTING:
        raise GrammarError(f"{path} nests objects and arrays more than {MAX_SCHEMA_NESTING} deep.", param=param)
    where = _unenforced_keyword(schema, path)
    if where is not None:
        raise GrammarError(f"{where} cannot be enforced by constrained decoding; remove it.", param=param)


def _nesting(document: Any) -> int:
    """How deep objects and arrays nest in a JSON document (counted without recursion: any depth is measured)."""
    depth, level = 0, [document]
    while level := [
        child
        for node in level
        if isinstance(node, dict | list)
        for child in (node.values() if isinstance(node, dict) else node)
    ]:
        depth += 1
    return depth


def _enforced_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool with its parameters always enforced: xgrammar would leave arguments of a `strict: false` function
    unconstrained JSON, and a function without parameters takes none (as OpenAI defines it)."""
    function = {key: value for key, value in tool["function"].items() if key != "strict"}
    parameters = function.get("parameters")
    function["parameters"] = _length_bounds_as_patterns(parameters or {"type": "object", "properties": {}})
    return {**tool, "function": function}


def _length_bounds_as_patterns(schema: Any) -> Any:
    """`schema` with each string length bound written as a `pattern` of the same length.

    xgrammar 0.2.8 compiles `minLength`/`maxLength` into a production that admits raw control characters, which is
    invalid JSON (xgrammar issue #800); the pattern admits one character of `_UNESCAPED_CHARACTER` per character of
    the value (so a bounded string holds no quote, backslash or control character). A bounded string with a pattern
    or format of its own is refused earlier (`_unenforced_keyword`)."""
    if not isinstance(schema, dict):
        return schema
    rewritten = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _length_bounds_as_patterns(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_length_bounds_as_patterns(sub) for sub in value]
        elif key in _SCHEMA_VALUES:
            value = _length_bounds_as_patterns(value)
        rewritten[key] = value
    bounds = {key: schema[key] for key in ("minLength", "maxLength") if key in schema}
    if bounds and "pattern" not in schema and all(type(bound) is int and bound >= 0 for bound in bounds.values()):
        for key in bounds:
            del rewritten[key]
        low, high = bounds.get("minLength", 0), bounds.get("maxLength", "")
        rewritten["pattern"] = f"^{_UNESCAPED_CHARACTER}{{{low},{high}}}$"
    return rewritten


def _message(error: Exception) -> str:
    text = str(error).strip()
    return _LOCATION.sub("", text.splitlines()[0]) if text else type(error).__name__


def _unenforced_keyword(schema: Any, path: str) -> str | None:
    """The first place in `schema` that uses a keyword xgrammar accepts without enforcing it (it drops the keyword,
    or generates text outside the schema in that combination), as a path; None if there is none."""
    if not isinstance(schema, dict):
        return None
    length_bound = bool({"minLength", "maxLength"} & schema.keys())
    unenforced = {
        "multipleOf": "multipleOf" in schema,
        "uniqueItems": schema.get("uniqueItems") is True,
        "contains": bool({"contains", "minContains", "maxContains"} & schema.keys()),
        "format": "format" in schema and (schema["format"] not in _STRING_FORMATS or length_bound),
        "pattern": "pattern" in schema and length_bound,
        "propertyNames": "propertyNames" in schema
        and bool({"properties", "patternProperties", "unevaluatedProperties"} & schema.keys()),
        "patternProperties": isinstance(schema.get("patternProperties"), dict)
        and ("properties" in schema or len(schema["patternProperties"]) > 1),
        "allOf": isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1,
        # Branches are treated as anyOf's: text matching two of them gets through.
        "oneOf": isinstance(schema.get("oneOf"), list) and len(schema["oneOf"]) > 1,
        "not": "not" in schema,
        "if": bool({"if", "then", "else"} & schema.keys()),
        "dependentRequired": "dependentRequired" in schema,
        "dependentSchemas": "dependentSchemas" in schema,
    }
    keyword = next((keyword for keyword, found in unenforced.items() if found), None)
    if keyword is not None:
        return f"{path}.{keyword}"
    return next(filter(None, (_unenforced_keyword(sub, where) for where, sub in _subschemas(schema, path))), None)


def _subschemas(schema: dict[str, Any], path: str) -> list[tuple[str, Any]]:
    """The schemas nested in `schema`, with their paths."""
    nested = []
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            nested += [(f"{path}.{key}.{name}", sub) for name, sub in value.items()]
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            nested += [(f"{path}.{key}[{index}]", sub) for index, sub in enumerate(value)]
        elif key in _SCHEMA_VALUES:
            nested.append((f"{path}.{key}", value))
    return nested


class GrammarCompiler:
    """Compiles `OutputGrammar`s for one tokenizer (xgrammar caches compiled grammars). Thread-safe."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, grammar: OutputGrammar) -> xgrammar.CompiledGrammar:
        """Slow for large schemas: call it off the event loop and off the compute thread."""
        try:
            return self._compiler.compile_structural_tag(grammar.structural_tag)
        except (RuntimeError, ValueError, TypeError) as error:
            raise GrammarError(f"{grammar.param}: {_message(error)}", param=grammar.param) from error


class GrammarMatcher:
    """One choice's place in its grammar: masks the next token's logits to what the grammar allows (end-of-sequence
    tokens only once the grammar is complete), and advances with each sampled token."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] with every token the grammar forbids at -inf (a new tensor)."""
        import xgrammar

        masked = logits.float().clone()
        self._matcher.fill_next_token_bitmask(self._bitmask)
        xgrammar.apply_token_bitmask_inplace(masked, self._bitmask[0])
        return masked

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it (the matcher stays where it was)."""
        return bool(self._matcher.accept_token(token))
