"""The FastAPI application: `create_app(settings)` builds one; `server.app:app` is one built from the environment."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from server.api.access_log import redact_query_strings
from server.api.errors import install_error_handlers
from server.api.limits import BodySizeLimitMiddleware
from server.api.metrics import Metrics
from server.api.middleware import install_middleware
from server.api.openapi import install_openapi
from server.api.ratelimit import RateLimits
from server.api.routes import api_router
from server.console import install_console
from server.db.migrations import schema_is_current
from server.db.row_writer import RowWriter
from server.db.session import RequestReads, make_engine, make_sessionmaker
from server.services.inference import InferenceService
from server.services.storage import remove_stale_uploads
from server.settings import Settings

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    engine = make_engine(settings.database_url)
    redact_query_strings()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # The server never creates tables: the schema is Alembic's job (`zaya db upgrade`).
        if not schema_is_current(engine):
            raise RuntimeError("The database schema is missing or out of date: run `zaya db upgrade` first.")
        settings.files_dir.mkdir(parents=True, exist_ok=True)
        if removed := remove_stale_uploads(settings.files_dir):
            logger.warning("removed %d temp files of uploads cut off by an earlier crash", removed)
        await app.state.inference.start()
        yield
        await app.state.inference.close()
        await asyncio.to_thread(app.state.rows.close)
        engine.dispose()
        app.state.read_engine.dispose()

    app = FastAPI(title="ZAYA platform", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    # The reads every request makes (authentication, model resolution) have a pool of their own; the rows it writes
    # go through one group-commit writer (`server.db.session.RequestReads`, `server.db.row_writer`).
    app.state.read_engine = make_engine(settings.database_url, pre_ping=False, pool_size=settings.database_pool_size)
    app.state.reads = RequestReads(app.state.read_engine)
    app.state.rows = RowWriter(engine)
    app.state.sessionmaker = make_sessionmaker(engine)
    app.state.metrics = Metrics(app.state.sessionmaker)
    app.state.rate_limits = RateLimits(settings)
    app.state.inference = InferenceService(settings, app.state.reads, app.state.rows, app.state.rate_limits)
    install_error_handlers(app)
    # Added first, so it runs inside the request middleware (after authentication, and audited).
    app.add_middleware(BodySizeLimitMiddleware, settings=settings)
    install_middleware(app)
    app.include_router(api_router)
    install_openapi(app)
    # Last, so its middleware runs first: it turns a console session into the API key the API authenticates.
    install_console(app)
    return app


@functools.cache
def _default_app() -> FastAPI:
    return create_app(Settings())


def __getattr__(name: str) -> FastAPI:
    # `server.app:app` is built on first access, so importing this module has no side effects.
    if name == "app":
        return _default_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
