"""A stored file's reports (validation, PII), computed once per content and then read back.

The console's dataset page, job estimates and the worker's validation of a new job each need the validator's report
of a file (with a tokenizer: tokens, template, lengths) and the page its PII scan; both read the whole file. They are
stored in `dataset_reports`, keyed by the project, the file's sha256, the kind and everything else the report
depends on (tokenizer, limits, the paired file's hash, and the code and libraries that compute it), so the next view,
estimate or job reads a row instead of the file. Within one process, callers asking for the same report at once
wait for the first one's result instead of each computing it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from server.db.models import DatasetReport, File

VALIDATION = "validation"
PII = "pii"

_LIBRARIES = ("phonenumbers", "python-stdnum", "tokenizers", "transformers")


def _code_fingerprint() -> str:
    """Changes whenever the code that computes reports does: `finetune.datasets` and the libraries it relies on."""
    import finetune.datasets

    digest = hashlib.sha256()
    for source in sorted(Path(finetune.datasets.__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for library in _LIBRARIES:
        try:
            version = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            version = ""
        digest.update(f"{library}={version}\0".encode())
    return digest.hexdigest()


_CODE = _code_fingerprint()


def parameters_key(kind: str, parameters: dict[str, Any]) -> str:
    canonical = json.dumps({"kind": kind, "code": _CODE, **parameters}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class _Flight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.report: dict[str, Any] | None = None


_flights: dict[tuple[str, str, str, str], _Flight] = {}
_flights_lock = threading.Lock()


def _computed_once(key: tuple[str, str, str, str], compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`compute()`, shared with the callers asking for the same key while it runs (a follower whose leader failed
    computes for itself)."""
    with _flights_lock:
        flight = _flights.get(key)
        leader = flight is None
        if flight is None:
            flight = _flights[key] = _Flight()
    if not leader:
        flight.done.wait()
        return flight.report if flight.report is not None else compute()
    try:
        flight.report = compute()
        return flight.report
    finally:
        with _flights_lock:
            del _flights[key]
        flight.done.set()


def stored_report(
    session: Session,
    file: File,
    kind: str,
    parameters: dict[str, Any],
    compute: Callable[[], dict[str, Any]],
    *,
    commit: bool = True,
) -> tuple[dict[str, Any], bool]:
    """The `kind` report of `file`'s content under `parameters` (JSON-ready), and whether it was computed now.

    Computed with `compute()` only when no row holds it; then stored (and, with `commit`, committed; without, it is
    part of the caller's transaction). `compute` must depend on nothing but the content and `parameters`."""
    key = parameters_key(kind, parameters)
    query = select(DatasetReport.report).where(
        DatasetReport.project_id == file.project_id,
        DatasetReport.sha256 == file.sha256,
        DatasetReport.kind == kind,
        DatasetReport.parameters_key == key,
    )
    found = session.scalars(query).first()
    if found is not None:
        return found, False
    report = _without_path(_computed_once((file.project_id, file.sha256, kind, key), compute))
    store_report(session, file, kind, parameters, report)
    if commit:
        session.commit()
    return report, True


def store_report(session: Session, file: File, kind: str, parameters: dict[str, Any], report: dict[str, Any]) -> None:
    """Add the row in the caller's transaction; a row stored meanwhile by another process (same content, so the same
    report) is kept."""
    dialect = session.get_bind().dialect.name
    # Both dialects' INSERT has ON CONFLICT DO NOTHING, each its own class.
    insert: Callable[[type[DatasetReport]], postgresql.Insert | sqlite.Insert]
    if dialect == "postgresql":
        insert = postgresql.insert
    elif dialect == "sqlite":
        insert = sqlite.insert
    else:  # pragma: no cover - the server supports these two
        raise NotImplementedError(f"dataset reports need SQLite or PostgreSQL, not {dialect}")
    statement = (
        insert(DatasetReport)
        .values(
            project_id=file.project_id,
            sha256=file.sha256,
            kind=kind,
            parameters_key=parameters_key(kind, parameters),
            report=_without_path(report),
        )
        .on_conflict_do_nothing(index_elements=["project_id", "sha256", "kind", "parameters_key"])
    )
    session.execute(statement)


def _without_path(report: dict[str, Any]) -> dict[str, Any]:
    """Reports are of a content, not of where it was read (a temp file at upload): readers give the file's path."""
    return {key: value for key, value in report.items() if key != "path"}


def forget_reports(session: Session, file: File) -> None:
    """Drop the reports of `file`'s content unless another live file of its project has the same content. In the
    caller's transaction."""
    twin = session.scalars(
        select(File.id).where(
            File.project_id == file.project_id,
            File.sha256 == file.sha256,
            File.id != file.id,
            File.deleted_at.is_(None),
        )
    ).first()
    if twin is None:
        session.execute(
            delete(DatasetReport).where(
                DatasetReport.project_id == file.project_id, DatasetReport.sha256 == file.sha256
            )
        )


def validation_parameters(
    *, tokenizer: tuple[str | None, str] | None, max_seq_len: int | None, other: File | None, max_problems: int
) -> dict[str, Any]:
    """What a validation report depends on besides the content: the tokenizer (its model version id and checkpoint
    path, or None), the length limit, the paired file's content and how many problems are listed."""
    return {
        "tokenizer": list(tokenizer) if tokenizer is not None else None,
        "max_seq_len": max_seq_len,
        "other_sha256": other.sha256 if other is not None else None,
        "max_problems": max_problems,
    }


# The PII scan as the server runs it: `finetune.datasets.pii.scan_file` with its defaults.
PII_PARAMETERS: dict[str, Any] = {"default_region": "US", "person_model": None}
