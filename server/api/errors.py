"""Exception handlers: every error leaves the server in OpenAI's error shape, and 500s never leak internals."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import APIError

logger = logging.getLogger(__name__)

ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    *,
    type_: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    if type_ is None:
        type_ = "server_error" if status_code >= 500 else ERROR_TYPES.get(status_code, "invalid_request_error")
    return JSONResponse(error_body(message, type_, param, code), status_code=status_code, headers=headers)


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status_code, exc.message, type_=exc.type, param=exc.param, code=exc.code)


async def _http_exception(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))


def _field_name(location: tuple) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; a whole-body error names no field."""
    name = ""
    for part in location[1:]:
        name += f"[{part}]" if isinstance(part, int) else f".{part}"
    return name.lstrip(".") or None


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return error_response(400, f"The request body is not valid JSON ({detail}).", code="invalid_json")
    param = _field_name(tuple(first.get("loc", ())))
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(400, message, param=param, code="invalid_value")


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "The server had an error while processing your request.")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unhandled)
