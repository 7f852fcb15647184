"""Durable, atomic writes shared by every package: files and directories published whole or not at all.

A file is written under a hidden temporary name beside its destination, fsynced, renamed into place, and the rename is
fsynced (`atomic_file`, `write_text_atomic`, `write_lines_atomic`, `write_json_atomic`). A directory is built under a
hidden temporary name beside its destination, every file and directory fsynced, then renamed into place, an older
one moved aside first and removed after (`atomic_directory`, `publish_directory`). A crash or a full disk leaves the
old file or directory or the new one, never half of one; a failed write removes its temporary.

Standard library only, so the server can use it without loading torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

TEMPORARY_PREFIX = ".tmp-"  # a temporary file or directory beside its destination: `.tmp-<name>.<random>`


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


def temporary_sibling(destination: str | os.PathLike[str], suffix: str = "") -> Path:
    """A fresh hidden name beside `destination` (same file system, so a rename between them is atomic)."""
    destination = Path(destination)
    return destination.with_name(f"{TEMPORARY_PREFIX}{destination.name}.{uuid.uuid4().hex[:12]}{suffix}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on success it is fsynced and renamed to `path` (the rename
    fsynced too), on error it is removed. The file gets the mode a plain `open` would give it."""
    path = Path(path)
    temporary = temporary_sibling(path)
    try:
        yield temporary
        fsync_path(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_lines_atomic(path: str | os.PathLike[str], lines: Iterable[str]) -> None:
    """Write UTF-8 text, line by line (the lines carry their own newlines), to `path` atomically."""
    with atomic_file(path) as temporary, temporary.open("x", encoding="utf-8") as handle:
        handle.writelines(lines)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 text to `path` atomically."""
    write_lines_atomic(path, [text])


def write_json_atomic(path: str | os.PathLike[str], payload: Any) -> None:
    """Write `payload` as indented JSON to `path` atomically."""
    with atomic_file(path) as temporary, temporary.open("x", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2)


@contextlib.contextmanager
def atomic_directory(destination: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty staging directory beside `destination`; on success it replaces `destination`
    (`publish_directory`), on error it is removed. It gets the mode a plain `mkdir` would give it."""
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_sibling(destination)
    staging.mkdir()
    try:
        yield staging
        publish_directory(staging, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish_directory(staging: Path, destination: Path) -> None:
    """fsync every file of `staging`, then rename it to `destination`. An existing `destination` is moved aside
    first and removed after, so the name never points at a half-written directory."""
    fsync_tree(staging)
    previous = None
    if destination.exists():
        previous = temporary_sibling(destination, ".old")
        os.replace(destination, previous)
    os.replace(staging, destination)
    fsync_path(destination.parent)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
