"""Every field of OpenAI's chat and completions requests, as the installed `openai` package declares them, is in one
class: honoured by both engines, refused (400 `unsupported_parameter` naming it), or accepted only with values that
change nothing here. A field a newer `openai` adds fails `test_every_openai_field_is_classified` until it is
classified. vLLM's sampling extensions are honoured; any other field is refused as OpenAI refuses it."""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params as completions
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat
from pydantic import BaseModel
from transformers import AutoTokenizer

from server.api.inference.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
    Unsupported,
)
from server.db.models import ModelVersion
from server.engines.base import SamplingParams

HONOURED = "honoured"
REFUSED = "refused"


def no_op(*values: object) -> tuple[str, tuple[object, ...]]:
    """Accepted with these values only (they change nothing here), refused with any other."""
    return ("no-op", values)


SHARED = {
    "model": HONOURED,
    "frequency_penalty": HONOURED,
    "logit_bias": HONOURED,
    "logprobs": HONOURED,
    "max_tokens": HONOURED,
    "n": HONOURED,
    "presence_penalty": HONOURED,
    "seed": HONOURED,
    "stop": HONOURED,
    "stream": HONOURED,
    "stream_options": HONOURED,
    "temperature": HONOURED,
    "top_p": HONOURED,
    "user": REFUSED,
}
CHAT = {
    **SHARED,
    "messages": HONOURED,
    "max_completion_tokens": HONOURED,
    "top_logprobs": HONOURED,
    "audio": REFUSED,
    "function_call": REFUSED,
    "functions": REFUSED,
    "metadata": REFUSED,
    "moderation": REFUSED,
    "prediction": REFUSED,
    "prompt_cache_key": REFUSED,
    "prompt_cache_options": REFUSED,
    "prompt_cache_retention": REFUSED,
    "safety_identifier": REFUSED,
    # Structured outputs and tool calls, by constrained decoding (test_structured_outputs_api.py and the vLLM one).
    "response_format": HONOURED,
    "tool_choice": HONOURED,
    "tools": HONOURED,
    "parallel_tool_calls": HONOURED,
    "verbosity": REFUSED,
    "web_search_options": REFUSED,
    "modalities": no_op(["text"]),
    "reasoning_effort": no_op("none"),
    "service_tier": no_op("auto", "default"),
    "store": no_op(False),
}
COMPLETIONS = {**SHARED, "prompt": HONOURED, "echo": HONOURED, "best_of": no_op(1), "suffix": no_op("")}
STREAM_OPTIONS = {"include_usage": HONOURED, "include_obfuscation": no_op(False)}
MESSAGE = {
    "role": HONOURED,
    "content": HONOURED,
    "name": REFUSED,
    "audio": REFUSED,
    "function_call": REFUSED,
    "refusal": REFUSED,
    "tool_calls": HONOURED,
    "tool_call_id": HONOURED,
}
# vLLM's sampling extensions (lm-eval and guidellm send some): honoured by both engines.
VLLM_EXTENSIONS = {"top_k", "min_tokens", "repetition_penalty", "ignore_eos"}
VLLM_STREAM_OPTIONS = {"continuous_usage_stats"}

# A realistic value for each refused field, none of them a no-op.
REFUSED_VALUES = {
    "user": "analyst-17",
    "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto",
    "functions": [{"name": "lookup_case", "parameters": {"type": "object", "properties": {}}}],
    "metadata": {"team": "aml"},
    "moderation": {"model": "omni-moderation-latest"},
    "prediction": {"type": "content", "content": "Disposition: SAR"},
    "prompt_cache_key": "case-template-1",
    "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "hash-of-user",
    "verbosity": "low",
    "web_search_options": {},
    "modalities": ["text", "audio"],
    "reasoning_effort": "high",
    "service_tier": "flex",
    "store": True,
    "best_of": 3,
    "suffix": " end of case",
}
MESSAGES = [{"role": "user", "content": "Summarise case CASE-7."}]


def openai_fields(*typed_dicts: type) -> set[str]:
    return {name for typed_dict in typed_dicts for name in typing.get_type_hints(typed_dict)}


def classes(model: type[BaseModel]) -> dict[str, object]:
    """Our model's fields, each in its class as `Unsupported` markers declare it."""
    found: dict[str, object] = {}
    for name, field in model.model_fields.items():
        marker = next((item for item in field.metadata if isinstance(item, Unsupported)), None)
        if marker is None:
            found[name] = HONOURED
        else:
            found[name] = no_op(*marker.no_op) if marker.no_op else REFUSED
    return found


@pytest.mark.parametrize(
    ("params", "model", "expected", "extensions"),
    [
        (
            (chat.CompletionCreateParamsBase, chat.CompletionCreateParamsStreaming),
            ChatCompletionRequest,
            CHAT,
            VLLM_EXTENSIONS,
        ),
        (
            (completions.CompletionCreateParamsBase, completions.CompletionCreateParamsStreaming),
            CompletionRequest,
            COMPLETIONS,
            VLLM_EXTENSIONS,
        ),
        ((ChatCompletionStreamOptionsParam,), StreamOptions, STREAM_OPTIONS, VLLM_STREAM_OPTIONS),
        (typing.get_args(ChatCompletionMessageParam), ChatMessage, MESSAGE, set()),
    ],
    ids=["chat", "completions", "stream_options", "messages"],
)
def test_every_openai_field_is_classified(params, model, expected, extensions):
    assert openai_fields(*params) == set(expected), "classify the fields this openai version adds or drops"
    assert classes(model) == {**expected, **dict.fromkeys(extensions, HONOURED)}


def test_the_honoured_sampling_fields_reach_the_engines_parameters():
    request = CompletionRequest(
        model="m",
        prompt=[5, 6],
        n=2,
        stop=["\n"],
        temperature=0.7,
        top_p=0.9,
        seed=3,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={"12": -100, "13": 2.5},
        max_tokens=9,
        logprobs=2,
        echo=True,
        top_k=40,
        min_tokens=2,
        repetition_penalty=1.2,
        ignore_eos=True,
    )
    assert request.to_sampling_params(room=100) == SamplingParams(
        max_tokens=9,
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=3,
        stop=("\n",),
        logprobs=True,
        top_logprobs=2,
        prompt_logprobs=2,
        ignore_eos=True,
        min_tokens=2,
        logit_bias={12: -100.0, 13: 2.5},
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
    )
    defaults = ChatCompletionRequest(model="m", messages=MESSAGES).to_sampling_params(room=100)
    assert defaults == SamplingParams(max_tokens=100)  # OpenAI's defaults; the rest of the context
    assert CompletionRequest(model="m", prompt="x").to_sampling_params(room=100).max_tokens == 16
    assert CompletionRequest(model="m", prompt="x", top_k=-1).to_sampling_params(room=10).top_k == 0


# --- over HTTP ---------------------------------------------------------------------------------------------------


@pytest.fixture
def settings(settings):
    """No rate limits: these tests send many small requests with one key."""
    return settings.model_copy(update={"rate_limit_requests_per_minute": 0, "rate_limit_tokens_per_minute": 0})


@pytest.fixture
def model_name(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        session.add(ModelVersion(name="tiny", version=1, kind="full", path=str(tiny_model_dir)))
        session.commit()
    return "tiny"


ENDPOINTS = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES}, CHAT),
    "completions": ("/v1/completions", {"prompt": "Case CASE-7 Customer:"}, COMPLETIONS),
}


def post(live_server: str, auth, endpoint: str, **fields) -> httpx.Response:
    path, required, _ = ENDPOINTS[endpoint]
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, **required, **fields}
    return httpx.post(f"{live_server}{path}", json=body, headers=auth("analyst"), timeout=60)


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_refused_fields_are_400_unsupported_parameter_naming_them(live_server, auth, model_name, endpoint):
    _, _, fields = ENDPOINTS[endpoint]
    refused = [name for name, kind in fields.items() if kind != HONOURED]
    errors = {name: post(live_server, auth, endpoint, **{name: REFUSED_VALUES[name]}) for name in refused}
    assert {name: response.status_code for name, response in errors.items()} == dict.fromkeys(refused, 400)
    for name, response in errors.items():
        error = response.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error",
            "unsupported_parameter",
            name,
        )
        assert error["message"].startswith(f"Unsupported parameter: '{name}' is not supported"), error


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"messages": [{"role": "user", "content": "hi", "name": "ana"}]}, "messages[0].name"),
        (
            "chat",
            {"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
            "messages[0].function_call",
        ),
        (
            "chat",
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
    ],
)
def test_refused_nested_fields_name_their_path(live_server, auth, model_name, endpoint, fields, param):
    response = post(live_server, auth, endpoint, **fields)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("unsupported_parameter", param)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_no_op_values_and_nulls_change_nothing(live_server, auth, model_name, endpoint):
    _, _, fields = ENDPOINTS[endpoint]
    baseline = post(live_server, auth, endpoint).json()
    no_ops = [(name, value) for name, kind in fields.items() if kind not in (HONOURED, REFUSED) for value in kind[1]]
    for name, value in no_ops:
        answer = post(live_server, auth, endpoint, **{name: value})
        assert answer.status_code == 200, (name, value, answer.text)
        assert text_of(answer.json()) == text_of(baseline) and answer.json()["usage"] == baseline["usage"]
    # Every optional field null ("not given"), as some clients send them.
    optional = set(fields) - {"model", "messages", "prompt", "max_tokens", "temperature"}
    nulls = post(live_server, auth, endpoint, **dict.fromkeys(optional | VLLM_EXTENSIONS))
    assert nulls.status_code == 200, nulls.text
    assert text_of(nulls.json()) == text_of(baseline)


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"temperature_x": 1}, "temperature_x"),
        ("completions", {"best_of_n": 2}, "best_of_n"),
        ("chat", {"messages": [{"role": "user", "content": "hi", "weight": 0}]}, "messages[0].weight"),
        (
            "completions",
            {"stream": True, "stream_options": {"include_usage": True, "every": 1}},
            "stream_options.every",
        ),
        # vLLM's other extensions are not taken either.
        ("completions", {"min_p": 0.1}, "min_p"),
        ("chat", {"chat_template_kwargs": {}}, "chat_template_kwargs"),
    ],
)
def test_unknown_fields_are_refused_as_openai_refuses_them(live_server, auth, model_name, endpoint, fields, param):
    response = post(live_server, auth, endpoint, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == f"Unrecognized request argument supplied: {param}"
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ("completions", {"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
        ("completions", {"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the vocabulary
        ("completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("completions", {"presence_penalty": -3}, "presence_penalty"),
        ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("completions", {"top_k": -2}, "top_k"),
        ("completions", {"min_tokens": 7}, "min_tokens"),  # more than max_tokens
        ("completions", {"logprobs": 6}, "logprobs"),
    ],
)
def test_honoured_fields_are_checked(live_server, auth, model_name, endpoint, fields, param):
    response = post(live_server, auth, endpoint, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_sampling_fields_through_the_openai_client(live_server, keys, model_name, tiny_model_dir):
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key=keys["analyst"], max_retries=0, timeout=60)
    token = 77
    text = AutoTokenizer.from_pretrained(tiny_model_dir).decode([token])
    forced = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=5, temperature=0, logit_bias={str(token): 100}
    )
    assert forced.choices[0].message.content == text * 5
    plain = client.completions.create(model=model_name, prompt="Case", max_tokens=12, temperature=0)
    penalised = client.completions.create(
        model=model_name, prompt="Case", max_tokens=12, temperature=0, frequency_penalty=2.0
    )
    assert penalised.choices[0].text != plain.choices[0].text


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(live_server, auth, model_name):
    body = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST",
        f"{live_server}/v1/completions",
        json={"model": "tiny", "prompt": "Case", "max_tokens": 6, "temperature": 0, **body},
        headers=auth("analyst"),
    ) as response:
        events = [
            json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line and "[DONE]" not in line
        ]
    usages = [event["usage"] for event in events]
    assert all(usage is not None for usage in usages)
    completion_tokens = [usage["completion_tokens"] for usage in usages]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 6
    assert events[-1]["choices"] == [] and usages[-1]["total_tokens"] == usages[-1]["prompt_tokens"] + 6
