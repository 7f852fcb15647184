"""Admin: the model registry. Versions (list, get, register, archive, lineage), aliases (promote, rollback, list,
history) and, with the four-eyes rule on, the approval requests alias moves become (list, get, approve, reject).
Every mutation is a POST, so the audit middleware records it; alias moves also land in `alias_history`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BeforeValidator, Field, StrictBool, computed_field

from server.api.deps import (
    AdminApproval,
    AdminDep,
    AdminVersion,
    ListingScopeDep,
    SessionDep,
    SettingsDep,
    set_audit_target,
)
from server.api.schemas import ListResponse, RequestBody, RowObject, UnixTime
from server.db.models import AliasApproval, AliasHistory, ApprovalStatus, ModelVersionProject
from server.services import approvals, registry

router = APIRouter(prefix="/v1/admin", tags=["admin"])


def _project_ids(limits: list[ModelVersionProject | str]) -> list[str]:
    return sorted(limit if isinstance(limit, str) else limit.project_id for limit in limits)


class ModelVersionObject(RowObject):
    id: str
    object: Literal["model_version"] = "model_version"
    name: str
    version: int
    kind: str
    path: str
    status: str
    base_version_id: str | None
    job_id: str | None
    metrics: dict[str, Any] | None
    evaluation: dict[str, Any] | None
    lineage: dict[str, Any] | None
    description: str | None
    created_at: UnixTime
    created_by: str | None
    archived_at: UnixTime | None
    # The projects that may use the version; empty: every project.
    projects: Annotated[list[str], BeforeValidator(_project_ids)] = Field(validation_alias="allowed_projects")


class AliasObject(RowObject):
    object: Literal["model_alias"] = "model_alias"
    model_name: str
    alias: str
    version_id: str
    updated_at: UnixTime
    updated_by: str | None

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented form; mypy rejects any decorated property
    @property
    def model(self) -> str:
        """What a request passes as `model`."""
        return f"{self.model_name}@{self.alias}"


class AliasMoveObject(RowObject):
    id: int
    object: Literal["model_alias.move"] = "model_alias.move"
    model_name: str
    alias: str
    action: str
    from_version_id: str | None
    to_version_id: str | None
    reason: str | None
    actor_key_id: str | None
    approved_by_key_id: str | None
    approval_id: str | None
    requested_at: UnixTime | None
    evaluation: dict[str, Any] | None
    created_at: UnixTime


class ApprovalObject(RowObject):
    id: str
    object: Literal["model_alias.approval"] = "model_alias.approval"
    model_name: str
    alias: str
    action: str
    from_version_id: str | None
    to_version_id: str
    reason: str
    force: bool
    status: str
    requested_by: str | None
    created_at: UnixTime
    decided_by: str | None
    decided_at: UnixTime | None
    decision_reason: str | None
    move: AliasMoveObject | None = None  # the alias history entry, once approved

    @classmethod
    def of(cls, approval: AliasApproval, move: AliasHistory | None = None) -> ApprovalObject:
        """The request, with the alias move it made once approved."""
        response = cls.model_validate(approval)
        response.move = AliasMoveObject.model_validate(move) if move is not None else None
        return response


class RegisterBody(RequestBody):
    name: str = Field(min_length=1, max_length=200)
    path: str = Field(min_length=1, description="a checkpoint dir (config.json) or LoRA adapter dir on the server")
    base_model: str | None = Field(default=None, description="for adapters: the model (version) it was trained on")
    description: str | None = None
    projects: list[str] | None = Field(
        default=None, description="ids or names of the only projects that may use it (default: every project)"
    )


class ProjectsBody(RequestBody):
    projects: list[str] = Field(description="ids or names of the only projects that may use it; empty: every project")


class PromoteBody(RequestBody):
    alias: str = "production"
    reason: str = Field(min_length=1)
    # Promote a version without a recorded held-out loss over a holder that has one (the evaluation gate).
    force: StrictBool = False


class RollbackBody(RequestBody):
    model_name: str
    alias: str = "production"
    reason: str = Field(min_length=1)


class DecisionBody(RequestBody):
    reason: str | None = None


@router.get("/models", name="admin_models.list")
def list_versions(
    session: SessionDep, _: AdminDep, scope: ListingScopeDep, name: str | None = None
) -> ListResponse[ModelVersionObject]:
    return ListResponse[ModelVersionObject](data=registry.list_versions(session, scope, name=name))


@router.post("/models", name="admin_models.register")
def register_version(
    body: RegisterBody, request: Request, session: SessionDep, settings: SettingsDep, principal: AdminDep
) -> ModelVersionObject:
    version = registry.register_named_version(
        session,
        name=body.name,
        path=Path(body.path),
        base_model=body.base_model,
        description=body.description,
        created_by=principal.key_id,
        projects=body.projects or [],
        serving=settings,
    )
    session.commit()
    set_audit_target(request, version.id)
    return ModelVersionObject.model_validate(version)


@router.get("/models/{version_id}", name="admin_models.get")
def get_version(version: AdminVersion) -> ModelVersionObject:
    return ModelVersionObject.model_validate(version)


@router.get("/models/{version_id}/lineage", name="admin_models.lineage")
def get_lineage(version: AdminVersion, session: SessionDep) -> dict[str, Any]:
    return {"object": "model_version.lineage", "version_id": version.id, "chain": registry.lineage(session, version)}


@router.post("/models/{version_id}/projects", name="admin_models.projects")
def limit_version(version: AdminVersion, body: ProjectsBody, session: SessionDep) -> ModelVersionObject:
    """Set the projects that may use the version (replacing the list); an empty list opens it to every project."""
    version = registry.limit_version(session, version, registry.project_ids(session, body.projects))
    session.commit()
    return ModelVersionObject.model_validate(version)


@router.post("/models/{version_id}/archive", name="admin_models.archive")
def archive_version(version: AdminVersion, session: SessionDep) -> ModelVersionObject:
    version = registry.archive_version(session, version)
    session.commit()
    return ModelVersionObject.model_validate(version)


class AliasMoves:
    """Makes a checked alias move for the calling admin, or (four-eyes rule on) files it for a second admin's
    approval: 202, audited with the request's id."""

    def __init__(
        self, request: Request, response: Response, session: SessionDep, settings: SettingsDep, principal: AdminDep
    ) -> None:
        self.request = request
        self.response = response
        self.session = session
        self.four_eyes = settings.four_eyes
        self.actor = principal.key_id

    def make(
        self, move: registry.PlannedMove, *, reason: str, force: bool, target: str
    ) -> AliasMoveObject | ApprovalObject:
        """Commits; `target` is what the audit log names for a move made now."""
        outcome = approvals.move_or_request(
            self.session, move, reason=reason, force=force, actor=self.actor, four_eyes=self.four_eyes
        )
        self.session.commit()
        if isinstance(outcome, AliasApproval):
            self.response.status_code = 202
            set_audit_target(self.request, outcome.id)
            return ApprovalObject.of(outcome)
        set_audit_target(self.request, target)
        return AliasMoveObject.model_validate(outcome)


AliasMovesDep = Annotated[AliasMoves, Depends()]


# With the four-eyes rule on, a promotion or rollback is filed for approval instead of made.
FILED_FOR_APPROVAL: dict[int | str, dict[str, Any]] = {
    202: {"model": ApprovalObject, "description": "Filed for a second admin's approval."}
}


@router.post("/models/{version_id}/promote", name="admin_models.promote", responses=FILED_FOR_APPROVAL)
def promote_version(
    version: AdminVersion, body: PromoteBody, session: SessionDep, settings: SettingsDep, moves: AliasMovesDep
) -> AliasMoveObject | ApprovalObject:
    registry.require_reason(body.reason)
    move = registry.plan_promotion(session, version, alias=body.alias, gate=settings.evaluation_gate, force=body.force)
    return moves.make(move, reason=body.reason, force=body.force, target=version.id)


@router.get("/model_aliases", name="admin_models.aliases")
def list_aliases(session: SessionDep, _: AdminDep, model_name: str | None = None) -> ListResponse[AliasObject]:
    return ListResponse[AliasObject](data=registry.list_aliases(session, model_name=model_name))


@router.get("/model_aliases/history", name="admin_models.alias_history")
def alias_history(
    session: SessionDep, _: AdminDep, model_name: str | None = None, alias: str | None = None
) -> ListResponse[AliasMoveObject]:
    return ListResponse[AliasMoveObject](data=registry.alias_history(session, model_name=model_name, alias=alias))


@router.post("/model_aliases/rollback", name="admin_models.rollback", responses=FILED_FOR_APPROVAL)
def rollback_alias(body: RollbackBody, session: SessionDep, moves: AliasMovesDep) -> AliasMoveObject | ApprovalObject:
    registry.require_reason(body.reason)
    move = registry.plan_rollback(session, model_name=body.model_name, alias=body.alias)
    return moves.make(move, reason=body.reason, force=False, target=move.label)


@router.get("/model_aliases/approvals", name="admin_models.approvals")
def list_approvals(
    session: SessionDep, _: AdminDep, status: ApprovalStatus | None = None, model_name: str | None = None
) -> ListResponse[ApprovalObject]:
    rows = approvals.list_approvals(session, status=status, model_name=model_name)
    data = [ApprovalObject.of(row, approvals.history_entry(session, row)) for row in rows]
    return ListResponse[ApprovalObject](data=data)


@router.get("/model_aliases/approvals/{approval_id}", name="admin_models.approval")
def get_approval(approval: AdminApproval, session: SessionDep) -> ApprovalObject:
    return ApprovalObject.of(approval, approvals.history_entry(session, approval))


@router.post("/model_aliases/approvals/{approval_id}/approve", name="admin_models.approve")
def approve(
    approval: AdminApproval,
    session: SessionDep,
    settings: SettingsDep,
    principal: AdminDep,
    body: DecisionBody | None = None,
) -> ApprovalObject:
    entry = approvals.approve(
        session,
        approval,
        approver=principal.key_id,
        reason=body.reason if body else None,
        gate=settings.evaluation_gate,
    )
    session.commit()
    return ApprovalObject.of(approval, entry)


@router.post("/model_aliases/approvals/{approval_id}/reject", name="admin_models.reject")
def reject(
    approval: AdminApproval, session: SessionDep, principal: AdminDep, body: DecisionBody | None = None
) -> ApprovalObject:
    approval = approvals.reject(
        session,
        approval,
        decider=principal.key_id,
        reason=body.reason if body else None,
    )
    session.commit()
    return ApprovalObject.of(approval)
