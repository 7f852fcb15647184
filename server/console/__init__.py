"""The web console at `/console`: server-rendered pages over the same role checks and services as the API, with
small scripts that call the `/v1` API itself for every action (see `middleware` for how a session becomes a key)."""

from __future__ import annotations

import secrets

from fastapi import FastAPI

from server.console.entrance import build_entrance
from server.console.middleware import ConsoleMiddleware
from server.console.pages import router
from server.console.session import SessionCodec


def install_console(app: FastAPI) -> None:
    """Add the console's pages and its middleware; call after the API's middleware, so this one runs first."""
    settings = app.state.settings
    codec = SessionCodec(
        settings.console_secret.get_secret_value() or secrets.token_urlsafe(32),
        settings.console_idle_timeout_s,
        settings.console_session_max_age_s,
    )
    app.include_router(router)
    app.add_middleware(
        ConsoleMiddleware, codec=codec, entrance_app=build_entrance(app.state, codec), reads=app.state.reads
    )
