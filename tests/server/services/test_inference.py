"""The inference service on its own, without HTTP: typed requests in, deltas or whole choices out, one
`inference_records` row per request, with the real local engine and database."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing

import pytest
from sqlalchemy import select

from server.api.inference.protocol import ChatCompletionRequest, CompletionRequest
from server.api.ratelimit import RateLimits
from server.db.models import InferenceRecord, ModelVersion
from server.db.row_writer import RowWriter
from server.db.session import RequestReads, make_engine
from server.engines.base import (
    EngineError,
    EngineFailure,
    EngineOverloaded,
    EngineUnavailable,
    ModelLoadError,
)
from server.errors import NotFound, RateLimited
from server.services.inference import InferenceService, engine_error

MESSAGES = [{"role": "user", "content": "Summarise case CASE-7."}]


@pytest.fixture
def version_id(sessions, tiny_model_dir) -> str:
    with sessions() as session:
        version = ModelVersion(name="tiny", version=1, kind="full", path=str(tiny_model_dir))
        session.add(version)
        session.commit()
        return version.id


@pytest.fixture
def run_with_service(settings, version_id):
    """Run `scenario(service)` on an event loop of its own, with the service's engine and writer closed after."""

    def run(scenario: Callable[[InferenceService], Awaitable], service_settings=settings):
        async def main():
            database = make_engine(service_settings.database_url)
            rows = RowWriter(database)
            service = InferenceService(service_settings, RequestReads(database), rows, RateLimits(service_settings))
            try:
                return await scenario(service)
            finally:
                await service.close()
                await asyncio.to_thread(rows.close)
                database.dispose()

        return asyncio.run(main())

    return run


def records(sessions) -> list[InferenceRecord]:
    with sessions() as session:
        return list(session.scalars(select(InferenceRecord).order_by(InferenceRecord.id)))


def chat(max_tokens: int, n: int = 1, model: str = "tiny") -> ChatCompletionRequest:
    return ChatCompletionRequest(model=model, messages=MESSAGES, max_tokens=max_tokens, n=n, temperature=0.0)


def completion(max_tokens: int, model: str = "tiny") -> CompletionRequest:
    return CompletionRequest(model=model, prompt="Case", max_tokens=max_tokens, temperature=0.0)


def test_a_whole_answer_has_every_choice_and_leaves_its_record(run_with_service, make_key, sessions, version_id):
    key_id, _ = make_key("analyst")

    async def scenario(service: InferenceService):
        generation = await service.start_generation(key_id, chat(6, n=2))
        async with generation:
            choices = await generation.collect()
        return generation, choices

    generation, choices = run_with_service(scenario)
    assert [choice.index for choice in choices] == [0, 1]
    assert choices[0].text == choices[1].text  # greedy: n choices agree
    assert all(choice.finish_reason in ("stop", "length") for choice in choices)
    [record] = records(sessions)
    assert (record.endpoint, record.status_code, record.model_version_id) == ("chat.completions", 200, version_id)
    assert record.prompt_tokens == generation.prompt_tokens > 5
    assert 2 <= record.completion_tokens == generation.completion_tokens <= 12


def test_a_reader_that_stops_early_stops_the_generation_and_is_recorded_499(
    run_with_service, make_key, sessions, version_id
):
    key_id, _ = make_key("analyst")

    async def scenario(service: InferenceService):
        generation = await service.start_generation(key_id, completion(200))
        async with generation, aclosing(generation.deltas()) as deltas:
            for _ in range(2):
                await anext(deltas)
        stats = service.engine.stats(version_id)
        deadline = time.monotonic() + 10
        while stats.running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return stats

    stats = run_with_service(scenario)
    assert stats.running == 0 and stats.decoded_tokens < 100
    [record] = records(sessions)
    assert record.status_code == 499 and 2 <= record.completion_tokens < 100


def test_refusals_come_before_any_output_and_are_recorded(run_with_service, make_key, sessions, settings):
    key_id, _ = make_key("analyst")
    small_budget = settings.model_copy(update={"rate_limit_tokens_per_minute": 50})

    async def scenario(service: InferenceService):
        with pytest.raises(NotFound):
            await service.start_generation(key_id, completion(4, model="no-such-model"))
        with pytest.raises(RateLimited) as refused:
            await service.start_generation(key_id, completion(60))
        return refused.value

    refused = run_with_service(scenario, small_budget)
    assert refused.param == "max_tokens"
    assert [(record.requested_model, record.status_code) for record in records(sessions)] == [
        ("no-such-model", 404),
        ("tiny", 429),
    ]


@pytest.mark.parametrize(
    ("error", "status", "kind", "retry_after"),
    [
        (EngineError("n must be at most 16 on this engine.", param="n"), 400, "invalid_request_error", None),
        (EngineOverloaded("The engine's request queue is full."), 429, "rate_limit_error", "1"),
        (ModelLoadError("Model version mv-1 could not be loaded."), 503, "server_error", None),
        (EngineUnavailable("The engine core is restarting.", retry_after_s=10), 503, "server_error", "10"),
        (EngineFailure("Generation failed: EngineCore encountered an issue."), 500, "server_error", None),
    ],
)
def test_only_a_refused_request_is_the_clients_error_and_engine_failures_are_server_errors(
    error, status, kind, retry_after
):
    api_error = engine_error(error)
    assert (api_error.status_code, api_error.type, api_error.message) == (status, kind, error.message)
    assert (api_error.headers or {}).get("Retry-After") == retry_after
    assert api_error.param == error.param
