"""Admin: projects (create, list, retrieve), as OpenAI's `/v1/organization/projects`. Keys are made in a project with
`POST /v1/admin/keys {"project": ...}`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.api.deps import AdminDep, AdminProject, SessionDep, set_audit_target
from server.api.schemas import ListResponse, ProjectCreate, ProjectObject
from server.services import projects as project_service

router = APIRouter(prefix="/v1/admin/projects", tags=["admin"])


@router.post("", name="projects.create")
def create_project(body: ProjectCreate, request: Request, session: SessionDep, _: AdminDep) -> ProjectObject:
    project = project_service.create_project(session, body.name)
    set_audit_target(request, project.id)
    return ProjectObject.model_validate(project)


@router.get("", name="projects.list")
def list_projects(session: SessionDep, _: AdminDep) -> ListResponse[ProjectObject]:
    return ListResponse[ProjectObject](data=project_service.list_projects(session))


@router.get("/{project_id}", name="projects.get")
def get_project(project: AdminProject) -> ProjectObject:
    return ProjectObject.model_validate(project)
