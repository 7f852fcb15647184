"""Streaming multipart/form-data: the file part goes to disk chunk by chunk as it arrives, never whole in memory."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from server.api.limits import BodyTooLarge
from server.errors import InsufficientStorage, InvalidRequest, LineTooLong, PayloadTooLarge
from server.services.storage import StreamedFile

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

MAX_FIELD_BYTES = 64 * 1024
# After refusing an oversized upload (or one with an over-long line), read (and drop) up to this much more so the
# client sees the 413 (or 400) instead of a reset connection; beyond it the connection is simply closed. The body
# limit of `server.api.limits` ends the drain sooner.
DRAIN_LIMIT_BYTES = 64 * 1024**2


@dataclass
class MultipartUpload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file: StreamedFile | None = None


class _Receiver:
    """python-multipart callbacks that route each part: the file field to a StreamedFile, others to small strings."""

    def __init__(self, file_field: str, open_file: Callable[[], StreamedFile]) -> None:
        self.file_field = file_field
        self.open_file = open_file
        self.upload = MultipartUpload()
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._value = bytearray()
        self._file: StreamedFile | None = None  # the part being read goes to it
        self.complete = False

    def on_part_begin(self) -> None:
        self._headers, self._name, self._value, self._file = {}, None, bytearray(), None

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field, self._header_value = b"", b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if b"name" not in options:
            raise InvalidRequest("A multipart part has no name.")
        self._name = options[b"name"].decode("utf-8", "replace")
        if self._name == self.file_field:
            if self.upload.file is not None:
                raise InvalidRequest(f"Send exactly one '{self.file_field}' part.", param=self.file_field)
            self.upload.filename = options.get(b"filename", b"").decode("utf-8", "replace") or None
            self.upload.file = self._file = self.open_file()

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._file is not None:
            self._file.write(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise InvalidRequest(f"Form field '{self._name}' is too long.", param=self._name)

    def on_part_end(self) -> None:
        if self._file is None and self._name is not None:
            self.upload.fields[self._name] = self._value.decode("utf-8", "replace")

    def on_end(self) -> None:
        self.complete = True

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_end": self.on_end,
        }


def _discard(upload: MultipartUpload) -> None:
    if upload.file is not None:
        upload.file.discard()


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    drained = 0
    try:
        async for chunk in chunks:
            drained += len(chunk)
            if drained > DRAIN_LIMIT_BYTES:
                return
    except (ClientDisconnect, BodyTooLarge):
        return


async def receive_multipart(
    request: Request, *, file_field: str, open_file: Callable[[], StreamedFile]
) -> MultipartUpload:
    """Parse the request body, streaming the `file_field` part into `open_file()` (a StreamedFile).

    On any error the StreamedFile (if opened) is discarded before the error propagates.
    """
    content_type, options = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data" or b"boundary" not in options:
        raise InvalidRequest("Expected a multipart/form-data body.", param=file_field)
    receiver = _Receiver(file_field, open_file)
    parser = MultipartParser(options[b"boundary"], receiver.callbacks())
    chunks = request.stream()
    try:
        async for chunk in chunks:
            if chunk:
                # The callbacks write to disk: keep that off the event loop.
                await run_in_threadpool(parser.write, chunk)
        parser.finalize()
        if not receiver.complete:
            # python-multipart does not check this itself: a body cut short must not pass as a whole file.
            raise InvalidRequest("The multipart body ended before its closing boundary.", param=file_field)
    except (PayloadTooLarge, LineTooLong, InsufficientStorage):
        _discard(receiver.upload)
        await _drain(chunks)
        raise
    except MultipartParseError as error:
        _discard(receiver.upload)
        raise InvalidRequest(f"Malformed multipart body: {error}", param=file_field) from error
    except BaseException:  # InvalidRequest, a client disconnect, a disk error...
        _discard(receiver.upload)
        raise
    return receiver.upload
