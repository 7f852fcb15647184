"""`GET /health` (no key needed) and `GET /metrics` (Prometheus text, admin key)."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from server.api.deps import AdminDep
from server.db.migrations import current_revision, head_revision
from server.services.inference import READY_ENGINE_STATES

router = APIRouter(tags=["operations"])


class EngineHealth(BaseModel):
    model_config = ConfigDict(extra="allow")  # the engine's own details (loaded models, queue depth...)

    status: str
    kind: str
    error: str | None = None


class Health(BaseModel):
    status: str
    database: str
    engine: EngineHealth


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

    200 when both are ready, else 503; the body says which part is not (`database`, `engine.status`).
    """
    database = await run_in_threadpool(_database_status, request)
    engine = request.app.state.inference.health()
    ready = database == "ok" and engine["status"] in READY_ENGINE_STATES
    body = {"status": "ok" if ready else "unavailable", "database": database, "engine": engine}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", name="metrics", response_class=PlainTextResponse)
def metrics(request: Request, _: AdminDep) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
