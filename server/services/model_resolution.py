"""From a request's `model` string to something an engine can serve (read-only over the registry tables).

Accepted forms:
- `name`: the version its `production` alias points to, else its latest active version;
- `name@<alias>` (`name@staging`, ...) and `name@<version-id>` (`name@mv-...`);
- a fine-tuned model name `ft:<base>:<org>:<suffix>:<job-id>`: the version its succeeded job registered (or a
  version registered under that name).
Anything else, archived versions and versions the caller's project may not use (`server.services.access`) are a
404 naming `model`; a version out of the caller's scope gets exactly the answer an unknown model gets. A bare `name`
without a `production` alias is its latest active version the caller may use.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.db.models import FineTuningJob, JobStatus, ModelAlias, ModelVersion
from server.engines.base import ModelRef
from server.errors import NotFound
from server.services.access import Scope

DEFAULT_ALIAS = "production"
VERSION_ID_PREFIX = "mv-"
FINE_TUNED_PREFIX = "ft:"


@dataclass(frozen=True)
class ServableModel:
    requested: str
    version_id: str  # the version that answers (the adapter's, for adapters)
    base: ModelRef  # the full checkpoint: weights and tokenizer
    adapter: ModelRef | None = None


def _not_found(model: str, why: str = "does not exist") -> NotFound:
    return NotFound(f"The model '{model}' {why}.", param="model", code="model_not_found")


def _latest_active(session: Session, scope: Scope, name: str) -> ModelVersion | None:
    return session.scalars(
        select(ModelVersion)
        .where(ModelVersion.name == name, ModelVersion.status == "active", scope.version_usable())
        .order_by(ModelVersion.version.desc())
        .limit(1)
    ).first()


def _aliased(session: Session, name: str, alias: str) -> ModelVersion | None:
    entry = session.scalars(
        select(ModelAlias).where(ModelAlias.model_name == name, ModelAlias.alias == alias)
    ).one_or_none()
    return session.get(ModelVersion, entry.version_id) if entry is not None else None


def _fine_tuned(session: Session, model: str) -> ModelVersion | None:
    job = session.scalars(
        select(FineTuningJob).where(
            FineTuningJob.fine_tuned_model == model, FineTuningJob.status == JobStatus.succeeded
        )
    ).one_or_none()
    if job is None:
        return None
    if job.result_model_version_id:
        return session.get(ModelVersion, job.result_model_version_id)
    return session.scalars(select(ModelVersion).where(ModelVersion.job_id == job.id).limit(1)).first()


def find_version(session: Session, scope: Scope, model: str) -> ModelVersion:
    """The model version a `model` string names; 404 (param `model`) if none, out of `scope` or archived."""
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
            version = _aliased(session, name, DEFAULT_ALIAS) or _latest_active(session, scope, name)
    if version is None or not scope.can_use(version):
        raise _not_found(model)
    if version.status != "active":
        raise _not_found(model, f"points to the archived version {version.id}")
    return version


def resolve(session: Session, scope: Scope, model: str) -> ServableModel:
    version = find_version(session, scope, model)
    if version.kind != "adapter":
        return ServableModel(model, version.id, ModelRef(version.id, Path(version.path)))
    base = session.get(ModelVersion, version.base_version_id) if version.base_version_id else None
    if base is None or base.kind != "full":
        raise _not_found(model, f"is an adapter ({version.id}) whose base model version is missing")
    return ServableModel(
        model, version.id, ModelRef(base.id, Path(base.path)), adapter=ModelRef(version.id, Path(version.path))
    )
