"""Turns a console session into the API's own credential, so the console has no authorization code of its own.

For a request carrying a valid session cookie (and no Authorization header) this middleware, outside the API's
middleware, checks the CSRF header on every mutating request and adds `Authorization: Bearer <key>`; from there
the request is authenticated, role-checked, rate-limited and audited exactly like an API call. It also answers the
public entrance (`server.console.entrance`), re-issues the cookie after each user action (the idle timeout slides),
and sends browsers to the sign-in page instead of showing them a 401.
"""

from __future__ import annotations

import hmac

from sqlalchemy.exc import SQLAlchemyError
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import HTTPConnection, Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import database_unavailable, error_response
from server.console import entrance
from server.console.cookies import clear_cookie, session_cookie_header
from server.console.session import COOKIE_NAME, ConsoleSession, SessionCodec
from server.db.session import RequestReads
from server.services import console_sessions

# Sent with every console response. The console has no inline script or style and loads nothing from elsewhere, so
# the policy allows only its own origin; no other site may frame it (clickjacking), and no browser guesses a type.
SECURITY_HEADERS = (
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)
MUTATING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CSRF_HEADER = "x-csrf-token"
# Sent by the console's polling scripts: their requests do not count as user activity for the idle timeout.
BACKGROUND_HEADER = "x-console-background"


def _is_page_navigation(scope: Scope, headers: Headers) -> bool:
    return (
        scope["method"] == "GET"
        and scope["path"].startswith(entrance.PREFIX)
        and "text/html" in headers.get("accept", "")
    )


def _expired_redirect(connection: HTTPConnection) -> RedirectResponse:
    target = connection.url.path + (f"?{connection.url.query}" if connection.url.query else "")
    response = RedirectResponse(entrance.login_url(next_path=target, ended="expired"), status_code=303)
    clear_cookie(response, COOKIE_NAME)
    return response


class ConsoleMiddleware:
    def __init__(self, app: ASGIApp, *, codec: SessionCodec, entrance_app: ASGIApp, reads: RequestReads) -> None:
        self.app = app
        self.codec = codec
        self.entrance_app = entrance_app
        self.reads = reads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == entrance.PREFIX or scope["path"].startswith(f"{entrance.PREFIX}/"):
            send = _with_security_headers(send)
        if entrance.handles(scope["path"]):
            await self.entrance_app(scope, receive, send)
            return
        connection = HTTPConnection(scope)
        headers = connection.headers
        cookie = connection.cookies.get(COOKIE_NAME)
        if "authorization" in headers or cookie is None:
            # API clients, and browsers without a session (pages send those to the sign-in page).
            if cookie is None and "authorization" not in headers and _is_page_navigation(scope, headers):
                target = connection.url.path + (f"?{connection.url.query}" if connection.url.query else "")
                await RedirectResponse(entrance.login_url(next_path=target), status_code=303)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        session = await self._live_session(connection, cookie)
        if isinstance(session, Response):  # refused
            await session(scope, receive, send)
            return
        await self._as_api_call(connection, session, receive, send)

    async def _live_session(self, connection: HTTPConnection, cookie: str) -> ConsoleSession | Response:
        """The cookie's session when it is still live and the request carries its CSRF token, or the refusal."""
        scope = connection.scope
        session = self.codec.decode(cookie)
        if session is not None:
            try:
                if await self.reads.run(console_sessions.is_ended, session.id):
                    session = None  # signed out: this is a copy of the cookie
            except SQLAlchemyError as error:
                if (unavailable := database_unavailable(Request(scope), error)) is None:
                    raise
                return unavailable
        if session is None:
            if _is_page_navigation(scope, connection.headers):
                return _expired_redirect(connection)
            return error_response(401, "Your console session has ended; sign in again.", code="session_expired")
        if scope["method"] in MUTATING_METHODS and not hmac.compare_digest(
            connection.headers.get(CSRF_HEADER, ""), session.csrf
        ):
            return error_response(
                403,
                f"Missing or wrong {CSRF_HEADER} header: console requests that change something must carry "
                "the session's CSRF token.",
                param=CSRF_HEADER,
                code="csrf_failed",
            )
        return session

    async def _as_api_call(
        self, connection: HTTPConnection, session: ConsoleSession, receive: Receive, send: Send
    ) -> None:
        """Passes the request on with the session's key, re-issuing the cookie on the response (the idle timeout
        slides) unless it is a background poll; a page whose key was revoked goes to the sign-in page instead."""
        page = _is_page_navigation(connection.scope, connection.headers)
        scope = dict(connection.scope)
        scope["headers"] = [*scope["headers"], (b"authorization", f"Bearer {session.secret}".encode())]
        scope.setdefault("state", {})["console_session"] = session
        refresh = connection.headers.get(BACKGROUND_HEADER) != "1"
        swallowing = False

        async def send_wrapper(message: Message) -> None:
            nonlocal swallowing
            if message["type"] == "http.response.start":
                if page and message["status"] == 401:
                    # The key was revoked since sign-in: back to the sign-in page rather than a JSON error.
                    swallowing = True
                    await _expired_redirect(connection)(scope, _no_body, send)
                    return
                if refresh and message["status"] != 401:
                    cookie_header = session_cookie_header(
                        connection, self.codec.encode(session), self.codec.cookie_max_age(session)
                    )
                    MutableHeaders(scope=message).append("set-cookie", cookie_header)
            elif swallowing:
                return
            await send(message)

        await self.app(scope, receive, send_wrapper)


def _with_security_headers(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            for name, value in SECURITY_HEADERS:
                headers[name.decode()] = value.decode()
        await send(message)

    return sending


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}
