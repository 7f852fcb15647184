"""Atomic file storage: bytes stream into a temp file that is fsynced and renamed into place, or removed."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from server.errors import PayloadTooLarge
from zaya_model.atomic_io import fsync_path

INCOMING_DIR = ".incoming"


class StreamedFile:
    """A file being received: counts and hashes every chunk, refuses to grow past `max_bytes`.

    Whoever opens one calls `commit` (rename into place) or `discard` (remove the temp file) on every path.
    """

    def __init__(self, directory: Path, max_bytes: int) -> None:
        incoming = directory / INCOMING_DIR
        incoming.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.max_bytes = max_bytes
        self.temp_path = incoming / f"{secrets.token_hex(8)}.part"
        self.size = 0
        self._hash = hashlib.sha256()
        self._handle = open(self.temp_path, "xb")  # noqa: SIM115  (closed in commit/discard)
        self.committed_path: Path | None = None

    def write(self, data: bytes) -> None:
        if self.size + len(data) > self.max_bytes:
            raise PayloadTooLarge(f"File exceeds the upload limit of {self.max_bytes} bytes.", param="file")
        self._handle.write(data)
        self._hash.update(data)
        self.size += len(data)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def finish_writing(self) -> None:
        """Flush and fsync, so the temp file can be read (validated) and then renamed."""
        if not self._handle.closed:
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
            self._handle.close()
        self.temp_path.unlink(missing_ok=True)
