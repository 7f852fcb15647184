"""Projects (`proj_...`): created and listed by admins, named by id or by name wherever a request takes one."""

from __future__ import annotations

import re

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.db.models import Project, new_id
from server.errors import Conflict, InvalidRequest
from server.services.access import get_or_404

ID_PREFIX = "proj_"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name) or name.startswith(ID_PREFIX):
        raise InvalidRequest(
            f"Invalid project name {name!r}: lower-case letters, digits, '-' and '_' (at most 64), not starting "
            f"with '{ID_PREFIX}'.",
            param="name",
            code="invalid_value",
        )
    return name


def create_project(session: Session, name: str) -> Project:
    """Add a project. Commits; 409 when the name is taken."""
    project = Project(id=new_id(ID_PREFIX), name=check_name(name))
    session.add(project)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(f"A project named {name!r} already exists.", param="name", code="project_exists") from None
    return project


def list_projects(session: Session) -> list[Project]:
    return list(session.scalars(select(Project).order_by(Project.created_at, Project.id)))


def find_project(session: Session, reference: str) -> Project | None:
    """The project with this id or name (names never look like ids)."""
    return session.scalars(select(Project).where(or_(Project.id == reference, Project.name == reference))).first()


def require_project(session: Session, reference: str, *, param: str = "project") -> Project:
    """`find_project`, or a 400 naming `param`."""
    project = find_project(session, reference)
    if project is None:
        raise InvalidRequest(f"No such project: {reference}", param=param, code="project_not_found")
    return project


def get_project(session: Session, project_id: str) -> Project:
    """The project with this id; 404 naming `project_id` if none."""
    return get_or_404(session, Project, project_id, what="project", param="project_id", code="project_not_found")
