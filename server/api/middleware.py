"""One request middleware: authentication, per-key request rate limit, audit log and metrics, in that order.

Authentication runs here, before routing and body parsing, so every route except `/health` is authenticated by
construction and a malformed body without a key still gets 401. Role checks are per route (`server.api.deps`).
Body size limits are `server.api.limits`, which runs inside this middleware so refused bodies are audited too.
Requests without a valid key are limited per client address (`server.api.ratelimit`): 401 and an audit row
up to the limit, then 429 without one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from fastapi import FastAPI, Request, Response
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import database_unavailable, error_response
from server.api.limits import too_many_query_parameters
from server.errors import RateLimited
from server.services import audit, keys
from server.services.access import Principal

logger = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health"})
MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_AUDITED_PATH_CHARS = 1024  # longer paths are audited cut to this: a client cannot grow the log by its paths


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def _route_of(request: Request) -> tuple[BaseRoute | None, dict[str, Any]]:
    """The route and path parameters of a request, also when it was answered before routing (401, 413)."""
    if "route" in request.scope:
        return request.scope["route"], request.scope.get("path_params", {})
    for route in request.app.router.routes:
        match, child_scope = route.matches(request.scope)
        if match is Match.FULL:
            return route, child_scope.get("path_params", {})
    return None, {}


def _storable(text: str, max_length: int | None = None) -> str:
    """Client-chosen text as the audit log can hold it: hostile requests (NUL characters, huge ids) are logged too."""
    return text.replace("\x00", "\ufffd")[:max_length]


def install_middleware(app: FastAPI) -> None:
    gate = RequestGate(app)
    app.add_middleware(RequestPipeline, admit=gate.admit, record=gate.record)


class RequestGate:
    """What the request middleware does around a route: `admit` before it, `record` once its status is known."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.last_used_resolution = timedelta(seconds=app.state.settings.key_last_used_resolution_s)

    async def admit(self, request: Request) -> Response | None:
        """Authenticate and rate-limit a request: None lets it through, otherwise the response that refuses it."""
        if (refusal := too_many_query_parameters(request.scope.get("query_string", b""))) is not None:
            return refusal
        if request.url.path in PUBLIC_PATHS:
            return None
        token = bearer_token(request)
        try:
            found = await self.app.state.reads.run(self._look_up, token) if token else None
            if found is not None and (last_use := found[1]) is not None:
                await self.app.state.rows.execute(keys.MARK_USED, last_use)
        except SQLAlchemyError as error:
            # Answered here: an error escaping a middleware makes uvicorn drop the client's connection.
            if (unavailable := database_unavailable(request, error)) is None:
                raise
            return unavailable
        if found is None:
            return self._refuse_unauthenticated(request, token)
        principal = request.state.principal = found[0]
        try:
            self.app.state.rate_limits.check_request(principal.key_id)
        except RateLimited as error:
            return error_response(429, error.message, code=error.code, headers=error.headers)
        return None

    def _look_up(self, session: Session, token: str) -> tuple[Principal, dict[str, Any] | None] | None:
        """The caller, and the last use to record for its key (None while the stored one is recent enough)."""
        key = keys.find_active(session, token)
        if key is None:
            return None
        return Principal.from_key(key), keys.last_use_to_record(key, resolution=self.last_used_resolution)

    def _refuse_unauthenticated(self, request: Request, token: str | None) -> Response:
        """401 for a missing or unknown key, counted against the client's address; 429 once it has too many."""
        address = request.client.host if request.client else ""
        rate_limits = self.app.state.rate_limits
        try:
            rate_limits.check_auth_failures_left(address)
        except RateLimited as error:
            request.state.unaudited = True  # past the limit: an address cannot grow the audit log at will
            return error_response(429, error.message, code=error.code, headers=error.headers)
        rate_limits.count_auth_failure(address)
        message = "Invalid API key." if token else "Missing API key: send 'Authorization: Bearer <key>'."
        return error_response(401, message, code="invalid_api_key")

    async def record(self, request: Request, status_code: int, started: float) -> None:
        """Audit a mutating request and observe its metrics, once its status is known (before the client sees it)."""
        route, path_params = _route_of(request)
        route_label = getattr(route, "path", "unmatched")
        if request.method in MUTATING_METHODS and not getattr(request.state, "unaudited", False):
            action = getattr(route, "name", None) or f"{request.method} {route_label}"
            try:
                entry = _audit_entry(request, action, path_params, status_code)
                await self.app.state.rows.execute(audit.INSERT_ENTRY, entry)
            except Exception:
                logger.exception("could not write the audit entry for %s %s", request.method, request.url.path)
        self.app.state.metrics.observe(request.method, route_label, status_code, time.perf_counter() - started)


def _audit_entry(request: Request, action: str, path_params: dict[str, Any], status_code: int) -> dict[str, Any]:
    principal: Principal | None = getattr(request.state, "principal", None)
    target = getattr(request.state, "audit_target", None)
    if target is None and path_params:
        target = ",".join(str(value) for value in path_params.values())
    return audit.entry(
        actor_key_id=principal.key_id if principal else None,
        project_id=principal.project_id if principal else None,
        action=_storable(action, 64),
        method=_storable(request.method, 8),
        path=_storable(request.url.path, MAX_AUDITED_PATH_CHARS),
        target=_storable(target, 256) if target is not None else None,
        status_code=status_code,
        client_address=request.client.host if request.client else None,
    )


class RequestPipeline:
    """The request middleware as plain ASGI. (Starlette's `BaseHTTPMiddleware`, behind `@app.middleware("http")`,
    relays every chunk of a streamed response through an extra task and memory stream, which slows SSE streams
    markedly.)"""

    def __init__(
        self,
        app: ASGIApp,
        *,
        admit: Callable[[Request], Awaitable[Response | None]],
        record: Callable[[Request, int, float], Awaitable[None]],
    ) -> None:
        self.app, self.admit, self.record = app, admit, record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        started = time.perf_counter()
        recorded = False

        async def record_once(status_code: int) -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                await self.record(request, status_code, started)

        async def send_recorded(message: Message) -> None:
            if message["type"] == "http.response.start":
                await record_once(message["status"])
            await send(message)

        try:
            refusal = await self.admit(request)
            if refusal is not None:
                await refusal(scope, receive, send_recorded)
            else:
                await self.app(scope, receive, send_recorded)
        finally:
            await record_once(500)  # no response started: the route raised, and the catch-all handler answers 500
