"""The HTTP server the app runs in (`zaya serve`, `zaya run`): uvicorn, with bounds on a request's head.

uvicorn's httptools protocol keeps a request's target and header fields in memory however long they grow (a 100 MB
header field was read whole, for over a minute, with `/health` seconds late meanwhile). `BoundedHttpToolsProtocol`
counts the head's bytes as they arrive and answers before parsing more: a request target over
`max_request_line_bytes` gets 414, a head (request line plus header fields) over `max_header_bytes` gets 431, each
with OpenAI's error body, and the connection closes. The rest of what the client sends is read and dropped for a
moment (`LINGER_S`) so it reads the answer instead of a connection reset. (The head of a request pipelined behind
another in the same read is counted from that read's end: it may pass the bound by up to one read, 256 KiB at most.)

Without httptools, uvicorn's h11 protocol bounds the head itself (`h11_max_incomplete_event_size`), answering 400.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from fastapi import FastAPI

from server.settings import Settings

LINGER_S = 1.0

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # no httptools: h11 bounds the head (`protocol_options`)
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def protocol_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options (`uvicorn.run`, `uvicorn.Config`) bounding request heads as `settings` say."""
    if HttpToolsProtocol is None:
        return {"http": "h11", "h11_max_incomplete_event_size": settings.max_header_bytes}
    return {"http": bounded_protocol(settings)}


def run_server(app: FastAPI, settings: Settings, *, host: str, port: int) -> None:
    uvicorn.run(app, host=host, port=port, **protocol_options(settings))


def bounded_protocol(settings: Settings) -> type[asyncio.Protocol]:
    """httptools' protocol refusing request targets over `settings.max_request_line_bytes` (414) and heads over
    `settings.max_header_bytes` (431)."""
    assert HttpToolsProtocol is not None

    class Bounded(BoundedHttpToolsProtocol):
        max_request_line_bytes = settings.max_request_line_bytes
        max_header_bytes = settings.max_header_bytes

    return Bounded


if HttpToolsProtocol is not None:

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        max_request_line_bytes = 16 * 1024
        max_header_bytes = 64 * 1024

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._in_head = True  # reading a request's head (or waiting for the next request)
            self._head_bytes = 0
            self._completed = 0  # requests read whole on this connection
            self._refused = False

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # dropped while the refusal lingers
            if not self._in_head:
                super().data_received(data)
                return
            room = self.max_header_bytes - self._head_bytes
            head, rest = data[:room], data[room:]
            self._head_bytes += len(head)
            completed = self._completed
            super().data_received(head)
            if self._refused or self.transport.is_closing() or not rest:
                return
            if self._in_head and self._completed == completed:
                self._refuse(431, f"Request header fields exceed {self.max_header_bytes} bytes.", "header_too_large")
            else:
                self.data_received(rest)  # the body, or a request pipelined after this one

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            if len(self.url) > self.max_request_line_bytes and not self._refused:
                self._refuse(414, f"Request target exceeds {self.max_request_line_bytes} bytes.", "uri_too_long")

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0
            self._completed += 1

        def _refuse(self, status_code: int, message: str, code: str) -> None:
            """Answer `status_code` with OpenAI's error body and close: at once for writing, after `LINGER_S` for
            reading (what still arrives is dropped)."""
            self._refused = True
            self.logger.warning("refused a request from %s: %s", self.client[0] if self.client else "?", message)
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
            body = json.dumps({"error": error}).encode()
            self.transport.write(
                b"".join(
                    [
                        STATUS_LINE[status_code],
                        b"content-type: application/json\r\n",
                        b"content-length: " + str(len(body)).encode() + b"\r\n",
                        b"connection: close\r\n\r\n",
                        body,
                    ]
                )
            )
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()
