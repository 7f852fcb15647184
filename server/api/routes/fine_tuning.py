"""OpenAI fine-tuning jobs: create, list, retrieve, cancel, pause, resume, events, checkpoints.

Request and response bodies mirror OpenAI's field for field (the official client parses them). `method` is
`finetune.settings.FineTuneSettings`, the model `zaya finetune` and the worker read too; our additions live inside
the method's block (`method.supervised` or `method.dpo`): `adapter` ("lora" | "full"), `lora` settings,
`merge_adapter`, and extra hyperparameters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.concurrency import run_in_threadpool

from finetune.settings import FineTuneSettings, Hyperparameters, SupervisedSettings
from server.api.deps import DataDep, SessionDep, set_audit_target
from server.api.schemas import unix
from server.db.models import Checkpoint, FineTuningJob, JobEvent, ModelVersion
from server.errors import InvalidRequest
from server.services import jobs as job_service
from server.services import training

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])

EVENT_ID_PREFIX = "ftevent-"
OPENAI_HYPERPARAMETERS = ("batch_size", "learning_rate_multiplier", "n_epochs")


# --- requests -----------------------------------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobCreate(Strict):
    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1)
    validation_file: str | None = None
    suffix: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9_-]*$")
    seed: StrictInt | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    method: FineTuneSettings | None = None
    # OpenAI's older top-level form; used when `method` is absent.
    hyperparameters: Hyperparameters | None = None
    integrations: list[dict[str, Any]] | None = None

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


class JobObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: dict[str, Any]
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: str
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None
    method: dict[str, Any]
    user_provided_suffix: str | None

    @classmethod
    def of(cls, job: FineTuningJob) -> JobObject:
        method = job.method.get(job.method.get("type", "supervised")) or {}
        hyper = method.get("hyperparameters") or {}
        return cls(
            id=job.id,
            created_at=unix(job.created_at),
            error=JobError(**job.error) if job.error else None,
            fine_tuned_model=job.fine_tuned_model,
            finished_at=unix(job.finished_at),
            hyperparameters={key: hyper.get(key, "auto") for key in OPENAI_HYPERPARAMETERS},
            model=job.model,
            organization_id=job_service.ORGANIZATION,
            result_files=[],
            seed=job.seed,
            status=job.status,
            trained_tokens=job.trained_tokens,
            training_file=job.training_file_id,
            validation_file=job.validation_file_id,
            metadata=job.user_metadata,
            method=job.method,
            user_provided_suffix=job.suffix,
        )


class EventObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    data: dict[str, Any] | None
    type: str

    @classmethod
    def of(cls, event: JobEvent) -> EventObject:
        return cls(
            id=f"{EVENT_ID_PREFIX}{event.id}",
            created_at=unix(event.created_at),
            level=event.level,
            message=event.message,
            data=event.data,
            type=event.type,
        )


class CheckpointObject(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: dict[str, Any]
    step_number: int

    @classmethod
    def of(cls, checkpoint: Checkpoint, job: FineTuningJob, model_name: str) -> CheckpointObject:
        return cls(
            id=checkpoint.id,
            created_at=unix(checkpoint.created_at),
            fine_tuned_model_checkpoint=f"{model_name}:ckpt-step-{checkpoint.step}",
            fine_tuning_job_id=job.id,
            metrics={"step": checkpoint.step, **(checkpoint.metrics or {})},
            step_number=checkpoint.step,
        )


class Page(BaseModel):
    object: Literal["list"] = "list"
    data: list[Any]
    has_more: bool


# --- routes -------------------------------------------------------------------------------------------------------


def _create(session, body: JobCreate, created_by: str) -> FineTuningJob:
    method = body.effective_method()
    training.check_inputs(method, has_validation_file=body.validation_file is not None)
    return job_service.create_job(
        session,
        model=body.model,
        training_file=body.training_file,
        validation_file=body.validation_file,
        method=method.model_dump(),
        suffix=body.suffix,
        seed=body.seed,
        metadata=body.metadata,
        created_by=created_by,
    )


@router.post("", name="fine_tuning.jobs.create")
async def create_job(body: JobCreate, request: Request, session: SessionDep, principal: DataDep) -> JobObject:
    job = await run_in_threadpool(_create, session, body, principal.key_id)
    set_audit_target(request, job.id)
    return JobObject.of(job)


@router.get("", name="fine_tuning.jobs.list")
def list_jobs(
    request: Request,
    session: SessionDep,
    _: DataDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page:
    # OpenAI filters by metadata with `metadata[key]=value` query parameters.
    metadata = {
        key[len("metadata[") : -1]: value
        for key, value in request.query_params.items()
        if key.startswith("metadata[") and key.endswith("]")
    }
    rows, has_more = job_service.list_jobs(session, after=after, limit=limit, metadata=metadata or None)
    return Page(data=[JobObject.of(job) for job in rows], has_more=has_more)


@router.get("/{fine_tuning_job_id}", name="fine_tuning.jobs.get")
def get_job(fine_tuning_job_id: str, session: SessionDep, _: DataDep) -> JobObject:
    return JobObject.of(job_service.get_job(session, fine_tuning_job_id))


@router.post("/{fine_tuning_job_id}/cancel", name="fine_tuning.jobs.cancel")
def cancel_job(fine_tuning_job_id: str, session: SessionDep, _: DataDep) -> JobObject:
    return JobObject.of(job_service.cancel_job(session, job_service.get_job(session, fine_tuning_job_id)))


@router.post("/{fine_tuning_job_id}/pause", name="fine_tuning.jobs.pause")
def pause_job(fine_tuning_job_id: str, session: SessionDep, _: DataDep) -> JobObject:
    return JobObject.of(job_service.pause_job(session, job_service.get_job(session, fine_tuning_job_id)))


@router.post("/{fine_tuning_job_id}/resume", name="fine_tuning.jobs.resume")
def resume_job(fine_tuning_job_id: str, session: SessionDep, _: DataDep) -> JobObject:
    return JobObject.of(job_service.resume_job(session, job_service.get_job(session, fine_tuning_job_id)))


@router.get("/{fine_tuning_job_id}/events", name="fine_tuning.jobs.events")
def list_events(
    fine_tuning_job_id: str,
    session: SessionDep,
    _: DataDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> Page:
    job = job_service.get_job(session, fine_tuning_job_id)
    cursor = None
    if after is not None:
        number = after.removeprefix(EVENT_ID_PREFIX)
        if not number.isdigit():
            raise InvalidRequest(f"No such event for 'after': {after}", param="after")
        cursor = int(number)
    rows, has_more = job_service.list_events(session, job, after=cursor, limit=limit)
    return Page(data=[EventObject.of(event) for event in rows], has_more=has_more)


@router.get("/{fine_tuning_job_id}/checkpoints", name="fine_tuning.jobs.checkpoints")
def list_checkpoints(
    fine_tuning_job_id: str,
    session: SessionDep,
    _: DataDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> Page:
    job = job_service.get_job(session, fine_tuning_job_id)
    rows, has_more = job_service.list_checkpoints(session, job, after=after, limit=limit)
    base = session.get(ModelVersion, job.base_version_id) if job.base_version_id else None
    name = job.fine_tuned_model or (
        job_service.fine_tuned_model_name(job, base) if base is not None else f"ft:{job.model}"
    )
    data = [CheckpointObject.of(checkpoint, job, name) for checkpoint in rows]
    return Page(data=data, has_more=has_more)
