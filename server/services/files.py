"""Uploaded files: stored atomically under `<data_dir>/files/<file-id>`, validated, listed and soft-deleted."""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import or_, select, tuple_
from sqlalchemy.orm import Session

from finetune.datasets.pii import PiiReport, scan_file
from finetune.datasets.validation import DEFAULT_MAX_PROBLEMS, ValidationReport, validate_dataset
from server.db.base import utcnow
from server.db.models import ACTIVE_JOB_STATUSES, File, FineTuningJob, new_id
from server.errors import Conflict, InvalidRequest, NotFound
from server.services import dataset_reports
from server.services.access import Principal, Scope
from server.services.quotas import check_storage
from server.services.storage import StreamedFile
from server.settings import Settings

logger = logging.getLogger(__name__)

SUPPORTED_PURPOSES = ("fine-tune",)
MAX_FILENAME_LENGTH = 512


def content_path(settings: Settings, file: File) -> Path:
    return settings.files_dir / file.id


# The checks of an upload (no tokenizer: the file is not yet tied to a model), as the console shows them too.
UPLOAD_VALIDATION = dataset_reports.validation_parameters(
    tokenizer=None, max_seq_len=None, other=None, max_problems=DEFAULT_MAX_PROBLEMS
)


def check_dataset(path: Path) -> ValidationReport:
    """The one place uploads meet the fine-tuning validator: any problem refuses the upload with line numbers."""
    report = validate_dataset(path, max_problems=DEFAULT_MAX_PROBLEMS)
    if not report.is_valid:
        lines = report.problem_lines()
        raise InvalidRequest(
            f"Invalid fine-tuning file ({report.n_problems} problem{'s' if report.n_problems != 1 else ''}):\n"
            + "\n".join(lines),
            param="file",
            code="invalid_file",
        )
    return report


def scan_for_pii(path: Path, policy: str) -> tuple[str | None, PiiReport | None]:
    """The upload's PII scan under `Settings.upload_pii_scan`: `reject` refuses a file with any finding, `report`
    returns a summary for the file's `status_details` (and the report), `off` skips the scan."""
    if policy == "off":
        return None, None
    report = scan_file(path)
    if not report.total:
        return "PII scan: nothing found.", report
    found = ", ".join(
        f"{pii_type} {count} (lines {', '.join(map(str, report.example_lines[pii_type][:5]))})"
        for pii_type, count in report.counts.items()
        if count
    )
    summary = f"{report.total} matches on {report.n_lines_with_pii} of {report.n_lines} lines: {found}"
    if policy == "reject":
        raise InvalidRequest(
            f"The file contains personal data ({summary}). Redact it first (`zaya data pii FILE --redact OUT`).",
            param="file",
            code="pii_detected",
        )
    return f"PII scan: {summary}.", report


def create_file(
    session: Session,
    settings: Settings,
    upload: StreamedFile | None,
    *,
    filename: str | None,
    purpose: str | None,
    owner: Principal,
) -> File:
    """Validate a received upload and store it in `owner`'s project: the row and the content appear together or not
    at all."""
    try:
        if not purpose:
            raise InvalidRequest("Missing required parameter: 'purpose'.", param="purpose", code="missing_required")
        if purpose not in SUPPORTED_PURPOSES:
            raise InvalidRequest(
                f"Invalid purpose {purpose!r}: supported purposes are {', '.join(SUPPORTED_PURPOSES)}.",
                param="purpose",
                code="invalid_value",
            )
        if upload is None:
            raise InvalidRequest("Missing required parameter: 'file'.", param="file", code="missing_required")
        upload.finish_writing()
        validation = check_dataset(upload.temp_path)
        pii_summary, pii_report = scan_for_pii(upload.temp_path, settings.upload_pii_scan)

        file = File(
            id=new_id("file-"),
            filename=(filename or "upload.jsonl")[:MAX_FILENAME_LENGTH],
            purpose=purpose,
            bytes=upload.size,
            sha256=upload.sha256,
            created_by=owner.key_id,
            project_id=owner.project_id,
            status_details=pii_summary,
        )
        check_storage(session, owner.project_id, upload.size, settings.project_max_stored_bytes)
        session.add(file)
        session.flush()
        # Stored with the file: the console's dataset page reads them instead of reading the file again.
        dataset_reports.store_report(session, file, dataset_reports.VALIDATION, UPLOAD_VALIDATION, validation.to_dict())
        if pii_report is not None:
            dataset_reports.store_report(
                session, file, dataset_reports.PII, dataset_reports.PII_PARAMETERS, pii_report.to_dict()
            )
        stored = upload.commit(file.id)
        try:
            session.commit()
        except BaseException:
            stored.unlink(missing_ok=True)
            raise
        return file
    finally:
        if upload is not None and upload.committed_path is None:
            upload.discard()


def get_file(session: Session, scope: Scope, file_id: str) -> File:
    file = scope.get(session, File, file_id)
    if file is None or file.deleted_at is not None:
        raise NotFound(f"No such File object: {file_id}", param="id")
    return file


def list_files(
    session: Session, scope: Scope, *, purpose: str | None, limit: int, order: str, after: str | None
) -> tuple[list[File], bool]:
    """A page of the scope's files (newest first unless order='asc') and whether more follow."""
    ascending = order == "asc"
    columns = (File.created_at, File.id)
    query = scope.owned(select(File).where(File.deleted_at.is_(None)), File.project_id)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    if after is not None:
        cursor = scope.get(session, File, after)
        if cursor is None:
            raise InvalidRequest(f"No such File object for 'after': {after}", param="after")
        position = (cursor.created_at, cursor.id)
        query = query.where(tuple_(*columns) > position if ascending else tuple_(*columns) < position)
    query = query.order_by(*(column.asc() if ascending else column.desc() for column in columns)).limit(limit + 1)
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, settings: Settings, file: File) -> None:
    """Remove the content; keep the row (marked deleted) so lineage still names the dataset and its hash."""
    in_use = session.execute(
        select(FineTuningJob.id, FineTuningJob.project_id)
        .where(or_(FineTuningJob.training_file_id == file.id, FineTuningJob.validation_file_id == file.id))
        .where(FineTuningJob.status.in_([status.value for status in ACTIVE_JOB_STATUSES]))
        .limit(1)
    ).first()
    if in_use is not None:
        # An admin's job in another project may train on this file: its id is not this project's to learn.
        job = f"fine-tuning job {in_use.id}" if in_use.project_id == file.project_id else "a fine-tuning job"
        raise Conflict(f"File {file.id} is in use by {job}.", param="file_id", code="file_in_use")
    file.deleted_at = utcnow()
    dataset_reports.forget_reports(session, file)
    session.commit()
    try:
        content_path(settings, file).unlink(missing_ok=True)
    except OSError:
        logger.exception("file %s is deleted but its content could not be removed", file.id)
