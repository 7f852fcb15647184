"""`GET /health` (no key needed) and `GET /metrics` (Prometheus text, admin key)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError

from server.api.deps import AdminDep
from server.db.migrations import schema_is_current

router = APIRouter(tags=["operations"])


@router.get("/health", name="health")
def health(request: Request) -> JSONResponse:
    """Liveness, plus readiness of the database (reachable and migrated to the current schema)."""
    try:
        database = "ok" if schema_is_current(request.app.state.engine) else "schema_out_of_date"
    except SQLAlchemyError:
        database = "unavailable"
    ready = database == "ok"
    body = {"status": "ok" if ready else "unavailable", "database": database}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", name="metrics")
def metrics(request: Request, _: AdminDep) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
