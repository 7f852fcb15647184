"""OpenAI fine-tuning jobs: create, list, retrieve, cancel, pause, resume, events, checkpoints.

Request and response bodies mirror OpenAI's field for field (the official client parses them). `method` is
`finetune.settings.FineTuneSettings`, the model `zaya finetune` and the worker read too; our additions live inside
the method's block (`method.supervised` or `method.dpo`): `adapter` ("lora" | "full"), `lora` settings,
`merge_adapter`, and extra hyperparameters. One addition is top-level, as OpenAI adds its own fields: `devices`,
the number of processes (one per GPU) an attempt trains with, data-parallel; the job's `batch_size` is the batch
of all of them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field, StrictInt, field_validator
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from finetune.settings import FineTuneSettings, Hyperparameters, SupervisedSettings
from server.api.deps import DataDep, ListingScopeDep, OwnedJob, SessionDep, SettingsDep, set_audit_target
from server.api.schemas import ListResponse, RequestBody, RowObject, UnixTime
from server.db.models import Checkpoint, FineTuningJob, ModelVersion
from server.errors import InvalidRequest
from server.services import jobs as job_service
from server.services import model_resolution, training, workers
from server.services.access import Principal
from server.settings import Settings

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])

EVENT_ID_PREFIX = "ftevent-"
MAX_DEVICES = 64
# OpenAI's limits on metadata: 16 pairs, keys of at most 64 characters, values of at most 512. A listing takes at most
# as many `metadata[key]=value` filters.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_LENGTH = 64
MAX_METADATA_VALUE_LENGTH = 512


def metadata_problem(pairs: Sequence[tuple[object, object]], what: str) -> str | None:
    """Why `pairs` break OpenAI's metadata limits, or None."""
    if len(pairs) > MAX_METADATA_PAIRS:
        return f"metadata: at most {MAX_METADATA_PAIRS} {what}, got {len(pairs)}."
    for key, value in pairs:
        if isinstance(key, str) and len(key) > MAX_METADATA_KEY_LENGTH:
            return f"metadata: keys are at most {MAX_METADATA_KEY_LENGTH} characters, got one of {len(key)}."
        if isinstance(value, str) and len(value) > MAX_METADATA_VALUE_LENGTH:
            return f"metadata: values are at most {MAX_METADATA_VALUE_LENGTH} characters, got one of {len(value)}."
    return None


# --- requests -----------------------------------------------------------------------------------------------------


class JobCreate(RequestBody):
    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1)
    validation_file: str | None = None
    suffix: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9_-]*$")
    seed: StrictInt | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: (
        dict[
            Annotated[str, Field(max_length=MAX_METADATA_KEY_LENGTH)],
            Annotated[str, Field(max_length=MAX_METADATA_VALUE_LENGTH)],
        ]
        | None
    ) = Field(default=None, max_length=MAX_METADATA_PAIRS)
    method: FineTuneSettings | None = None
    # OpenAI's older top-level form; used when `method` is absent.
    hyperparameters: Hyperparameters | None = None
    integrations: list[dict[str, Any]] | None = None
    # Ours: processes (one per GPU) an attempt trains with, data-parallel (`torchrun --nproc-per-node`).
    devices: StrictInt = Field(default=1, ge=1, le=MAX_DEVICES)

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_limits(cls, metadata: Any) -> Any:
        # Before the per-key checks, so an error names `metadata` rather than a (long, client-chosen) key.
        if isinstance(metadata, dict) and (problem := metadata_problem(list(metadata.items()), "pairs")):
            raise ValueError(problem)
        return metadata

    def effective_method(self) -> FineTuneSettings:
        if self.method is not None:
            if self.hyperparameters is not None:
                raise InvalidRequest("Give hyperparameters inside 'method', not both.", param="hyperparameters")
            return self.method
        hyperparameters = self.hyperparameters or Hyperparameters()
        return FineTuneSettings(supervised=SupervisedSettings(hyperparameters=hyperparameters))


# --- responses (OpenAI's objects) ----------------------------------------------------------------------------------


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


# The pydantic plugin names `hyperparameters` by its alias `method` in `__init__`, beside the field `method`.
class JobObject(RowObject):  # type: ignore[no-redef]
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: UnixTime
    error: JobError | None
    fine_tuned_model: str | None
    finished_at: UnixTime | None
    # OpenAI's three, read from the method's block: "auto" where the job left them to us, until a run chose them.
    hyperparameters: dict[str, Any] = Field(validation_alias="method")
    model: str
    organization_id: str = model_resolution.ORGANIZATION
    result_files: list[str] = []
    seed: int
    status: str
    trained_tokens: int | None
    training_file: str = Field(validation_alias="training_file_id")
    validation_file: str | None = Field(validation_alias="validation_file_id")
    # Unix seconds while running: when training should end at the pace of its steps so far; null otherwise.
    estimated_finish: UnixTime | None = None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = Field(validation_alias="user_metadata")
    method: dict[str, Any]
    user_provided_suffix: str | None = Field(validation_alias="suffix")
    devices: int

    @field_validator("hyperparameters", mode="before")
    @classmethod
    def _openai_hyperparameters(cls, method: dict[str, Any]) -> dict[str, Any]:
        block = method.get(method.get("type", "supervised")) or {}
        hyper = block.get("hyperparameters") or {}
        return {key: hyper.get(key, "auto") for key in job_service.OPENAI_HYPERPARAMETERS}


class EstimateObject(BaseModel):
    """Ours: what a job with a create request's body would train, before it is created (nothing is stored)."""

    object: Literal["fine_tuning.job.estimate"] = "fine_tuning.job.estimate"
    model: str
    training_file: str
    validation_file: str | None
    method: dict[str, Any]
    n_examples: int
    # Tokens that carry loss in one pass over the training file (assistant turns; both answers of a DPO pair).
    n_trained_tokens_per_epoch: int
    # The numbers the run will use, "auto" resolved from the dataset (n_epochs, batch_size, learning rate, ...).
    hyperparameters: dict[str, Any]
    n_steps: int
    # n_trained_tokens_per_epoch x n_epochs (scaled to the steps run when max_steps ends the run early): what the
    # job's trained_tokens will be.
    trained_tokens: int
    # From earlier succeeded jobs on the same base model, method type and adapter kind; null when there are none.
    trained_tokens_per_second: float | None
    estimated_seconds: float | None
    throughput_source: str
    throughput_jobs: list[str]


class EventObject(RowObject):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: UnixTime
    level: str
    message: str
    data: dict[str, Any] | None
    type: str

    @field_validator("id", mode="before")
    @classmethod
    def _event_id(cls, row_id: int | str) -> str:
        return f"{EVENT_ID_PREFIX}{row_id}" if isinstance(row_id, int) else row_id


class CheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: UnixTime
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, Any]
    step_number: int

    @classmethod
    def of(cls, checkpoint: Checkpoint, job: FineTuningJob, model_name: str) -> CheckpointObject:
        return cls(
            id=checkpoint.id,
            created_at=checkpoint.created_at,
            fine_tuned_model_checkpoint=f"{model_name}:ckpt-step-{checkpoint.step}",
            fine_tuning_job_id=job.id,
            metrics={"step": checkpoint.step, **(checkpoint.metrics or {})},
            step_number=checkpoint.step,
        )


# --- routes -------------------------------------------------------------------------------------------------------


def _create(session: Session, settings: Settings, body: JobCreate, owner: Principal) -> FineTuningJob:
    method = body.effective_method()
    training.check_inputs(method, has_validation_file=body.validation_file is not None)
    workers.check_devices(session, body.devices)
    batch_size = method.hyperparameters.batch_size
    if isinstance(batch_size, int) and batch_size % body.devices:
        message = f"The batch size {batch_size} does not split evenly over {body.devices} devices."
        raise InvalidRequest(message, param="devices", code="invalid_value")
    return job_service.create_job(
        session,
        owner,
        model=body.model,
        training_file=body.training_file,
        validation_file=body.validation_file,
        method=method.model_dump(),
        suffix=body.suffix,
        seed=body.seed,
        metadata=body.metadata,
        devices=body.devices,
        max_jobs=settings.project_max_concurrent_jobs,
    )


@router.post("", name="fine_tuning.jobs.create")
async def create_job(
    body: JobCreate, request: Request, session: SessionDep, settings: SettingsDep, principal: DataDep
) -> JobObject:
    job = await run_in_threadpool(_create, session, settings, body, principal)
    set_audit_target(request, job.id)
    return JobObject.model_validate(job)


@router.post("/estimate", name="fine_tuning.jobs.estimate")
async def estimate_job(
    body: JobCreate, session: SessionDep, settings: SettingsDep, principal: DataDep
) -> EstimateObject:
    """The trained tokens and training time of the job this body would create (the body of `POST
    /v1/fine_tuning/jobs`); its files are validated against the base model here, at once."""
    method = body.effective_method()
    training.check_inputs(method, has_validation_file=body.validation_file is not None)
    await run_in_threadpool(workers.check_devices, session, body.devices)
    estimate, job_ids = await run_in_threadpool(
        training.estimate,
        session,
        settings,
        principal.scope,
        model=body.model,
        training_file=body.training_file,
        validation_file=body.validation_file,
        settings=method,
    )
    data = estimate.to_dict()
    return EstimateObject(
        model=body.model,
        training_file=body.training_file,
        validation_file=body.validation_file,
        method=method.model_dump(),
        throughput_jobs=job_ids,
        **{key: value for key, value in data.items() if key != "throughput_source"},
        throughput_source=data["throughput_source"] or "",
    )


@router.get("", name="fine_tuning.jobs.list")
def list_jobs(
    request: Request,
    session: SessionDep,
    _: DataDep,
    scope: ListingScopeDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> ListResponse[JobObject]:
    # OpenAI filters by metadata with `metadata[key]=value` query parameters.
    filters = [
        (key[len("metadata[") : -1], value)
        for key, value in request.query_params.multi_items()
        if key.startswith("metadata[") and key.endswith("]")
    ]
    if problem := metadata_problem(filters, "metadata filters"):
        raise InvalidRequest(problem, param="metadata")
    metadata = dict(filters)
    rows, has_more = job_service.list_jobs(session, scope, after=after, limit=limit, metadata=metadata or None)
    return ListResponse[JobObject](data=rows, has_more=has_more)


@router.get("/{fine_tuning_job_id}", name="fine_tuning.jobs.get")
def get_job(job: OwnedJob) -> JobObject:
    return JobObject.model_validate(job)


@router.post("/{fine_tuning_job_id}/cancel", name="fine_tuning.jobs.cancel")
def cancel_job(job: OwnedJob, session: SessionDep) -> JobObject:
    return JobObject.model_validate(job_service.cancel_job(session, job))


@router.post("/{fine_tuning_job_id}/pause", name="fine_tuning.jobs.pause")
def pause_job(job: OwnedJob, session: SessionDep) -> JobObject:
    return JobObject.model_validate(job_service.pause_job(session, job))


@router.post("/{fine_tuning_job_id}/resume", name="fine_tuning.jobs.resume")
def resume_job(job: OwnedJob, session: SessionDep) -> JobObject:
    return JobObject.model_validate(job_service.resume_job(session, job))


@router.get("/{fine_tuning_job_id}/events", name="fine_tuning.jobs.events")
def list_events(
    job: OwnedJob,
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> ListResponse[EventObject]:
    cursor = None
    if after is not None:
        number = after.removeprefix(EVENT_ID_PREFIX)
        if not number.isdigit():
            raise InvalidRequest(f"No such event for 'after': {after}", param="after")
        cursor = int(number)
    rows, has_more = job_service.list_events(session, job, after=cursor, limit=limit)
    return ListResponse[EventObject](data=rows, has_more=has_more)


@router.get("/{fine_tuning_job_id}/checkpoints", name="fine_tuning.jobs.checkpoints")
def list_checkpoints(
    job: OwnedJob,
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> ListResponse[CheckpointObject]:
    rows, has_more = job_service.list_checkpoints(session, job, after=after, limit=limit)
    base = session.get(ModelVersion, job.base_version_id) if job.base_version_id else None
    name = job.fine_tuned_model or (
        model_resolution.fine_tuned_model_name(job, base) if base is not None else f"ft:{job.model}"
    )
    data = [CheckpointObject.of(checkpoint, job, name) for checkpoint in rows]
    return ListResponse[CheckpointObject](data=data, has_more=has_more)
