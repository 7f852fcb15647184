"""Durable, atomic writes shared by every package: fsync a file or directory, a whole tree, a JSON file.

Standard library only, so the server can use it without loading torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file, or a directory's entries (a rename inside it), to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory`, then the directories themselves, to disk."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            fsync_path(path)
    for path in [*sorted(p for p in directory.rglob("*") if p.is_dir()), directory]:
        fsync_path(path)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 text to a temp file beside `path`, fsync it, rename it into place and fsync the directory."""
    path = Path(path)
    temporary = path.with_name(f".tmp-{path.name}")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_path(path.parent)


def write_json_atomic(path: str | os.PathLike[str], payload: Any) -> None:
    """Write JSON to a temp file beside `path`, fsync it, rename it into place and fsync the directory."""
    path = Path(path)
    temporary = path.with_name(f".tmp-{path.name}")
    with temporary.open("w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_path(path.parent)
