"""`GET /health` (no key needed) and `GET /metrics` (Prometheus text, admin key).

Without a key `/health` says up or down only (200 `{"status": "ok"}` or 503 `{"status": "unavailable"}`); with a valid
key it also says which part is not ready (`database`, `engine.status`, `engine.kind`, `engine.error`), and with an
admin key the engine's own details too (loaded model versions, queues).
"""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from server.api.deps import AdminDep
from server.api.middleware import bearer_token
from server.db.migrations import current_revision, head_revision
from server.db.models import Role
from server.services import keys
from server.services.inference import READY_ENGINE_STATES

router = APIRouter(tags=["operations"])


class EngineHealth(BaseModel):
    model_config = ConfigDict(extra="allow")  # the engine's own details (loaded models, queue depth...)

    status: str
    kind: str
    error: str | None = None


class Health(BaseModel):
    status: str
    # With a key only.
    database: str | None = None
    engine: EngineHealth | None = None


# What a key that is not an admin's sees of the engine's report.
ENGINE_SUMMARY = ("status", "kind", "error")


@functools.cache
def _head_revision() -> str | None:
    # Reading the migration scripts is slow, and they do not change while the server runs.
    return head_revision()


def _database_status(request: Request) -> str:
    try:
        return "ok" if current_revision(request.app.state.engine) == _head_revision() else "schema_out_of_date"
    except SQLAlchemyError:
        return "unavailable"


@router.get(
    "/health",
    name="health",
    response_model=Health,
    responses={503: {"model": Health, "description": "The database or the inference engine is not ready."}},
)
async def health(request: Request) -> JSONResponse:
    """Liveness, plus readiness of the database (reachable, schema current) and of the inference engine.

    200 when both are ready, else 503. With a valid key the body says which part is not (`database`,
    `engine.status`); with an admin key it carries the engine's details too.
    """
    database = await run_in_threadpool(_database_status, request)
    engine = request.app.state.inference.health()
    ready = database == "ok" and engine["status"] in READY_ENGINE_STATES
    body: dict[str, object] = {"status": "ok" if ready else "unavailable"}
    role = await _role_of_caller(request) if database != "unavailable" else None
    if role is not None:
        shown = engine if role == Role.admin else {key: engine[key] for key in ENGINE_SUMMARY if key in engine}
        body |= {"database": database, "engine": shown}
    return JSONResponse(body, status_code=200 if ready else 503)


async def _role_of_caller(request: Request) -> Role | None:
    """The role of the request's key, or None: no key, not an active key, or the database cannot say."""
    token = bearer_token(request)
    if token is None:
        return None
    try:
        key = await request.app.state.reads.run(keys.find_active, token)
    except SQLAlchemyError:
        return None
    return Role(key.role) if key is not None else None


@router.get("/metrics", name="metrics", response_class=PlainTextResponse)
def metrics(request: Request, _: AdminDep) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
