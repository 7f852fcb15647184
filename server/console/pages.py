"""The console's pages. Reads go through the same role dependencies and service functions as the API; every action
on a page is a call to the `/v1` API itself (see `static/console.js`), so nothing here changes state.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy.orm import Session

from server.api.deps import (
    AdminDep,
    AnalystDep,
    DataDep,
    ListingScopeDep,
    OwnedFile,
    OwnedJob,
    SessionDep,
    SettingsDep,
)
from server.console import datasets
from server.console.templating import templates
from server.db.models import FineTuningJob, JobEvent, JobStatus, ModelVersion, Role
from server.errors import InvalidRequest
from server.services import approvals, registry
from server.services import audit as audit_service
from server.services import files as file_service
from server.services import jobs as job_service
from server.services import keys as key_service
from server.services import models as model_service
from server.services import projects as project_service
from server.services.access import Principal

router = APIRouter(prefix="/console", include_in_schema=False)

NAVIGATION = (
    ("Jobs", "/console/jobs", Role.data),
    ("Datasets", "/console/datasets", Role.data),
    ("Model versions", "/console/models", Role.admin),
    ("Keys", "/console/keys", Role.admin),
    ("Audit log", "/console/audit", Role.admin),
    ("Playground", "/console/playground", Role.analyst),
)
FINISHED = {JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled}
EVENTS_SHOWN = 200


def render(request: Request, template: str, principal: Principal, status_code: int = 200, **context: Any) -> Response:
    session = getattr(request.state, "console_session", None)
    return templates.TemplateResponse(
        request,
        template,
        {
            "principal": principal,
            "csrf": session.csrf if session is not None else "",
            "navigation": [(label, href) for label, href, role in NAVIGATION if principal.role.allows(role)],
            **context,
        },
        status_code=status_code,
    )


def max_steps(job: FineTuningJob) -> int | None:
    block = job.method.get(job.method.get("type", "supervised")) or {}
    return (block.get("hyperparameters") or {}).get("max_steps")


def latest_step(events: list[JobEvent]) -> int | None:
    """The step of the newest metrics event (events come newest first)."""
    return next((event.data["step"] for event in events if event.type == "metrics" and event.data), None)


def progress(job: FineTuningJob, step: int | None) -> float | None:
    """Fraction done, when the job has a step budget to measure it by."""
    if job.status == JobStatus.succeeded:
        return 1.0
    total = max_steps(job)
    return min(1.0, (step or 0) / total) if total else None


@router.get("/", name="console.home")
def home(principal: AnalystDep) -> RedirectResponse:
    return RedirectResponse("/console/jobs" if principal.role.allows(Role.data) else "/console/playground", 303)


@router.get("/jobs", name="console.jobs")
def jobs_page(request: Request, session: SessionDep, principal: DataDep, scope: ListingScopeDep) -> Response:
    rows, has_more = job_service.list_jobs(session, scope, after=None, limit=50)
    jobs = []
    for job in rows:
        step = latest_step(job_service.list_events(session, job, after=None, limit=20)[0])
        jobs.append({"job": job, "step": step, "max_steps": max_steps(job), "progress": progress(job, step)})
    # What the new-job form offers: the caller's own files and models (a job is made in its key's project).
    files, _ = file_service.list_files(
        session, principal.scope, purpose="fine-tune", limit=200, order="desc", after=None
    )
    models = [name for name, _ in model_service.list_model_ids(session, principal.scope)]
    return render(request, "jobs.html", principal, jobs=jobs, has_more=has_more, files=files, models=models)


@router.get("/jobs/{fine_tuning_job_id}", name="console.job")
def job_page(job: OwnedJob, request: Request, session: SessionDep, principal: DataDep) -> Response:
    checkpoints, _ = job_service.list_checkpoints(session, job, after=None, limit=100)
    events, _ = job_service.list_events(session, job, after=None, limit=EVENTS_SHOWN)
    step = latest_step(events)
    version = session.get(ModelVersion, job.result_model_version_id) if job.result_model_version_id else None
    return render(
        request,
        "job.html",
        principal,
        job=job,
        evaluation=version.evaluation if version is not None else None,
        checkpoints=checkpoints,
        events=events,
        step=step,
        max_steps=max_steps(job),
        progress=progress(job, step),
        finished=job.status in FINISHED,
    )


@router.get("/datasets", name="console.datasets")
def datasets_page(
    request: Request, session: SessionDep, settings: SettingsDep, principal: DataDep, scope: ListingScopeDep
) -> Response:
    files, _ = file_service.list_files(session, scope, purpose=None, limit=200, order="desc", after=None)
    return render(request, "datasets.html", principal, files=files, max_upload_bytes=settings.max_upload_bytes)


@router.get("/datasets/{file_id}", name="console.dataset")
def dataset_page(
    file: OwnedFile,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    principal: DataDep,
    model: str | None = None,
    line: int = 1,
) -> Response:
    models = [name for name, _ in model_service.list_model_ids(session, principal.scope)]
    model = model or (models[0] if models else None)
    if line < 1:
        raise InvalidRequest("line: line numbers start at 1", param="line")
    path = file_service.content_path(settings, file)
    report = datasets.inspect(session, principal.scope, file, path, model=model, line=line)
    return render(request, "dataset.html", principal, file=file, models=models, model=model, line=line, report=report)


@router.get("/models", name="console.models")
def models_page(
    request: Request, session: SessionDep, settings: SettingsDep, principal: AdminDep, scope: ListingScopeDep
) -> Response:
    versions = registry.list_versions(session, scope)
    return render(
        request,
        "models.html",
        principal,
        versions=versions,
        lineages={version.id: registry.lineage(session, version) for version in versions},
        aliases=registry.list_aliases(session),
        history=registry.alias_history(session),
        approvals=approvals.list_approvals(session, status=None, model_name=None),
        four_eyes=settings.four_eyes,
        evaluation_gate=settings.evaluation_gate,
    )


def _projects(session: Session) -> dict[str, Any]:
    """Every project, and their names by id: what the admin pages show and offer to choose from."""
    projects = project_service.list_projects(session)
    return {"projects": projects, "project_names": {project.id: project.name for project in projects}}


@router.get("/keys", name="console.keys")
def keys_page(request: Request, session: SessionDep, principal: AdminDep, scope: ListingScopeDep) -> Response:
    return render(request, "keys.html", principal, keys=key_service.list_keys(session, scope), **_projects(session))


def _moment(name: str, value: str) -> datetime | None:
    """A filter time from the form: ISO 8601; without a zone it is read as UTC (what the page shows)."""
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(f"{name}: not a date and time (use e.g. 2026-01-01T00:00)", param=name) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@router.get("/audit", name="console.audit")
def audit_page(
    request: Request,
    session: SessionDep,
    principal: AdminDep,
    scope: ListingScopeDep,
    actor: str = "",
    action: str = "",
    since: str = "",
    until: str = "",
) -> Response:
    filters = {
        "project": scope.project_id or "",
        "actor": actor.strip(),
        "action": action.strip(),
        "since": since.strip(),
        "until": until.strip(),
    }
    page = {"filters": filters, **_projects(session)}
    try:
        since_moment, until_moment = _moment("since", filters["since"]), _moment("until", filters["until"])
    except InvalidRequest as error:
        return render(request, "audit.html", principal, 400, entries=[], error=error.message, **page)
    entries = audit_service.list_entries(
        session,
        scope,
        actor=filters["actor"] or None,
        action=filters["action"] or None,
        since=since_moment,
        until=until_moment,
        limit=200,
    )
    return render(request, "audit.html", principal, entries=entries, error=None, **page)


@router.get("/playground", name="console.playground")
def playground_page(request: Request, session: SessionDep, principal: AnalystDep, scope: ListingScopeDep) -> Response:
    models = [name for name, _ in model_service.list_model_ids(session, scope)]
    return render(request, "playground.html", principal, models=models)
