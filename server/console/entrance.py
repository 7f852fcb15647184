"""The console's public entrance, answered before API authentication (like `/health`): the sign-in page, starting
and ending a session, and the static assets. Everything else under `/console` needs a session or an API key.
"""

from __future__ import annotations

import hmac
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State
from starlette.middleware.exceptions import ExceptionMiddleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route, Router
from starlette.staticfiles import StaticFiles

from server.api.ratelimit import RateLimits
from server.console.cookies import clear_cookie, set_login_cookie, set_session_cookie
from server.console.session import COOKIE_NAME, LOGIN_COOKIE_NAME, ConsoleSession, SessionCodec, new_token
from server.console.templating import STATIC_DIR, templates
from server.db.base import utcnow
from server.db.session import session_scope
from server.errors import RateLimited
from server.services import audit, console_sessions, keys

PREFIX = "/console"
LOGIN_PATH = f"{PREFIX}/login"
SESSION_PATH = f"{PREFIX}/session"
SIGN_OUT_PATH = f"{PREFIX}/session/end"
STATIC_PREFIX = f"{PREFIX}/static/"
MAX_FORM_BYTES = 16 * 1024
ENDED_MESSAGES = {
    "signed_out": "You are signed out.",
    "expired": "Your session ended (idle too long, or the key was revoked). Sign in again.",
}


def handles(path: str) -> bool:
    return path in (LOGIN_PATH, SESSION_PATH, SIGN_OUT_PATH) or path.startswith(STATIC_PREFIX)


def login_url(next_path: str | None = None, ended: str | None = None) -> str:
    query = [f"next={quote(next_path, safe='/')}"] if next_path else []
    query += [f"ended={ended}"] if ended else []
    return LOGIN_PATH + ("?" + "&".join(query) if query else "")


def safe_next(value: str | None) -> str:
    """Only console paths: a sign-in link must not be able to send the user anywhere else."""
    if value and (value == PREFIX or value.startswith(f"{PREFIX}/")) and "//" not in value and "\\" not in value:
        return value
    return f"{PREFIX}/"


def build_entrance(app_state: State, codec: SessionCodec) -> ExceptionMiddleware:
    sessions = _Sessions(app_state, codec)
    router = Router(
        routes=[
            Route(LOGIN_PATH, login_page, methods=["GET"]),
            Route(SESSION_PATH, sessions.start, methods=["POST"]),
            Route(SIGN_OUT_PATH, sessions.end, methods=["POST"]),
            Mount(STATIC_PREFIX.rstrip("/"), app=StaticFiles(directory=STATIC_DIR)),
        ]
    )
    # This app runs in front of the API's exception handling: a missing asset's 404 must become a response here.
    return ExceptionMiddleware(router)


async def login_page(request: Request) -> Response:
    return render_login(request)


def render_login(request: Request, *, error: str | None = None, status_code: int = 200) -> Response:
    token = new_token()
    ended = ENDED_MESSAGES.get(request.query_params.get("ended", ""))
    response = templates.TemplateResponse(
        request,
        "login.html",
        {
            "csrf": token,
            "next": safe_next(request.query_params.get("next")),
            "error": error,
            "notice": ended,
            "principal": None,
        },
        status_code=status_code,
    )
    set_login_cookie(response, request, token)
    return response


async def read_form(request: Request) -> dict[str, str] | None:
    declared = request.headers.get("content-length", "")
    if not declared.isdigit() or int(declared) > MAX_FORM_BYTES:
        return None
    form = await request.form()
    return {name: value for name, value in form.items() if isinstance(value, str)}


class _Sessions:
    """Signing in and out: the endpoints that start and end console sessions, with the app's database, rate limits
    and session codec."""

    def __init__(self, app_state: State, codec: SessionCodec) -> None:
        self.database: sessionmaker[Session] = app_state.sessionmaker
        self.rate_limits: RateLimits = app_state.rate_limits
        self.codec = codec
        self.last_used_resolution = timedelta(seconds=app_state.settings.key_last_used_resolution_s)

    async def start(self, request: Request) -> Response:
        form = await read_form(request)
        if form is None:
            return render_login(request, error="The sign-in form was too large or empty.", status_code=413)
        expected = request.cookies.get(LOGIN_COOKIE_NAME, "")
        if not expected or not hmac.compare_digest(expected, form.get("csrf", "")):
            return render_login(request, error="The sign-in form expired; please try again.", status_code=403)
        address = request.client.host if request.client else ""
        try:
            # Failed sign-ins count with the API's failed authentications, per address: no guessing keys here.
            self.rate_limits.check_auth_failures_left(address)
        except RateLimited as error:
            response = render_login(request, error=error.message, status_code=429)
            response.headers.update(error.headers or {})
            return response
        secret = form.get("api_key", "").strip()
        key_id = await run_in_threadpool(self.sign_in, secret, request) if secret else None
        if key_id is None:
            self.rate_limits.count_auth_failure(address)
            return render_login(request, error="Invalid or revoked API key.", status_code=401)
        response = RedirectResponse(safe_next(form.get("next")), status_code=303)
        started = ConsoleSession.start(secret)
        set_session_cookie(response, request, self.codec.encode(started), self.codec.cookie_max_age(started))
        clear_cookie(response, LOGIN_COOKIE_NAME, path=PREFIX)
        return response

    def sign_in(self, secret: str, request: Request) -> str | None:
        """The key id when the secret is an active key (the API's own lookup); every attempt is audited."""
        with self.database() as session:
            key = keys.authenticate(session, secret, last_used_resolution=self.last_used_resolution)
            key_id, project_id = (key.id, key.project_id) if key is not None else (None, None)
        with session_scope(self.database) as session:
            audit.record(
                session,
                actor_key_id=key_id,
                project_id=project_id,
                action="console.sign_in",
                method="POST",
                path=SESSION_PATH,
                target=key_id,
                status_code=303 if key_id else 401,
                client_address=request.client.host if request.client else None,
            )
        return key_id

    async def end(self, request: Request) -> Response:
        session = self.codec.decode(request.cookies.get(COOKIE_NAME, ""))
        form = await read_form(request) or {}
        if session is not None and not hmac.compare_digest(session.csrf, form.get("csrf", "")):
            return Response("Missing or wrong CSRF token.", status_code=403, media_type="text/plain")
        if session is not None:  # every copy of the cookie is refused from now on
            await run_in_threadpool(self.end_in_database, session)
        response = RedirectResponse(login_url(ended="signed_out"), status_code=303)
        clear_cookie(response, COOKIE_NAME)
        return response

    def end_in_database(self, session: ConsoleSession) -> None:
        expires = self.codec.expires_at(session)
        # Without an absolute lifetime a cookie could come back any time: the record is kept for a year.
        until = datetime.fromtimestamp(expires, UTC) if expires is not None else utcnow() + timedelta(days=365)
        with self.database() as db_session:
            console_sessions.end(db_session, session.id, expires_at=until)
