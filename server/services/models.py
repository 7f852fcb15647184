"""What `GET /v1/models` lists: registered model names, their aliases (`name@alias`) and fine-tuned models.

A succeeded job's model version is named after its `fine_tuned_model`, so it is listed once. Resolving a name to a
version is `server.services.model_resolution`'s job.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.db.models import FineTuningJob, JobStatus, ModelAlias, ModelVersion
from server.errors import NotFound


def list_model_ids(session: Session) -> list[tuple[str, datetime]]:
    """(model id, creation time) for every usable model, sorted by id."""
    entries: dict[str, datetime] = {}
    names = session.execute(
        select(ModelVersion.name, func.min(ModelVersion.created_at))
        .where(ModelVersion.status == "active")
        .group_by(ModelVersion.name)
    )
    entries.update({name: created for name, created in names})
    for alias in session.scalars(select(ModelAlias)):
        entries[f"{alias.model_name}@{alias.alias}"] = alias.updated_at
    fine_tuned = session.execute(
        select(FineTuningJob.fine_tuned_model, FineTuningJob.finished_at).where(
            FineTuningJob.status == JobStatus.succeeded, FineTuningJob.fine_tuned_model.is_not(None)
        )
    )
    entries.update({name: finished for name, finished in fine_tuned if name is not None and finished is not None})
    return sorted(entries.items())


def get_model_id(session: Session, model: str) -> tuple[str, datetime]:
    for entry in list_model_ids(session):
        if entry[0] == model:
            return entry
    raise NotFound(f"The model '{model}' does not exist.", param="model", code="model_not_found")
