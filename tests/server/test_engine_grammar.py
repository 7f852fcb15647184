"""Constrained decoding (`server.engines.grammar`) and the local engine holding choices to a grammar.

The model is a tiny random one: left to itself it writes noise, so every choice that parses and matches its schema is
the grammar's doing. Sampled at temperature 1 with several seeds, the choices wander over the schema's whole language.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import xgrammar
from transformers import AutoTokenizer

from server.engines.base import EngineError, EngineFailure, ModelRef, SamplingParams, end_of_sequence_ids
from server.engines.grammar import GrammarCompiler, GrammarError, OutputGrammar
from server.engines.local import LocalEngine
from server.settings import LocalEngineSettings

EAGER = LocalEngineSettings(compile=False)
DISPOSITION = {
    "type": "object",
    "properties": {
        "disposition": {"type": "string", "enum": ["escalate", "close", "monitor"]},
        "reasons": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "risk_score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["disposition", "reasons", "risk_score"],
    "additionalProperties": False,
}
LOOKUP_CASE = {
    "type": "function",
    "function": {
        "name": "lookup_case",
        "description": "Fetch a case file.",
        "parameters": {
            "type": "object",
            "properties": {"case_id": {"type": "string", "pattern": "^CASE-[0-9]{1,3}$"}, "full": {"type": "boolean"}},
            "required": ["case_id", "full"],
            "additionalProperties": False,
        },
    },
}
TOOL_CALL = re.compile(
    r'<tool_call>\n\{"name": "(?P<name>[^"]+)", "arguments": (?P<arguments>.*)\}\n</tool_call>', re.S
)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return ModelRef("mv-random", tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(tiny_model_dir) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny_model_dir).encode("Case CASE-7: dispose of it", add_special_tokens=False)


async def choices(engine, base, prompt, params) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice."""
    texts, finishes = [""] * params.n, [""] * params.n
    async for delta in engine.generate(base, prompt, params):
        texts[delta.index] += delta.text
        finishes[delta.index] = delta.finish_reason or finishes[delta.index]
    return list(zip(texts, finishes, strict=True))


def sample(base, prompt, grammar, *, n=8, max_tokens=200, seeds=(1, 2), greedy_too=False) -> list[tuple[str, str]]:
    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            runs = [SamplingParams(max_tokens=max_tokens, n=n, seed=seed, grammar=grammar) for seed in seeds]
            if greedy_too:
                runs.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar))
            results = await asyncio.gather(*(choices(engine, base, prompt, params) for params in runs))
            return [choice for result in results for choice in result]
        finally:
            await engine.close()

    return asyncio.run(scenario())


def test_every_choice_is_json_matching_the_schema(base, prompt):
    outputs = sample(base, prompt, OutputGrammar.json_schema(DISPOSITION))
    assert len(outputs) == 16
    for text, finish in outputs:
        assert finish == "stop", text  # the grammar's language is finite here: each choice completes it
        jsonschema.validate(json.loads(text), DISPOSITION)
    assert len({json.loads(text)["disposition"] for text, _ in outputs}) > 1  # sampled, not one fixed answer


def test_json_object_gives_an_object_and_a_token_limit_cuts_it_with_length(base, prompt):
    outputs = sample(base, prompt, OutputGrammar.json_object(), n=6, max_tokens=8, greedy_too=True)
    for text, finish in outputs:
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens, as it was generated: a prefix of an object, which xgrammar's matcher accepts
            matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(_byte_info()).compile_builtin_json_grammar())
            assert finish == "length" and text.lstrip().startswith("{") and matcher.accept_string(text), text
    assert "length" in {finish for _, finish in outputs}


def test_a_forced_tool_call_is_one_call_with_arguments_matching_the_parameters(base, prompt):
    grammar = OutputGrammar.tool_calls(
        [LOOKUP_CASE], {"type": "function", "function": {"name": "lookup_case"}}, parallel=True
    )
    for text, finish in sample(base, prompt, grammar):
        assert finish == "stop"
        call = TOOL_CALL.fullmatch(text)
        assert call and call["name"] == "lookup_case", text
        jsonschema.validate(json.loads(call["arguments"]), LOOKUP_CASE["function"]["parameters"])


def test_constrained_and_free_choices_share_a_batch_without_touching_each_other(base, prompt):
    """The mask is per sequence: a free choice sampled beside constrained ones equals the same choice alone."""
    free = SamplingParams(max_tokens=12, seed=5)
    constrained = SamplingParams(max_tokens=30, n=3, seed=6, grammar=OutputGrammar.json_schema(DISPOSITION))

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            alone = await choices(engine, base, prompt, free)
            beside, held = await asyncio.gather(
                choices(engine, base, prompt, free), choices(engine, base, prompt, constrained)
            )
            return alone, beside, held
        finally:
            await engine.close()

    alone, beside, held = asyncio.run(scenario())
    assert beside == alone
    assert all(text.lstrip().startswith("{") for text, _ in held)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "frobnicate"}, 'Unsupported type "frobnicate"'),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "object", "minProperties": 2}, "minProperties"),
    ],
)
def test_a_schema_xgrammar_cannot_compile_is_refused_naming_response_format(schema, message):
    with pytest.raises(GrammarError) as refused:
        OutputGrammar.json_schema(schema)
    assert refused.value.param == "response_format" and message in refused.value.message
    assert not refused.value.message.startswith("response_format: [")  # xgrammar's log prefix is cut


# Each keyword with a schema using it and a JSON text outside that schema which xgrammar nevertheless accepts: the
# reason it is refused. When an xgrammar release enforces one, its case fails here and the refusal can go.
UNENFORCED = [
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "7"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]"),
    ("format", {"type": "string", "format": "regex"}, '"("'),
    ("pattern", {"type": "string", "pattern": "^a+$", "maxLength": 3}, '"aaaaaa"'),
    ("allOf", {"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, '"maybe"'),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "3"),
    ("not", {"type": "integer", "not": {"const": 3}}, "3"),
    ("if", {"if": {"type": "integer"}, "then": {"minimum": 5}}, "3"),
    ("dependentRequired", {"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
]


@pytest.mark.parametrize(("keyword", "schema", "outside"), UNENFORCED, ids=[case[0] for case in UNENFORCED])
def test_keywords_xgrammar_does_not_enforce_are_refused_wherever_they_nest(keyword, schema, outside):
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(_byte_info()).compile_json_schema(json.dumps(schema)))
    assert matcher.accept_string(outside)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(outside), schema, format_checker=jsonschema.FormatChecker())

    nested = {"type": "object", "properties": {"format": {"type": "array", "items": {"anyOf": [schema]}}}}
    with pytest.raises(GrammarError) as refused:
        OutputGrammar.json_schema(nested)
    assert f"schema.properties.format.items.anyOf[0].{keyword}" in refused.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": nested}}
    with pytest.raises(GrammarError) as refused:
        OutputGrammar.tool_calls([tool], "auto", parallel=True)
    assert refused.value.param == "tools" and "tools[0].function.parameters" in refused.value.message


def test_a_property_named_like_a_keyword_is_not_a_keyword():
    OutputGrammar.json_schema({"type": "object", "properties": {"format": {"type": "string"}, "not": {}}})


def test_tool_choices_naming_no_given_tool_are_refused_naming_tools():
    with pytest.raises(GrammarError) as refused:
        OutputGrammar.tool_calls([LOOKUP_CASE], {"type": "function", "function": {"name": "drop_table"}}, parallel=True)
    assert refused.value.param == "tools" and "drop_table" in refused.value.message


def test_the_engine_reports_a_grammar_it_cannot_compile_for_the_model_as_a_request_error(base, prompt):
    broken = OutputGrammar(
        '{"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": "frobnicate"}}}',
        "response_format",
    )

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            await anext(engine.generate(base, prompt, SamplingParams(max_tokens=4, grammar=broken)))
        finally:
            await engine.close()

    with pytest.raises(EngineError) as refused:
        asyncio.run(scenario())
    assert refused.value.param == "response_format"


def test_the_compiler_stops_only_at_the_models_end_of_sequence_tokens(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    stop_ids = sorted(end_of_sequence_ids(tokenizer))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), stop_ids)
    matcher = xgrammar.GrammarMatcher(compiler.compile(OutputGrammar.json_object()))
    assert matcher.stop_token_ids == stop_ids


def _byte_info() -> xgrammar.TokenizerInfo:
    """A vocabulary of the printable ASCII characters, one token each, and an end token."""
    return xgrammar.TokenizerInfo([chr(code) for code in range(32, 127)] + ["<end>"], stop_token_ids=[95])


def test_a_schema_nested_too_deep_is_refused_before_it_is_walked():
    schema: dict = {"type": "string"}
    for _ in range(5000):  # deeper than Python's recursion limit
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError) as refused:
        OutputGrammar.json_schema(schema)
    assert refused.value.param == "response_format" and "more than 64 deep" in refused.value.message


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        (b'"abc"', True),
        ('"caf\u00e9 \u20ac"'.encode(), True),
        (b'"abcdefg"', False),  # longer than maxLength
        (b'"a\x01b"', False),  # a raw control character: not JSON (xgrammar's own maxLength production takes it)
        # Malformed UTF-8, which decodes to replacement characters: a UTF-16 surrogate's bytes, an overlong form.
        (b'"a\xed\xa0\x80b"', False),
        (b'"a\xe0\x80\x9cb"', False),
    ],
)
def test_length_bounded_strings_hold_well_formed_characters_that_need_no_escape(text, accepted):
    vocabulary = [bytes([byte]) for byte in range(256)] + [b"<end>"]
    info = xgrammar.TokenizerInfo(vocabulary, vocab_type=xgrammar.VocabType.RAW, stop_token_ids=[256])
    grammar = OutputGrammar.json_schema({"type": "string", "maxLength": 6})
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_structural_tag(grammar.structural_tag))
    assert (all(matcher.accept_token(byte) for byte in text) and matcher.accept_token(256)) == accepted


def test_a_grammar_that_contradicts_its_mask_fails_its_request_only(base, prompt, monkeypatch):
    """Should xgrammar refuse a token its own mask allowed, that request fails and the batch goes on."""
    monkeypatch.setattr(xgrammar.GrammarMatcher, "accept_token", lambda self, token: False)
    free = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    constrained = SamplingParams(max_tokens=12, n=2, seed=6, grammar=OutputGrammar.json_object())

    async def scenario():
        engine = LocalEngine(EAGER)
        try:
            return await asyncio.gather(
                choices(engine, base, prompt, free), choices(engine, base, prompt, constrained), return_exceptions=True
            )
        finally:
            await engine.close()

    answered, failed = asyncio.run(scenario())
    assert answered == [(answered[0][0], "length")] and isinstance(failed, EngineFailure)
    assert "grammar refused" in failed.message
