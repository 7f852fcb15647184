"""Exception handlers: every error leaves the server in OpenAI's error shape, and 500s never leak internals."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.errors import APIError

logger = logging.getLogger(__name__)

DATABASE_RETRY_AFTER_S = 2

UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none"})
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# The error code (and pydantic error type) of a request field this server refuses to take.
UNSUPPORTED_PARAMETER = "unsupported_parameter"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
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
    return error_response(
        exc.status_code, exc.message, type_=exc.type, param=exc.param, code=exc.code, headers=exc.headers
    )


async def _http_exception(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    param = getattr(exc, "param", None)  # set by our own subclasses (server.api.limits)
    return error_response(exc.status_code, message, param=param, headers=getattr(exc, "headers", None))


def _field_name(location: tuple[int | str, ...]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; a whole-body error names no field.

    Pydantic also puts the union member tried in the location ("str", "list[int]", "function-before[...]"); JSON
    field names here never look like that, so those parts are left out.
    """
    name = ""
    for part in location[1:]:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not (part in UNION_MEMBER_TAGS or any(mark in part for mark in "[(-")):
            name += f".{part}"
    return name.lstrip(".") or None


def _refusal(error: dict[str, Any]) -> JSONResponse:
    """A field the request may not carry, in OpenAI's words: undeclared ("Unrecognized request argument"), or
    declared and not honoured by this server (`server.api.inference.protocol.Unsupported`)."""
    param = _field_name(tuple(error.get("loc", ())))
    if error["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        message = f"Unsupported parameter: '{param}' is not supported by this server ({error['msg']})."
    return error_response(400, message, param=param, code=UNSUPPORTED_PARAMETER)


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    refused = [error for error in errors if error["type"] in ("extra_forbidden", UNSUPPORTED_PARAMETER)]
    if refused:
        return _refusal(refused[0])
    # A validator's own message (our checks) says more than the type errors of the other union members.
    explained = [error for error in errors if error["type"] == "value_error"]
    first = (explained or errors or [{"type": "", "loc": (), "msg": "invalid request"}])[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return error_response(400, f"The request body is not valid JSON ({detail}).", code="invalid_json")
    param = _field_name(tuple(first.get("loc", ())))
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(400, message, param=param, code="invalid_value")


def _database_unreachable(exc: Exception) -> bool:
    """The database is down, restarting or overloaded (not a bug in a query): the request may simply be retried."""
    if isinstance(exc, OperationalError | InterfaceError | SQLAlchemyTimeoutError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def database_unavailable(request: Request, exc: Exception) -> JSONResponse | None:
    """503 + Retry-After when `exc` says the database is unreachable; None for any other error."""
    if not _database_unreachable(exc):
        return None
    # The driver's message only: SQLAlchemy's own text would repeat the statement's parameters (key prefixes).
    reason = str(getattr(exc, "orig", None) or type(exc).__name__).splitlines()[0]
    logger.error("database unavailable on %s %s: %s", request.method, request.url.path, reason)
    return error_response(
        503,
        "The database is unavailable; retry shortly.",
        code="database_unavailable",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


async def _unstorable_value(request: Request, exc: DataError) -> JSONResponse:
    """The database refused a value the request carried (a NUL character, too long, out of range): a client error."""
    reason = str(getattr(exc, "orig", None) or "invalid value").splitlines()[0]
    logger.info("refused an unstorable value on %s %s: %s", request.method, request.url.path, reason)
    return error_response(400, f"A value in the request cannot be stored: {reason}.", code="invalid_value")


async def _database_error(request: Request, exc: SQLAlchemyError) -> JSONResponse:
    return database_unavailable(request, exc) or await _unhandled(request, exc)


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    # Also reached by errors escaping a middleware (after which uvicorn closes the connection).
    if (unavailable := database_unavailable(request, exc)) is not None:
        return unavailable
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "The server had an error while processing your request.")


def install_error_handlers(app: FastAPI) -> None:
    # FastAPI's decorator, called directly: Starlette's `add_exception_handler` types every handler as taking any
    # exception, which a handler of one exception class is not.
    app.exception_handler(APIError)(_api_error)
    app.exception_handler(StarletteHTTPException)(_http_exception)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(DataError)(_unstorable_value)
    app.exception_handler(SQLAlchemyError)(_database_error)
    app.exception_handler(Exception)(_unhandled)
