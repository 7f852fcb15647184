"""The console's cookies: HttpOnly, SameSite=Strict, Secure whenever the request came over HTTPS."""

from __future__ import annotations

from starlette.requests import HTTPConnection
from starlette.responses import Response

from server.console.session import COOKIE_NAME, LOGIN_COOKIE_MAX_AGE_S, LOGIN_COOKIE_NAME


def _set(response: Response, request: HTTPConnection, name: str, value: str, max_age: int, path: str) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=path,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def set_session_cookie(response: Response, request: HTTPConnection, value: str, max_age: int) -> None:
    # Path "/": the console's scripts call the `/v1` API with the same session.
    _set(response, request, COOKIE_NAME, value, max_age, "/")


def set_login_cookie(response: Response, request: HTTPConnection, token: str) -> None:
    _set(response, request, LOGIN_COOKIE_NAME, token, LOGIN_COOKIE_MAX_AGE_S, "/console")


def clear_cookie(response: Response, name: str, path: str = "/") -> None:
    response.delete_cookie(name, path=path, httponly=True, samesite="strict")


def session_cookie_header(request: HTTPConnection, value: str, max_age: int) -> str:
    """The raw Set-Cookie header value, for the middleware that adds it to responses it did not build."""
    response = Response()
    set_session_cookie(response, request, value, max_age)
    return response.headers["set-cookie"]
