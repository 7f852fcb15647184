"""Who is calling and what they may see: the `Principal` (an API key's id, role and project) and its `Scope`.

Project isolation is this module's one rule. A key sees and acts on its own project's files, fine-tuning jobs (with
their events and checkpoints) and model versions; an admin key sees every project's. An object outside the caller's
scope is answered exactly as a missing one (services raise the same error for both). Every service function that
looks up or lists what a caller names takes a `Scope`; the worker and the command line use `Scope.everything()`.

Model versions are shared differently: a version limited to no project (a base model an admin registered) is usable
by every project; one limited to projects (a fine-tuning job's result is limited to its job's project) only by those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sqlalchemy import ColumnElement, Select, or_, select, true
from sqlalchemy.orm import InstrumentedAttribute, Session

from server.db.models import ApiKey, ModelVersion, ModelVersionProject, Role
from server.errors import NotFound


class ProjectOwned(Protocol):
    project_id: str


Owned = TypeVar("Owned", bound=ProjectOwned)
Row = TypeVar("Row")


@dataclass(frozen=True)
class Scope:
    """The projects whose objects a caller sees: one (`project_id`), or all of them (None)."""

    project_id: str | None

    @classmethod
    def everything(cls) -> Scope:
        return cls(None)

    def includes(self, project_id: str | None) -> bool:
        return self.project_id is None or project_id == self.project_id

    def owned(self, query: Select[Any], project_column: InstrumentedAttribute[Any]) -> Select[Any]:
        """`query` kept to the rows whose `project_column` is in the scope."""
        return query if self.project_id is None else query.where(project_column == self.project_id)

    def get(self, session: Session, model: type[Owned], object_id: str) -> Owned | None:
        """The `model` row with this id, or None when there is none or it belongs to a project out of scope."""
        row = session.get(model, object_id)
        return row if row is not None and self.includes(row.project_id) else None

    def version_usable(self) -> ColumnElement[bool]:
        """A condition on `ModelVersion`: limited to no project, or to this one among others."""
        if self.project_id is None:
            return true()
        limits = select(ModelVersionProject.version_id).where(ModelVersionProject.version_id == ModelVersion.id)
        return or_(~limits.exists(), limits.where(ModelVersionProject.project_id == self.project_id).exists())

    def can_use(self, version: ModelVersion) -> bool:
        """Whether the scope may use `version` (see `version_usable`)."""
        if self.project_id is None:
            return True
        allowed = {limit.project_id for limit in version.allowed_projects}
        return not allowed or self.project_id in allowed


def get_or_404(
    session: Session, model: type[Row], row_id: str | None, *, what: str, param: str, code: str | None = None
) -> Row:
    """The `model` row with this id, in any project (the admins' objects: versions, approval requests, projects,
    keys); a 404 "No such <what>" naming `param` if none."""
    row = session.get(model, row_id) if row_id is not None else None
    if row is None:
        raise NotFound(f"No such {what}: {row_id}", param=param, code=code)
    return row


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: the key's id, name, role and project (never its secret or hash)."""

    key_id: str
    name: str
    role: Role
    project_id: str

    @classmethod
    def from_key(cls, key: ApiKey) -> Principal:
        return cls(key_id=key.id, name=key.name, role=Role(key.role), project_id=key.project_id)

    @property
    def scope(self) -> Scope:
        return Scope.everything() if self.role is Role.admin else Scope(self.project_id)
