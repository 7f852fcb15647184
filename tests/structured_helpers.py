"""Structured outputs and tool calls through the official `openai` client, as the local and vLLM engines' API tests
both run them: every answer is checked against its schema (`jsonschema`), every tool call against its function's
parameters. The models are tiny random ones, which write noise unless the constraint holds them."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import openai
import pydantic
import torch
import xgrammar
from tiny_models import TINY_ZAYA, randomize_zaya

from zaya_model import ZayaConfig, ZayaForCausalLM
from zaya_model.pretrain.tokenizer import TOOL_CALL_INSTRUCTIONS, TOOLS_PREAMBLE, train_tokenizer

# What an analyst's tooling wants from a disposition.
DISPOSITION = {
    "type": "object",
    "properties": {
        "disposition": {"type": "string", "enum": ["escalate", "close", "monitor"]},
        "reasons": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "risk_score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["disposition", "reasons", "risk_score"],
    "additionalProperties": False,
}
DISPOSITION_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "disposition", "schema": DISPOSITION, "strict": True},
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
CLOSE_CASE = {
    "type": "function",
    "function": {
        "name": "close_case",
        "parameters": {
            "type": "object",
            "properties": {"reason": {"type": "string", "enum": ["false_positive", "resolved"]}},
            "required": ["reason"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [LOOKUP_CASE, CLOSE_CASE]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "Case CASE-7: two wires to a new payee. Your disposition?"}]
CONTEXT = 2048


def build_tool_checkpoint(path) -> None:
    """A tiny random ZAYA both engines serve (vLLM's CPU attention needs head_dim 32), with a tokenizer trained on
    this module's tools and schemas and the chat template's tool sections, so prompts with tools stay short."""
    texts = [
        TOOLS_PREAMBLE,
        TOOL_CALL_INSTRUCTIONS,
        *(json.dumps(tool) for tool in TOOLS),
        json.dumps(DISPOSITION_FORMAT),
        MESSAGES[0]["content"],
        json.dumps({"disposition": "escalate", "reasons": ["wires", "new payee"], "risk_score": 80}, indent=2),
    ]
    tokenizer = train_tokenizer(texts * 20, vocab_size=700)
    config = ZayaConfig(
        **{
            **TINY_ZAYA,
            "head_dim": 32,
            "max_position_embeddings": CONTEXT,
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
    )
    torch.manual_seed(0)
    randomize_zaya(ZayaForCausalLM(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)


def check_schema_answers(client: openai.OpenAI, model: str, *, max_tokens: int) -> None:
    """Sampled answers under a JSON schema all parse and match it, whole and streamed alike."""
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, response_format=DISPOSITION_FORMAT, n=4, seed=1, max_tokens=max_tokens
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), DISPOSITION)
        assert choice.message.tool_calls is None

    chunks = client.chat.completions.create(
        model=model, messages=MESSAGES, response_format=DISPOSITION_FORMAT, seed=1, max_tokens=max_tokens, stream=True
    )
    texts, finishes = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert finishes == {0: "stop"}
    assert texts[0] == answer.choices[0].message.content  # the same seed: the first choice again


class Disposition(pydantic.BaseModel):
    disposition: Literal["escalate", "close", "monitor"]
    reasons: list[Annotated[str, pydantic.Field(max_length=12)]] = pydantic.Field(min_length=1, max_length=3)


def check_parse_helper(client: openai.OpenAI, model: str, *, max_tokens: int) -> None:
    """`client.chat.completions.parse` sends a strict schema made from a pydantic model and parses the answer into
    it: what analysts' tooling writes."""
    answer = client.chat.completions.parse(
        model=model, messages=MESSAGES, response_format=Disposition, seed=10, max_tokens=max_tokens
    )
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(answer.choices[0].message.parsed, Disposition)


def check_json_object_and_a_cut(client: openai.OpenAI, model: str, *, max_tokens: int) -> None:
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, response_format={"type": "json_object"}, n=3, seed=2, max_tokens=max_tokens
    )
    for choice in whole.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # a random model's object may never end (its keys are free text): the start of one, as far as it went
            assert choice.finish_reason == "length" and starts_json_object(choice.message.content)
    # Cut by max_tokens: OpenAI's "length", with the text as far as it went.
    cut = client.chat.completions.create(
        model=model, messages=MESSAGES, response_format=DISPOSITION_FORMAT, seed=3, max_tokens=4
    )
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4
    assert cut.choices[0].message.content.strip()[:1] in ("", "{")


def check_forced_calls(client: openai.OpenAI, model: str, *, max_tokens: int) -> None:
    """A named function is called exactly once; "required" makes at least one call, one with parallel calls off."""
    named = {"type": "function", "function": {"name": "close_case"}}
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, n=3, seed=4, max_tokens=max_tokens
    )
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        check_call(call, "close_case")

    single = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=3,
        seed=5,
        max_tokens=max_tokens,
    )
    for choice in single.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def check_streamed_calls(client: openai.OpenAI, model: str, *, max_tokens: int) -> None:
    """Streamed as OpenAI streams calls: each call's first piece has its index, id, type and name, the later ones
    argument fragments only; put together they are the whole answer's calls (same seed)."""
    request = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=6, max_tokens=max_tokens)
    whole = client.chat.completions.create(**request).choices[0]
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(**request, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    assert finish == "tool_calls" == whole.finish_reason
    assert content == (whole.message.content or "")
    assert [(call["name"], call["arguments"]) for call in calls.values()] == [
        (call.function.name, call.function.arguments) for call in whole.message.tool_calls
    ]
    for call in whole.message.tool_calls:
        check_call(call)


def check_round_trip(client: openai.OpenAI, model: str, *, max_tokens: int) -> None:
    """The answer's calls and the tools' results go back into the conversation, and the model answers them."""
    first = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=7, max_tokens=max_tokens
    )
    message = first.choices[0].message
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"status": "open", "wires": 2})}
        for call in message.tool_calls
    ]
    conversation = [*MESSAGES, message.model_dump(exclude_none=True), *results]
    final = client.chat.completions.create(
        model=model,
        messages=conversation,
        tools=TOOLS,
        tool_choice="none",
        response_format=DISPOSITION_FORMAT,
        seed=8,
        max_tokens=max_tokens,
    )
    choice = final.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    jsonschema.validate(json.loads(choice.message.content), DISPOSITION)
    # The history (calls and results) and the tools are in the prompt: it is longer than without them.
    bare = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    assert final.usage.prompt_tokens > bare.usage.prompt_tokens + 50


def starts_json_object(text: str) -> bool:
    """Whether `text` is the start of a JSON object, by xgrammar's own JSON grammar over its bytes."""
    vocabulary = [bytes([byte]) for byte in range(256)] + [b"<end>"]
    info = xgrammar.TokenizerInfo(vocabulary, vocab_type=xgrammar.VocabType.RAW, stop_token_ids=[256])
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema('{"type": "object"}'))
    return all(matcher.accept_token(byte) for byte in text.encode())


def check_call(call, name: str | None = None) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def refusal(client: openai.OpenAI, model: str, **fields) -> openai.BadRequestError:
    """The 400 a request with `fields` gets (raises if it is answered)."""
    try:
        client.chat.completions.create(**{"model": model, "messages": MESSAGES, "max_tokens": 4, **fields})
    except openai.BadRequestError as error:
        return error
    raise AssertionError(f"{fields} was answered")


def check_refusals(client: openai.OpenAI, model: str) -> None:
    """What constrained decoding cannot do is refused naming the field, never answered unconstrained."""
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},)
        + ("response_format", "frob"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"multipleOf": 5}}}},
            "response_format",
            "multipleOf",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "drop"}}}, "tool_choice", "drop"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "",
        ),
        ({"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 2}}, "min_tokens", ""),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", ""),
    ]
    for fields, param, words in cases:
        error = refusal(client, model, **fields)
        assert error.status_code == 400 and error.body["param"].startswith(param), (fields, error.body)
        assert words in error.body["message"], (fields, error.body)
