"""Request body size limits that hold for chunked bodies too: counted as the body streams in, never buffered.

A declared `Content-Length` over the limit is refused before the body is read. Otherwise the bytes are counted as the
route receives them, and the message that crosses the limit raises a 413 inside the route, which stops whatever was
consuming the body (uploads discard their temp file); the 413 says `Connection: close`, so the server answers and
closes the connection instead of reading (and discarding) the rest. Uploads (`/v1/files`) get `max_upload_bytes`
plus room for the multipart framing and form fields (the file part itself is held to `max_upload_bytes` by
`server.services.storage`); every other route gets `max_request_bytes`.
"""

from __future__ import annotations

from urllib.parse import unquote

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import error_response
from server.errors import CLOSE_CONNECTION
from server.settings import Settings

UPLOAD_PATHS = frozenset({"/v1/files"})
# FastAPI looks each query parameter up in the whole list once per dependency that declares query parameters: time
# quadratic in their number, on the event loop, where thousands block every other request for seconds
# (benchmarks/RESULTS.md, "Smaller attacks against the API server"). No route takes anywhere near this many (a job
# listing: 16 metadata filters and a few more).
MAX_QUERY_PARAMETERS = 64
# Multipart boundaries, part headers and the small form fields around the file part.
MULTIPART_OVERHEAD_BYTES = 1024**2


class BodyTooLarge(HTTPException):
    """An HTTPException so FastAPI's body parsing lets it through (it turns other errors into 400)."""

    def __init__(self, limit: int, param: str | None = None) -> None:
        super().__init__(413, f"Request body exceeds {limit} bytes.", headers=dict(CLOSE_CONNECTION))
        self.param = param


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    def limit_for(self, path: str) -> tuple[int, str | None]:
        """The body limit of a path, and the request field to name when refusing."""
        if path in UPLOAD_PATHS:
            return self.settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES, "file"
        return self.settings.max_request_bytes, None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, param = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            response = error_response(413, BodyTooLarge(limit).detail, param=param, headers=dict(CLOSE_CONNECTION))
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, param)
            return message

        await self.app(scope, limited_receive, send)


def too_many_query_parameters(query_string: bytes) -> JSONResponse | None:
    """The 400 for a query string of more than `MAX_QUERY_PARAMETERS` parameters, naming the first one beyond the
    limit (`metadata` for `metadata[key]`), or None. Linear in the query string's length."""
    if query_string.count(b"&") < MAX_QUERY_PARAMETERS:
        return None
    parameters = [part for part in query_string.split(b"&") if part]  # as Starlette parses it: empty parts skipped
    if len(parameters) <= MAX_QUERY_PARAMETERS:
        return None
    name = unquote(parameters[MAX_QUERY_PARAMETERS].partition(b"=")[0].decode("latin-1")).partition("[")[0]
    message = f"A request takes at most {MAX_QUERY_PARAMETERS} query parameters."
    return error_response(400, message, param=name or None, code="invalid_value")
