"""What a fine-tuning job does, without the worker's queue and leases: its settings, its files' validation, its run.

A job stores OpenAI's `method` object; `finetune.settings.FineTuneSettings` reads it back (the same model the API
validated the request with). `finetune.run` imports torch and transformers, so it is imported inside the
functions: the API server pays for it on the first job it validates, `zaya --help` never.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.db.models import File, FineTuningJob, JobStatus, ModelVersion
from server.errors import APIError, InvalidRequest
from server.services import dataset_reports, jobs
from server.services.access import Scope
from server.services.files import content_path
from server.settings import Settings

if TYPE_CHECKING:
    from finetune.datasets.validation import ValidationReport
    from finetune.estimate import TrainingEstimate
    from finetune.run import FineTuneRun
    from finetune.settings import FineTuneSettings

logger = logging.getLogger(__name__)

LEVELS = {"info": "info", "warning": "warn", "warn": "warn", "error": "error"}
MAX_ERROR_MESSAGE = 2000


def settings_of(job: FineTuningJob) -> FineTuneSettings:
    """The job's settings, read back from its stored `method`."""
    return settings_of_method(job.method)


def settings_of_method(method: dict[str, Any]) -> FineTuneSettings:
    from finetune.settings import FineTuneSettings

    return FineTuneSettings.model_validate(method)


def check_inputs(settings: FineTuneSettings, *, has_validation_file: bool) -> None:
    """What the settings ask of the job's files, as a 400 naming the setting."""
    from finetune.settings import FinetuneError

    try:
        settings.check_inputs(has_validation_file=has_validation_file)
    except FinetuneError as error:
        message = f"Invalid fine-tuning settings: {error}"
        raise InvalidRequest(message, param=error.field, code="invalid_value") from None


def file_error(session: Session, app_settings: Settings, job: FineTuningJob) -> dict[str, Any] | None:
    """The job's error if one of its files fails the fine-tuning validator for its base model, else None: checked as
    the trainer will check them, with the base model's tokenizer (chat template, special tokens) and length limit."""
    base = session.get(ModelVersion, job.base_version_id) if job.base_version_id else None
    if base is None:
        message = f"The job's base model version {job.base_version_id} does not exist."
        return {"code": "model_not_found", "message": message, "param": "model"}
    settings = settings_of(job)
    checks = [("training_file", job.training_file_id, job.validation_file_id)]
    if job.validation_file_id is not None:
        checks.append(("validation_file", job.validation_file_id, None))
    for param, file_id, other_id in checks:
        try:
            file = jobs.usable_file(session, Scope.everything(), file_id, param)
            other = session.get_one(File, other_id) if other_id else None
            _, problems = validated_file(session, app_settings, file, other, base=base, settings=settings)
        except APIError as error:
            problems, file = [error.message], None
        except Exception as error:  # an unreadable file or base model: the job cannot run as it is
            logger.exception("validating %s of job %s failed", param, job.id)
            problems, file = [f"{type(error).__name__}: {error}"], None
        if problems:
            name = f"{file_id} ({file.filename})" if file is not None else file_id
            message = f"{param} {name} is invalid for {base.name} v{base.version}: " + "; ".join(problems)
            return {"code": f"invalid_{param}", "message": message[:MAX_ERROR_MESSAGE], "param": param}
    return None


# Problems a job's file check lists (the rest are counted).
JOB_MAX_PROBLEMS = 10


def dataset_problems(path: Path, *, model_dir: Path, settings: FineTuneSettings, other_path: Path | None) -> list[str]:
    """The fine-tuning validator's line-numbered problems in a job's file, or why its format does not fit the job's
    method (preference data for dpo, any other format for supervised). Empty when valid."""
    limit = _max_seq_len(model_dir, settings)
    return _problems(_validation_report(path, model_dir=model_dir, max_seq_len=limit, other_path=other_path), settings)


def validated_file(
    session: Session,
    app_settings: Settings,
    file: File,
    other: File | None,
    *,
    base: ModelVersion,
    settings: FineTuneSettings,
) -> tuple[ValidationReport, list[str]]:
    """`file`'s validation report against `base` (with `other` as its paired file) and its problems (see
    `dataset_problems`). The report is computed once per content, base model and limit, then read back
    (`server.services.dataset_reports`): an estimate, the job it leads to and the next estimate share it. Commits."""
    from finetune.datasets.validation import ValidationReport

    model_dir = Path(base.path)
    limit = _max_seq_len(model_dir, settings)
    path = content_path(app_settings, file)
    other_path = content_path(app_settings, other) if other is not None else None
    parameters = dataset_reports.validation_parameters(
        tokenizer=(base.id, str(base.path)), max_seq_len=limit, other=other, max_problems=JOB_MAX_PROBLEMS
    )
    stored, _ = dataset_reports.stored_report(
        session,
        file,
        dataset_reports.VALIDATION,
        parameters,
        lambda: _validation_report(path, model_dir=model_dir, max_seq_len=limit, other_path=other_path).to_dict(),
    )
    report = ValidationReport.from_dict(stored, path)
    return report, _problems(report, settings)


def _max_seq_len(model_dir: Path, settings: FineTuneSettings) -> int:
    from zaya_model import ZayaConfig

    return settings.hyperparameters.max_seq_len or ZayaConfig.from_pretrained(model_dir).max_position_embeddings


def _validation_report(path: Path, *, model_dir: Path, max_seq_len: int, other_path: Path | None) -> ValidationReport:
    """The file's validation report against the base model's tokenizer (chat template, special tokens)."""
    from transformers import AutoTokenizer

    from finetune.datasets.validation import validate_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return validate_dataset(
        path, tokenizer=tokenizer, max_seq_len=max_seq_len, other_path=other_path, max_problems=JOB_MAX_PROBLEMS
    )


def _problems(report: ValidationReport, settings: FineTuneSettings) -> list[str]:
    if not report.is_valid:
        return report.problem_lines()
    problem = settings.dataset_format_problem(report.format)
    return [f"the file {problem}"] if problem else []


# Earlier jobs whose recorded throughput an estimate reads (the newest that many on the same base model and kind).
THROUGHPUT_JOBS = 5


def estimate(
    session: Session,
    app_settings: Settings,
    scope: Scope,
    *,
    model: str,
    training_file: str,
    validation_file: str | None,
    settings: FineTuneSettings,
) -> tuple[TrainingEstimate, list[str]]:
    """What a job with these inputs would train, before it is created: its trained tokens (`finetune.estimate`)
    and, when earlier jobs in `scope` on the same base model and of the same method and adapter kind succeeded, the
    time at their median recorded throughput. 4xx naming the field for bad input. Returns (estimate, the jobs read)."""
    from finetune.estimate import estimate_tokens
    from zaya_model import ZayaConfig

    base = jobs.trainable_base(
        session, scope, model=model, training_file=training_file, validation_file=validation_file
    )
    checks = [("training_file", training_file, validation_file)]
    if validation_file is not None:
        checks.append(("validation_file", validation_file, None))
    reports = {}
    for param, file_id, other_id in checks:
        file = session.get_one(File, file_id)  # `trainable_base` found both files
        other = session.get_one(File, other_id) if other_id else None
        report, problems = validated_file(session, app_settings, file, other, base=base, settings=settings)
        if problems:
            message = f"{param} {file_id} ({file.filename}) is invalid for {base.name} v{base.version}: "
            message += "; ".join(problems)
            raise InvalidRequest(message[:MAX_ERROR_MESSAGE], param=param, code=f"invalid_{param}")
        reports[param] = report
    result = estimate_tokens(settings, reports["training_file"], ZayaConfig.from_pretrained(base.path))
    rates, job_ids = recorded_throughput(session, scope, base.id, settings)
    if not rates:
        return result.with_throughput(None, f"no succeeded {settings.type} {settings.adapter} job on this model"), []
    source = f"median of the {len(rates)} latest succeeded {settings.type} {settings.adapter} jobs on this model"
    return result.with_throughput(statistics.median(rates), source), job_ids


def recorded_throughput(
    session: Session, scope: Scope, base_version_id: str, settings: FineTuneSettings
) -> tuple[list[float], list[str]]:
    """The trained tokens per second that the scope's newest succeeded jobs on this base model, of the same method
    type and adapter kind, recorded (in their model versions' metrics), and those jobs' ids."""
    query = (
        select(FineTuningJob.id, FineTuningJob.method, ModelVersion.metrics)
        .join(ModelVersion, ModelVersion.id == FineTuningJob.result_model_version_id)
        .where(FineTuningJob.base_version_id == base_version_id, FineTuningJob.status == JobStatus.succeeded)
        .order_by(FineTuningJob.finished_at.desc(), FineTuningJob.id.desc())
        .limit(200)
    )
    rows = session.execute(scope.owned(query, FineTuningJob.project_id)).all()
    rates, job_ids = [], []
    for job_id, method, metrics in rows:
        rate = (metrics or {}).get("trained_tokens_per_second")
        if not isinstance(rate, int | float) or rate <= 0:
            continue
        try:
            earlier = settings_of_method(method)
        except ValueError:
            continue
        if (earlier.type, earlier.adapter) == (settings.type, settings.adapter):
            rates.append(float(rate))
            job_ids.append(job_id)
        if len(rates) == THROUGHPUT_JOBS:
            break
    return rates, job_ids


def job_run(session: Session, app_settings: Settings, job_id: str, attempt: int) -> tuple[FineTuneRun, str | None]:
    """The run an attempt of a job makes, and the checkpoint it resumes from (None: from the start). Each attempt
    trains into its own directory (`<data dir>/jobs/<job-id>/attempt-<n>/`)."""
    from finetune.run import FineTuneRun

    job = session.get_one(FineTuningJob, job_id)
    base = session.get_one(ModelVersion, job.base_version_id)
    files = {
        file_id: content_path(app_settings, jobs.usable_file(session, Scope.everything(), file_id, "file"))
        for file_id in (job.training_file_id, job.validation_file_id)
        if file_id is not None
    }
    run = FineTuneRun(
        model_dir=str(base.path),
        train_file=str(files[job.training_file_id]),
        validation_file=str(files[job.validation_file_id]) if job.validation_file_id else None,
        output_dir=str(app_settings.data_dir / "jobs" / job.id / f"attempt-{attempt}"),
        seed=job.seed or 0,
        settings=settings_of(job),
    )
    checkpoint = jobs.latest_checkpoint(session, job.id)
    resume_from = checkpoint.path if checkpoint is not None and Path(checkpoint.path).is_dir() else None
    return run, resume_from


def is_training_error(error: Exception) -> bool:
    """True for a bad setting or dataset (the job's fault: fail it, do not retry)."""
    from finetune.run import FinetuneError

    return isinstance(error, FinetuneError)
