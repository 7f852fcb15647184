"""`response_format`, `tools` and `tool_choice` on the local engine, through the official `openai` client against a
real uvicorn: answers parse and match their schema, calls come back as OpenAI's `tool_calls`, whole and streamed.
(`test_vllm_structured_outputs.py` runs the same checks on the vLLM engine.)"""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from structured_helpers import (
    MESSAGES,
    TOOLS,
    build_tool_checkpoint,
    check_call,
    check_forced_calls,
    check_json_object_and_a_cut,
    check_parse_helper,
    check_refusals,
    check_round_trip,
    check_schema_answers,
    check_streamed_calls,
    refusal,
)

from server.api.inference.responses import ChatCompletion, ChatCompletionChunk
from server.db.models import ModelVersion

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tools-model")
    build_tool_checkpoint(directory)
    return directory


@pytest.fixture
def client(live_server, keys, sessions, model_dir) -> openai.OpenAI:
    """`zaya-random` (a tiny random model: noise unless constrained) behind a real server."""
    with sessions() as session:
        session.add(ModelVersion(name="zaya-random", version=1, kind="full", path=str(model_dir)))
        session.commit()
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key=keys["analyst"], max_retries=0, timeout=120)


def test_json_schema_answers_parse_and_match_whole_and_streamed(client):
    check_schema_answers(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_json_object_answers_are_objects_and_a_token_limit_cuts_with_length(client):
    check_json_object_and_a_cut(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_forced_tool_choices_call_with_arguments_matching_the_parameters(client):
    check_forced_calls(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_tool_calls_stream_as_openai_streams_them(client):
    check_streamed_calls(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_calls_and_results_go_back_into_the_conversation(client):
    check_round_trip(client, "zaya-random", max_tokens=MAX_TOKENS)


def test_what_cannot_be_constrained_is_refused_naming_the_field(client):
    check_refusals(client, "zaya-random")


def test_tool_choice_none_renders_the_tools_and_parses_no_calls(client, model_dir):
    """With "none" the prompt still lists the tools, and text that looks like a call stays text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with_tools = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, return_dict=True)
    answer = client.chat.completions.create(
        model="zaya-random", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=4, seed=1
    )
    assert answer.usage.prompt_tokens == len(with_tools["input_ids"])
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")


def test_a_model_whose_template_cannot_render_tools_refuses_them(client, sessions, model_dir, tmp_path):
    """A template that would drop the tools (older tokenizers) is refused, never answered without them."""
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    config_path = plain / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with sessions() as session:
        session.add(ModelVersion(name="zaya-plain", version=1, kind="full", path=str(plain)))
        session.commit()

    error = refusal(client, "zaya-plain", tools=TOOLS)
    assert error.body["param"] == "tools" and "does not render tools" in error.body["message"]
    history = [*MESSAGES, {"role": "tool", "tool_call_id": "call_1", "content": "{}"}]
    error = refusal(client, "zaya-plain", messages=history)
    assert error.body["param"] == "messages"
    # Without tools the model answers as before.
    assert client.chat.completions.create(model="zaya-plain", messages=MESSAGES, max_tokens=2).choices


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "tool", "content": "x"}, "messages[0]"),
        ({"role": "user", "content": "x", "tool_call_id": "call_1"}, "messages[0]"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_malformed_tool_messages_are_refused_naming_the_field(client, message, field):
    try:
        client.chat.completions.create(model="zaya-random", messages=[message], max_tokens=2)
    except openai.BadRequestError as error:
        assert error.body["param"] == field, error.body
    else:
        raise AssertionError("answered")


def test_tool_call_answers_and_events_are_exactly_the_declared_schemas(client, live_server, keys):
    """The stream is written without building its models: each event with tool calls must still parse as the declared
    chunk, with no field the schema lacks."""
    url, headers = f"{live_server}/v1/chat/completions", {"Authorization": f"Bearer {keys['analyst']}"}
    body = {"model": "zaya-random", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60}
    answer = httpx.post(url, json=body, headers=headers, timeout=120).json()
    assert ChatCompletion.model_validate(answer).model_dump(mode="json", exclude_unset=True) == answer
    assert answer["choices"][0]["message"]["tool_calls"]

    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=120) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    for line, payload in zip(lines, events, strict=False):
        assert ChatCompletionChunk.model_validate_json(line).model_dump(mode="json", exclude_unset=True) == payload
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert any(event["choices"][0]["delta"].get("tool_calls") for event in events)


def test_tool_choice_auto_answers_in_text_or_calls_whose_arguments_match(client):
    answers = client.chat.completions.create(
        model="zaya-random", messages=MESSAGES, tools=TOOLS, n=4, seed=9, max_tokens=MAX_TOKENS
    )
    for choice in answers.choices:
        calls = choice.message.tool_calls or []
        # A finished answer that called is "tool_calls"; one cut by max_tokens is "length" whatever it holds.
        assert choice.finish_reason in (("tool_calls", "length") if calls else ("stop", "length"))
        for call in calls if choice.finish_reason == "tool_calls" else []:
            check_call(call)


def test_the_openai_clients_parse_helper_gets_its_pydantic_model_back(client):
    check_parse_helper(client, "zaya-random", max_tokens=MAX_TOKENS)
