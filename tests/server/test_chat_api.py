"""`/v1/chat/completions` and `/v1/completions` through the official `openai` client against a real uvicorn."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from sqlalchemy import event, select
from transformers import AutoTokenizer

from finetune.bootstrap import build_tiny_model
from server.api.inference.responses import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk
from server.db.models import AuditLog, File, FineTuningJob, InferenceRecord, JobStatus, ModelAlias, ModelVersion
from server.engines.base import end_of_sequence_ids
from zaya_model import ZayaForCausalLM

MESSAGES = [{"role": "user", "content": "Summarise case CASE-7 for the investigations queue."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("chat") / "tiny", train_steps=8)


@pytest.fixture
def version_id(sessions, model_dir) -> str:
    """`zaya-tiny` v1, aliased `production`."""
    with sessions() as session:
        version = ModelVersion(name="zaya-tiny", version=1, kind="full", path=str(model_dir))
        session.add(version)
        session.flush()
        session.add(ModelAlias(model_name="zaya-tiny", alias="production", version_id=version.id))
        session.commit()
        return version.id


@pytest.fixture
def client(live_server, keys, version_id) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key=keys["analyst"], max_retries=0, timeout=60)


def records(sessions) -> list[InferenceRecord]:
    with sessions() as session:
        return list(session.scalars(select(InferenceRecord).order_by(InferenceRecord.id)))


def test_chat_completion_has_openai_shape_usage_and_an_inference_record(client, sessions, version_id, make_key):
    response = client.chat.completions.create(model="zaya-tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == "zaya-tiny"
    choice = response.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 10 and 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0  # the local engine keeps no prefix cache

    [record] = records(sessions)
    assert record.endpoint == "chat.completions" and record.model_version_id == version_id
    assert record.api_key_id is not None and record.status_code == 200
    assert (record.prompt_tokens, record.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)


def test_streaming_matches_the_whole_answer_and_reports_usage_last(client):
    whole = client.chat.completions.create(model="zaya-tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="zaya-tiny",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(chunk.usage is None for chunk in chunks[:-1])


@pytest.mark.parametrize(
    ("path", "fields", "whole", "chunk"),
    [
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2},
            ChatCompletion,
            ChatCompletionChunk,
        ),
        ("/v1/completions", {"prompt": "Case", "logprobs": 2}, Completion, CompletionChunk),
    ],
)
def test_answers_and_streamed_events_are_exactly_the_declared_schemas(
    live_server, keys, version_id, path, fields, whole, chunk
):
    """The stream is written without building its models: every event must still parse as the declared chunk, with
    no field the schema lacks."""
    url, headers = f"{live_server}{path}", {"Authorization": f"Bearer {keys['analyst']}"}
    body = {"model": "zaya-tiny", "max_tokens": 5, "n": 2, "temperature": 0, **fields}
    answer = httpx.post(url, json=body, headers=headers).json()
    assert whole.model_validate(answer).model_dump(mode="json", exclude_unset=True) == answer

    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=stream_body, headers=headers) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    for line, payload in zip(lines, events, strict=False):
        assert chunk.model_validate_json(line).model_dump(mode="json", exclude_unset=True) == payload
    assert events[-1]["choices"] == [] and events[-1]["usage"] == answer["usage"]
    for whole_choice in answer["choices"]:
        index = whole_choice["index"]
        parts = [choice for payload in events for choice in payload["choices"] if choice["index"] == index]
        if chunk is ChatCompletionChunk:
            assert "".join(part["delta"].get("content", "") for part in parts) == whole_choice["message"]["content"]
        else:
            assert "".join(part["text"] for part in parts) == whole_choice["text"]


def test_openapi_declares_the_answers_and_the_streamed_chunks(live_server, keys):
    document = httpx.get(f"{live_server}/openapi.json", headers={"Authorization": f"Bearer {keys['analyst']}"}).json()
    for path, whole, chunk in (
        ("/v1/chat/completions", "ChatCompletion", "ChatCompletionChunk"),
        ("/v1/completions", "Completion", "CompletionChunk"),
    ):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"] == {"$ref": f"#/components/schemas/{whole}"}
        assert content["text/event-stream"]["schema"] == {"$ref": f"#/components/schemas/{chunk}"}
        assert {whole, chunk} <= set(document["components"]["schemas"])


def test_concurrent_requests_reuse_the_read_pool_and_each_leaves_its_record_and_audit_entry(
    client, app, sessions, version_id
):
    """The request path's reads keep `database_pool_size` connections open: bursts of requests reuse them instead of
    opening and closing connections per request (each a new server process on PostgreSQL)."""

    def complete(_) -> None:
        client.completions.create(model="zaya-tiny", prompt="Case", max_tokens=2)

    def burst(requests: int) -> None:
        with ThreadPoolExecutor(requests) as pool:
            list(pool.map(complete, range(requests)))

    closed = []
    event.listen(app.state.read_engine.pool, "close", lambda *_: closed.append(1))
    burst(16)
    burst(16)
    assert closed == []
    assert len(records(sessions)) == 32
    with sessions() as session:
        entries = session.scalars(select(AuditLog).where(AuditLog.action == "completions")).all()
    assert len(entries) == 32 and {entry.status_code for entry in entries} == {200}


def test_the_sse_stream_ends_with_done(live_server, keys, version_id):
    body = {"model": "zaya-tiny", "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", f"{live_server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {keys['analyst']}"}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert "usage" not in json.loads(lines[0].removeprefix("data: "))


def test_n_choices_with_a_seed_are_reproducible(client):
    def sample():
        response = client.chat.completions.create(
            model="zaya-tiny", messages=MESSAGES, max_tokens=10, n=3, seed=42, temperature=1.0
        )
        return [choice.message.content for choice in sorted(response.choices, key=lambda c: c.index)]

    first, second = sample(), sample()
    assert first == second and len(set(first)) > 1


def test_stop_strings_spanning_chunks_cut_the_stream_cleanly(client):
    reference = client.chat.completions.create(model="zaya-tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    text = reference.choices[0].message.content
    stop = text[5:11]
    stream = client.chat.completions.create(
        model="zaya-tiny", messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop], stream=True
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == text[: text.index(stop)]
    assert all(stop not in piece for piece in pieces)


def test_chat_logprobs_and_top_logprobs(client):
    response = client.chat.completions.create(
        model="zaya-tiny", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


def test_text_completions_plain_streamed_and_with_logprobs(client):
    prompt = "Case CASE-2025-00049\nCustomer:"
    whole = client.completions.create(model="zaya-tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    choice = whole.choices[0]
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert whole.usage.completion_tokens <= 6
    streamed = client.completions.create(
        model="zaya-tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == choice.text
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def ending_model(model_dir, path):
    """`model_dir` with output rows that make an end-of-sequence token the greedy choice at every step: the rows of
    two of them are v and -v, every other row 0, so one of the two has the largest logit, |h.v|."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first, second = sorted(end_of_sequence_ids(tokenizer))[:2]
    model = ZayaForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        direction = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0))
        weight.zero_()
        weight[first], weight[second] = direction, -direction
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_ignore_eos_generates_exactly_max_tokens_past_the_end_of_sequence(client, sessions, model_dir, tmp_path):
    with sessions() as session:
        session.add(ModelVersion(name="zaya-ends", version=1, kind="full", path=str(ending_model(model_dir, tmp_path))))
        session.commit()
    limit = 24
    ended = client.chat.completions.create(model="zaya-ends", messages=MESSAGES, max_tokens=limit, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    extra = {"ignore_eos": True}
    whole = client.chat.completions.create(
        model="zaya-ends", messages=MESSAGES, max_tokens=limit, temperature=0, extra_body=extra
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == limit
    assert whole.choices[0].message.content == ""  # end-of-sequence tokens are never shown
    streamed = list(
        client.completions.create(
            model="zaya-ends",
            prompt="Summarise case CASE-7",
            max_tokens=limit,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    assert streamed[-1].usage.completion_tokens == limit
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["length"]


def test_model_strings_resolve_by_alias_version_and_fine_tuned_name(client, sessions, version_id, model_dir):
    with sessions() as session:
        newer = ModelVersion(name="zaya-tiny", version=2, kind="full", path=str(model_dir))
        session.add(newer)
        session.flush()
        session.add(ModelAlias(model_name="zaya-tiny", alias="staging", version_id=newer.id))
        training_file = File(filename="train.jsonl", purpose="fine-tune", bytes=1, sha256="0" * 64)
        session.add(training_file)
        session.flush()
        job = FineTuningJob(
            model="zaya-tiny",
            training_file_id=training_file.id,
            status=JobStatus.succeeded,
            fine_tuned_model="ft:zaya-tiny:zaya:bank:ftjob-1",
            result_model_version_id=newer.id,
        )
        session.add(job)
        session.commit()
        newer_id = newer.id
    for model, expected in (
        ("zaya-tiny", version_id),  # production wins over the newer version
        ("zaya-tiny@staging", newer_id),
        (f"zaya-tiny@{version_id}", version_id),
        ("ft:zaya-tiny:zaya:bank:ftjob-1", newer_id),
    ):
        response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
        assert response.model == model
        assert records(sessions)[-1].model_version_id == expected


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("no-such-model", "unknown"),
        ("zaya-tiny@nightly", "unknown alias"),
        ("zaya-tiny@mv-000", "unknown version"),
        ("zaya-tiny@", "empty selector"),
    ],
)
def test_unknown_models_are_404_naming_model(client, sessions, model, why):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert error.value.body["param"] == "model", why
    assert error.value.body["code"] == "model_not_found"
    assert records(sessions)[-1].status_code == 404


def test_a_version_whose_files_are_gone_is_503_not_500(client, sessions, tmp_path):
    with sessions() as session:
        session.add(ModelVersion(name="vanished", version=1, kind="full", path=str(tmp_path / "gone")))
        session.commit()
    with pytest.raises(openai.InternalServerError) as error:
        client.chat.completions.create(model="vanished", messages=MESSAGES, max_tokens=2)
    assert error.value.status_code == 503 and error.value.body["code"] == "model_unavailable"


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"n": 1000}, "n"),
        ({"stop": [f"stop{i}" for i in range(300)]}, "stop"),
        ({"temperature": 7}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "case " * 3000}]}, "messages"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(live_server, keys, version_id, overrides, param):
    body = {"model": "zaya-tiny", "messages": MESSAGES, "max_tokens": 4, **overrides}
    response = httpx.post(
        f"{live_server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {keys['analyst']}"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_bad_completion_prompts_are_400(live_server, keys, version_id):
    headers = {"Authorization": f"Bearer {keys['analyst']}"}
    for prompt, n in (
        (["one", ""], 1),
        ([[3], []], 1),
        ([[3], [10**7]], 1),
        (["case"] * 65, 1),
        (["case"] * 5, 13),  # 65 choices
        ([10**7], 1),
        ("", 1),
        ([], 1),
    ):
        response = httpx.post(
            f"{live_server}/v1/completions", json={"model": "zaya-tiny", "prompt": prompt, "n": n}, headers=headers
        )
        assert response.status_code == 400, (prompt, response.text)
        assert response.json()["error"]["param"] == "prompt"


def test_a_client_that_disconnects_stops_the_generation(live_server, keys, version_id, sessions, app):
    body = {"model": "zaya-tiny", "messages": MESSAGES, "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{live_server}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {keys['analyst']}"}
    ) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    stats = app.state.inference.engine.stats(version_id)
    deadline = time.monotonic() + 10
    while (stats.running or not records(sessions)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats.running == 0
    assert stats.decoded_tokens < 500
    assert records(sessions)[-1].status_code == 499


def test_a_client_that_gives_up_on_a_whole_answer_stops_the_generation(live_server, keys, version_id, sessions, app):
    body = {"model": "zaya-tiny", "prompt": "Case", "max_tokens": 1900, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{live_server}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {keys['analyst']}"},
            timeout=httpx.Timeout(10, read=1.0),
        )
    stats = app.state.inference.engine.stats(version_id)
    deadline = time.monotonic() + 10
    while (stats.running or not records(sessions)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stats.running == 0 and stats.decoded_tokens < 1900
    assert records(sessions)[-1].status_code == 499
