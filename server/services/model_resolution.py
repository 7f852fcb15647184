"""From a request's `model` string to something an engine can serve (read-only over the registry tables).

Accepted forms:
- `name`: the version its `production` alias points to, else its latest active version;
- `name@<alias>` (`name@staging`, ...) and `name@<version-id>` (`name@mv-...`);
- a fine-tuned model name `ft:<base>:<org>:<suffix>:<job-id>`: the version its succeeded job registered (or a
  version registered under that name);
- a job's checkpoint `ft:<base>:<org>:<suffix>:<job-id>:ckpt-step-<N>` (the `fine_tuned_model_checkpoint` its
  checkpoints list), whatever the job's state: served from the checkpoint's directory, an adapter on the job's base
  version or a full checkpoint, as the final model would be. Checkpoints are not model versions: the inference
  record names them by the requested model alone.
Anything else, and archived versions, is a 404 naming `model`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.db.models import Checkpoint, FineTuningJob, JobStatus, ModelAlias, ModelVersion
from server.engines.base import ModelRef
from server.errors import NotFound

DEFAULT_ALIAS = "production"
VERSION_ID_PREFIX = "mv-"
FINE_TUNED_PREFIX = "ft:"
ORGANIZATION = "zaya"
CHECKPOINT_NAME = re.compile(r"^(?P<model>ft:.+):ckpt-step-(?P<step>[1-9][0-9]{0,9})$")


@dataclass(frozen=True)
class ServableModel:
    requested: str
    version_id: str | None  # the version that answers (the adapter's, for adapters); None for a job's checkpoint
    base: ModelRef  # the full checkpoint: weights and tokenizer
    adapter: ModelRef | None = None


def _not_found(model: str, why: str = "does not exist") -> NotFound:
    return NotFound(f"The model '{model}' {why}.", param="model", code="model_not_found")


def _latest_active(session: Session, name: str) -> ModelVersion | None:
    return session.scalars(
        select(ModelVersion)
        .where(ModelVersion.name == name, ModelVersion.status == "active")
        .order_by(ModelVersion.version.desc())
        .limit(1)
    ).first()


def _aliased(session: Session, name: str, alias: str) -> ModelVersion | None:
    entry = session.scalars(
        select(ModelAlias).where(ModelAlias.model_name == name, ModelAlias.alias == alias)
    ).one_or_none()
    return session.get(ModelVersion, entry.version_id) if entry is not None else None


def fine_tuned_model_name(job: FineTuningJob, base: ModelVersion) -> str:
    """`ft:<base>:<org>:<suffix>:<job-id>`; a fine-tune of a fine-tune keeps the root model's name as <base>."""
    base_name = base.name.split(":")[1] if base.name.startswith(FINE_TUNED_PREFIX) else base.name
    return f"ft:{base_name}:{ORGANIZATION}:{job.suffix or ''}:{job.id}"


def _named_job(session: Session, name: str) -> FineTuningJob | None:
    """The job, in any state, whose fine-tuned model is (or will be, once it succeeds) called `name`."""
    job = session.get(FineTuningJob, name.rpartition(":")[2])
    if job is None:
        return None
    if job.fine_tuned_model is not None:
        return job if job.fine_tuned_model == name else None
    base = session.get(ModelVersion, job.base_version_id) if job.base_version_id else None
    return job if base is not None and fine_tuned_model_name(job, base) == name else None


def _fine_tuned(session: Session, model: str) -> ModelVersion | None:
    job = _named_job(session, model)
    if job is None or job.status != JobStatus.succeeded:
        return None
    if job.result_model_version_id:
        return session.get(ModelVersion, job.result_model_version_id)
    return session.scalars(select(ModelVersion).where(ModelVersion.job_id == job.id).limit(1)).first()


def find_version(session: Session, model: str) -> ModelVersion:
    """The model version a `model` string names; 404 (param `model`) if none or archived."""
    version = _fine_tuned(session, model) if model.startswith(FINE_TUNED_PREFIX) else None
    if version is None:
        name, at, selector = model.partition("@")
        if not name or (at and not selector):
            raise _not_found(model)
        if selector.startswith(VERSION_ID_PREFIX):
            version = session.get(ModelVersion, selector)
            version = version if version is not None and version.name == name else None
        elif selector:
            version = _aliased(session, name, selector)
        else:
            version = _aliased(session, name, DEFAULT_ALIAS) or _latest_active(session, name)
    if version is None:
        raise _not_found(model)
    if version.status != "active":
        raise _not_found(model, f"points to the archived version {version.id}")
    return version


def _checkpoint(session: Session, model: str, job_model: str, step: int) -> ServableModel:
    """A job's checkpoint at `step`, served from its directory as the job's final model would be."""
    job = _named_job(session, job_model)
    if job is None:
        raise _not_found(model)
    query = select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == step)
    checkpoint = session.scalars(query).one_or_none()
    if checkpoint is None:
        raise _not_found(model)
    path = Path(checkpoint.path)
    reference = ModelRef(checkpoint.id, path)
    if (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        return ServableModel(model, None, reference)
    base = session.get(ModelVersion, job.base_version_id) if job.base_version_id else None
    if base is None or base.kind != "full":
        raise _not_found(model, f"is a checkpoint of {job.id}, whose base model version is missing")
    if not (path / "adapter_config.json").is_file():
        raise _not_found(model, f"is a checkpoint of {job.id} whose files are gone")
    return ServableModel(model, None, ModelRef(base.id, Path(base.path)), adapter=reference)


def resolve(session: Session, model: str) -> ServableModel:
    checkpoint = CHECKPOINT_NAME.match(model)
    if checkpoint is not None:
        return _checkpoint(session, model, checkpoint["model"], int(checkpoint["step"]))
    version = find_version(session, model)
    if version.kind != "adapter":
        return ServableModel(model, version.id, ModelRef(version.id, Path(version.path)))
    base = session.get(ModelVersion, version.base_version_id) if version.base_version_id else None
    if base is None or base.kind != "full":
        raise _not_found(model, f"is an adapter ({version.id}) whose base model version is missing")
    return ServableModel(
        model, version.id, ModelRef(base.id, Path(base.path)), adapter=ModelRef(version.id, Path(version.path))
    )
