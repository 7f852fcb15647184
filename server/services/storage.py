"""Atomic file storage: bytes stream into a temp file that is fsynced and renamed into place, or removed."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from server.errors import InsufficientStorage, LineTooLong, PayloadTooLarge
from zaya_model.training.atomic_io import fsync_path

INCOMING_DIR = ".incoming"
# A temp file nobody wrote to for this long belongs to an upload that died with its server (kill -9, power loss).
STALE_UPLOAD_S = 24 * 3600
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


@contextlib.contextmanager
def disk_full_is_507() -> Iterator[None]:
    """A full disk (or quota) is the server's state, not a bug: answer 507 with a clear message instead of a 500."""
    try:
        yield
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        raise InsufficientStorage(
            "The server has no space left to store this file; nothing was stored.", param="file", code="disk_full"
        ) from error


class StreamedFile:
    """A file being received: counts and hashes every chunk, refuses to grow past `max_bytes` or to hold a line longer
    than `max_line_bytes` (bytes before its newline; `LineTooLong` names the line as soon as it passes the limit).

    Whoever opens one calls `commit` (rename into place) or `discard` (remove the temp file) on every path.
    """

    def __init__(self, directory: Path, max_bytes: int, max_line_bytes: int | None = None) -> None:
        incoming = directory / INCOMING_DIR
        with disk_full_is_507():
            incoming.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.max_bytes = max_bytes
        self.temp_path = incoming / f"{secrets.token_hex(8)}.part"
        self.max_line_bytes = max_line_bytes
        self.size = 0
        self._line_number = 1  # of the line the next byte belongs to
        self._line_bytes = 0  # bytes of that line received so far
        self._hash = hashlib.sha256()
        with disk_full_is_507():
            self._handle = open(self.temp_path, "xb")  # noqa: SIM115  (closed in commit/discard)
        self.committed_path: Path | None = None

    def write(self, data: bytes) -> None:
        if self.size + len(data) > self.max_bytes:
            raise PayloadTooLarge(f"File exceeds the upload limit of {self.max_bytes} bytes.", param="file")
        if self.max_line_bytes is not None:
            self._check_lines(data, self.max_line_bytes)
        with disk_full_is_507():
            self._handle.write(data)
        self._hash.update(data)
        self.size += len(data)

    def _check_lines(self, data: bytes, limit: int) -> None:
        first_newline = data.find(b"\n")
        if first_newline == -1:
            self._line_bytes += len(data)
            if self._line_bytes > limit:
                raise LineTooLong(self._line_number, limit)
            return
        if self._line_bytes + first_newline > limit:
            raise LineTooLong(self._line_number, limit)
        last_newline = data.rfind(b"\n")
        if last_newline - first_newline > limit + 1:  # only then can a line wholly inside `data` be too long
            line_number, start = self._line_number + 1, first_newline + 1
            while (end := data.find(b"\n", start)) != -1:
                if end - start > limit:
                    raise LineTooLong(line_number, limit)
                line_number, start = line_number + 1, end + 1
        self._line_number += data.count(b"\n")
        self._line_bytes = len(data) - last_newline - 1
        if self._line_bytes > limit:
            raise LineTooLong(self._line_number, limit)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def finish_writing(self) -> None:
        """Flush and fsync, so the temp file can be read (validated) and then renamed."""
        if not self._handle.closed:
            with disk_full_is_507():
                self._handle.flush()
                os.fsync(self._handle.fileno())
            self._handle.close()

    def commit(self, name: str) -> Path:
        self.finish_writing()
        final_path = self.directory / name
        os.replace(self.temp_path, final_path)
        fsync_path(self.directory)
        self.committed_path = final_path
        return final_path

    def discard(self) -> None:
        if not self._handle.closed:
            with contextlib.suppress(OSError):  # closing flushes: on a full disk that fails, and we drop it anyway
                self._handle.close()
        self.temp_path.unlink(missing_ok=True)


def remove_stale_uploads(directory: Path, *, max_age_s: float = STALE_UPLOAD_S) -> int:
    """Delete temp files of uploads cut off by a crash. Only old ones: another server may be receiving the rest."""
    removed = 0
    cutoff = time.time() - max_age_s
    for part in (directory / INCOMING_DIR).glob("*.part"):
        with contextlib.suppress(FileNotFoundError):
            if part.stat().st_mtime < cutoff:
                part.unlink()
                removed += 1
    return removed
