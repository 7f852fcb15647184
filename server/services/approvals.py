"""The four-eyes rule for alias moves: with it on, a promotion or rollback becomes a pending request that a second
admin key approves (the move is made then, and `alias_history` records requester, approver, both times and the
reason) or rejects. The requesting key can reject (withdraw) its own request but never approve it.

A second key is a second person only if no one holds both: whoever creates a key sees its secret, so a key, the key
that created it, the one that created that one and so on (its `created_by` chain) may all be one person's. An
approval counts only when the approver's chain and the requester's share no key: not a key the requester made
(directly or through keys it made), not the requester's own maker, not a sibling made by the same key. Admin keys
meant to approve each other are made independently (`zaya keys create --role admin`).
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from server.db.base import utcnow
from server.db.models import AliasApproval, AliasHistory, ApiKey, ApprovalStatus, new_id
from server.db.session import matched_rows
from server.errors import Conflict, Forbidden
from server.services import registry
from server.services.access import get_or_404


def move_or_request(
    session: Session,
    move: registry.PlannedMove,
    *,
    reason: str | None,
    force: bool,
    actor: str | None,
    four_eyes: bool,
) -> AliasHistory | AliasApproval:
    """Make a checked move at once, or (four-eyes) file it for approval. Flushes; the caller commits."""
    reason = registry.require_reason(reason)
    if not four_eyes:
        return registry.apply_move(session, move, reason=reason, actor=actor)
    pending = session.scalars(
        select(AliasApproval.id).where(
            AliasApproval.model_name == move.model_name,
            AliasApproval.alias == move.alias,
            AliasApproval.status == ApprovalStatus.pending,
        )
    ).first()
    if pending is not None:
        raise Conflict(
            f"{move.label} already has a pending move ({pending}); approve or reject it first.",
            code="approval_pending",
        )
    approval = AliasApproval(
        id=new_id("aliasreq-"),
        model_name=move.model_name,
        alias=move.alias,
        action=move.action,
        from_version_id=move.from_version_id,
        to_version_id=move.target.id,
        reason=reason,
        force=force,
        status=ApprovalStatus.pending,
        requested_by=actor,
    )
    session.add(approval)
    session.flush()
    return approval


def get_approval(session: Session, approval_id: str) -> AliasApproval:
    return get_or_404(
        session, AliasApproval, approval_id, what="approval request", param="approval_id", code="approval_not_found"
    )


def list_approvals(
    session: Session, *, status: str | None = None, model_name: str | None = None
) -> list[AliasApproval]:
    """Newest first."""
    query = select(AliasApproval).order_by(AliasApproval.created_at.desc(), AliasApproval.id.desc())
    if status is not None:
        query = query.where(AliasApproval.status == status)
    if model_name is not None:
        query = query.where(AliasApproval.model_name == model_name)
    return list(session.scalars(query))


def history_entry(session: Session, approval: AliasApproval) -> AliasHistory | None:
    return session.scalars(select(AliasHistory).where(AliasHistory.approval_id == approval.id)).first()


def _decide(
    session: Session, approval: AliasApproval, status: ApprovalStatus, decider: str | None, reason: str | None
) -> None:
    """Close a pending request: an UPDATE guarded by `status = 'pending'`, so of two admins deciding at once exactly
    one succeeds (PostgreSQL's row lock makes the second wait, then match nothing)."""
    decided = session.execute(
        update(AliasApproval)
        .where(AliasApproval.id == approval.id, AliasApproval.status == ApprovalStatus.pending)
        .values(
            status=status,
            decided_by=decider,
            decided_at=utcnow(),
            decision_reason=reason.strip() if reason and reason.strip() else None,
        )
    )
    if matched_rows(decided) != 1:
        session.rollback()
        session.refresh(approval)
        raise Conflict(f"Approval request {approval.id} is already {approval.status}.", code="approval_decided")


def creation_chain(session: Session, key_id: str | None) -> list[str]:
    """The key, the key that created it, the one that created that one, ... up to a key made without one."""
    chain: list[str] = []
    while key_id is not None and key_id not in chain:
        chain.append(key_id)
        key_id = session.scalar(select(ApiKey.created_by).where(ApiKey.id == key_id))
    return chain


def check_approver(session: Session, approval: AliasApproval, approver: str | None) -> None:
    """403 `self_approval` unless `approver` is independent of the request's requester (see the module's doc)."""
    if approver is None or approver == approval.requested_by:
        raise Forbidden(
            f"Four-eyes rule: approval request {approval.id} must be approved by a different admin key than the one "
            "that requested it.",
            param="approval_id",
            code="self_approval",
        )
    requester_chain = creation_chain(session, approval.requested_by)
    shared = next((key for key in creation_chain(session, approver) if key in requester_chain), None)
    if shared is None:
        return
    requester = approval.requested_by
    if shared == requester:
        why = f"key {approver} was made by the requester's key {requester} (directly or through keys it made)"
    elif shared == approver:
        why = f"key {approver} made the requester's key {requester} (directly or through keys it made)"
    else:
        why = f"keys {approver} and {requester} were both made from key {shared}, whose holder saw both secrets"
    raise Forbidden(
        f"Four-eyes rule: {why}, so one person may hold both. Approve request {approval.id} with an admin key made "
        "independently of the requester's, e.g. with `zaya keys create --role admin`.",
        param="approval_id",
        code="self_approval",
    )


def approve(
    session: Session, approval: AliasApproval, *, approver: str | None, reason: str | None, gate: bool
) -> AliasHistory:
    """Make the requested move, re-checked now (the alias must not have moved since; the gate still applies).
    Flushes; the caller commits (and rolls back on an error, which also leaves the request pending)."""
    check_approver(session, approval, approver)
    _decide(session, approval, ApprovalStatus.approved, approver, reason)
    current = registry.find_alias(session, approval.model_name, approval.alias)
    if (current.version_id if current else None) != approval.from_version_id:
        raise Conflict(
            f"{approval.model_name}@{approval.alias} has moved since request {approval.id} was made; reject it and "
            "request the move again.",
            code="alias_moved",
        )
    target = registry.get_version(session, approval.to_version_id)
    if approval.action == "promote":
        move = registry.plan_promotion(session, target, alias=approval.alias, gate=gate, force=approval.force)
    elif target.status != "active":
        raise Conflict(f"The earlier version {target.id} is archived.", code="version_archived")
    else:
        move = registry.PlannedMove(
            model_name=approval.model_name,
            alias=approval.alias,
            action=approval.action,
            from_version_id=approval.from_version_id,
            target=target,
            evaluation=None,
        )
    entry = registry.apply_move(
        session, move, reason=approval.reason, actor=approval.requested_by, approval=approval, approved_by=approver
    )
    return entry


def reject(session: Session, approval: AliasApproval, *, decider: str | None, reason: str | None) -> AliasApproval:
    """Close the request without moving anything. Flushes; the caller commits."""
    _decide(session, approval, ApprovalStatus.rejected, decider, reason)
    return approval
