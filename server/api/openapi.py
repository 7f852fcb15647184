"""The OpenAPI document says what the server really answers: errors in OpenAI's shape, streamed chunks, and
bearer-key auth.

FastAPI documents its own 422 validation body, which this server never sends (validation errors are 400 in OpenAI's
shape, see `server.api.errors`). Every operation instead gets a `default` response, the OpenAI error body, since
any of them can answer 400/401/403/404/409/413/429/5xx; and every operation but `/health` needs a bearer key.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from server.api.inference.responses import STREAMED_CHUNKS
from server.api.middleware import PUBLIC_PATHS

ERROR_SCHEMA = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}
ERROR_RESPONSE = {
    "description": "An error, in OpenAI's shape.",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
BEARER = {"type": "http", "scheme": "bearer", "description": "An API key: `Authorization: Bearer <key>`."}


def build_schema(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas["ErrorResponse"] = ERROR_SCHEMA
    # Streamed chunks are named only by `text/event-stream` answers, which FastAPI does not collect models from.
    _, chunks = models_json_schema(
        [(chunk, "serialization") for chunk in STREAMED_CHUNKS], ref_template="#/components/schemas/{model}"
    )
    for name, definition in chunks["$defs"].items():
        schemas.setdefault(name, definition)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    components["securitySchemes"] = {"apiKey": BEARER}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            operation["responses"]["default"] = ERROR_RESPONSE
            if path not in PUBLIC_PATHS:
                operation["security"] = [{"apiKey": []}]
    return schema


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the schema
