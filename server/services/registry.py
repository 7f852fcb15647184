"""The model registry: model versions (full checkpoints or LoRA adapters), aliases that point at them, and the
immutable history of every alias move.

A fine-tuned model's version is named after its `fine_tuned_model` string. Turning a request's `model` string into a
version is `server.services.model_resolution`'s job.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.db.base import utcnow
from server.db.models import (
    AliasApproval,
    AliasHistory,
    File,
    FineTuningJob,
    ModelAlias,
    ModelVersion,
    ModelVersionProject,
    new_id,
)
from server.engines import serving_problems
from server.errors import Conflict, InvalidRequest, NotFound
from server.services.access import Scope, get_or_404
from server.services.adapters import prepare_adapter
from server.services.model_resolution import find_version
from server.services.projects import require_project
from server.settings import Settings
from zaya_model.legacy_layout import is_legacy_config

DEFAULT_ALIAS = "production"
VERSION_ID_PREFIX = "mv-"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$")
ALIAS_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
KINDS = ("full", "adapter")
# Where a version's held-out loss is read from, first found wins: the fine-tuning trainer's metrics.
HELD_OUT_LOSS_METRICS = ("best_valid_loss", "valid_loss")
# What `finetune` writes beside a checkpoint or adapter (finetune.artifacts' METRICS_FILE and EVALUATION_FILE; not
# imported: torch).
METRICS_FILE = "metrics.json"
EVALUATION_FILE = "evaluation.json"


# --- reading checkpoint directories -------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise InvalidRequest(f"{path} cannot be read as JSON: {error}", param="path") from error
    if not isinstance(content, dict):
        raise InvalidRequest(f"{path} is not a JSON object.", param="path")
    return content


def detect_kind(directory: Path) -> str:
    """'adapter' for a PEFT adapter dir, 'full' for a checkpoint dir; refuses anything else with the reason."""
    if not directory.is_dir():
        raise InvalidRequest(f"{directory} is not a directory.", param="path")
    if (directory / "adapter_config.json").is_file():
        adapter = _read_json(directory / "adapter_config.json")
        if not adapter.get("peft_type"):
            raise InvalidRequest(f"{directory}/adapter_config.json has no 'peft_type'.", param="path")
        return "adapter"
    if (directory / "config.json").is_file():
        config = _read_json(directory / "config.json")
        if not config.get("model_type"):
            raise InvalidRequest(f"{directory}/config.json has no 'model_type'.", param="path")
        if is_legacy_config(config):
            raise InvalidRequest(
                f"{directory} is in ZAYA1-base's original layout: convert it first with "
                f"`python -m zaya_model.legacy_layout {directory} OUTPUT_DIR` and register OUTPUT_DIR.",
                param="path",
                code="legacy_layout",
            )
        return "full"
    raise InvalidRequest(
        f"{directory} holds neither config.json (a checkpoint) nor adapter_config.json (a LoRA adapter).", param="path"
    )


def check_servable(settings: Settings, directory: Path) -> None:
    """Refuse (400 naming `path`) a full checkpoint that the server's engine cannot run."""
    problems = serving_problems(settings, directory)
    if problems:
        raise InvalidRequest(
            f"The {settings.engine} engine cannot serve {directory}: {'; '.join(problems)}.",
            param="path",
            code="model_not_servable",
        )


# --- versions -----------------------------------------------------------------------------------------------------


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name) or "@" in name:
        raise InvalidRequest(
            f"Invalid model name {name!r}: use letters, digits, '.', '_', '-' or ':' (at most 200).", param="name"
        )
    return name


def get_version(session: Session, version_id: str | None) -> ModelVersion:
    return get_or_404(
        session, ModelVersion, version_id, what="model version", param="version_id", code="model_version_not_found"
    )


def list_versions(
    session: Session, scope: Scope, *, name: str | None = None, include_archived: bool = True
) -> list[ModelVersion]:
    """The versions the scope may use."""
    query = select(ModelVersion).where(scope.version_usable()).order_by(ModelVersion.name, ModelVersion.version)
    if name is not None:
        query = query.where(ModelVersion.name == name)
    if not include_archived:
        query = query.where(ModelVersion.status == "active")
    return list(session.scalars(query))


def register_version(
    session: Session,
    *,
    name: str,
    path: Path,
    base_version_id: str | None = None,
    job_id: str | None = None,
    metrics: dict[str, Any] | None = None,
    lineage: dict[str, Any] | None = None,
    description: str | None = None,
    created_by: str | None = None,
    projects: list[str] | None = None,
    serving: Settings | None = None,
) -> ModelVersion:
    """Add version N+1 of `name` for a checkpoint or adapter dir (checked here), usable by the `projects` (ids)
    given, or by every project. Flushes; the caller commits.

    With `serving` (the server's settings), a full checkpoint the configured engine cannot run is refused, naming
    what it cannot run (an adapter runs on its base, or as that base's shape once merged).

    Without `metrics`, the trainer's `metrics.json` in the directory (if any) is recorded, so a fine-tuned output
    registered by hand keeps its held-out loss for the evaluation gate; its task evaluation (`evaluation.json`)
    is recorded likewise.
    """
    check_name(name)
    path = path.resolve()
    kind = detect_kind(path)
    if metrics is None:
        metrics = _trainer_metrics(path)
    evaluation = _read_json(path / EVALUATION_FILE) if (path / EVALUATION_FILE).is_file() else None
    base = get_version(session, base_version_id) if base_version_id else None
    _check_loadable(path, kind, base, serving)
    latest = session.scalar(select(func.max(ModelVersion.version)).where(ModelVersion.name == name)) or 0
    version = ModelVersion(
        id=new_id(VERSION_ID_PREFIX),
        name=name,
        version=latest + 1,
        kind=kind,
        path=str(path),
        base_version_id=base.id if base else None,
        job_id=job_id,
        metrics=metrics,
        evaluation=evaluation,
        lineage=lineage,
        description=description,
        created_by=created_by,
        allowed_projects=[ModelVersionProject(project_id=project_id) for project_id in sorted(set(projects or ()))],
    )
    session.add(version)
    session.flush()
    return version


def _trainer_metrics(path: Path) -> dict[str, Any] | None:
    """The trainer's `metrics.json` in the directory, if any."""
    if not (path / METRICS_FILE).is_file():
        return None
    # NaN and infinities are not JSON (PostgreSQL refuses them): stored as null.
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in _read_json(path / METRICS_FILE).items()
    }


def _check_loadable(path: Path, kind: str, base: ModelVersion | None, serving: Settings | None) -> None:
    """An adapter must load on its base, a full model; with `serving`, a full checkpoint must run on the configured
    engine."""
    if kind == "adapter":
        if base is None:
            message = "An adapter needs the model version it was trained on ('base_model')."
            raise InvalidRequest(message, param="base_model")
        if base.kind != "full":
            raise InvalidRequest(f"The base of an adapter must be a full model; {base.id} is an adapter.", param="base")
        prepare_adapter(path, Path(base.path))  # a bad adapter fails here; expert adapters are merged here
    elif serving is not None:
        check_servable(serving, path)


def register_named_version(
    session: Session,
    *,
    name: str,
    path: Path,
    base_model: str | None,
    description: str | None,
    created_by: str | None,
    projects: list[str],
    serving: Settings,
) -> ModelVersion:
    """Register a version as an admin asks for one (`POST /v1/admin/models`, `zaya models register`): the base
    named as a request names a model (404 naming `model` if none), the projects by id or name (400 naming
    `projects`), the directory checked against the configured engine. Flushes; the caller commits."""
    base = find_version(session, Scope.everything(), base_model) if base_model else None
    return register_version(
        session,
        name=name,
        path=path,
        base_version_id=base.id if base else None,
        description=description,
        created_by=created_by,
        projects=project_ids(session, projects),
        serving=serving,
    )


def project_ids(session: Session, references: list[str]) -> list[str]:
    """The ids of the projects named by id or name; a 400 naming `projects` for one that does not exist."""
    return [require_project(session, reference, param="projects").id for reference in references]


def limit_version(session: Session, version: ModelVersion, project_ids: list[str]) -> ModelVersion:
    """Make `version` usable by these projects only; an empty list: by every project. Flushes."""
    wanted = set(project_ids)
    kept = [limit for limit in version.allowed_projects if limit.project_id in wanted]
    have = {limit.project_id for limit in kept}
    version.allowed_projects = kept + [ModelVersionProject(project_id=project) for project in sorted(wanted - have)]
    session.flush()
    return version


def archive_version(session: Session, version: ModelVersion) -> ModelVersion:
    holders = session.scalars(select(ModelAlias).where(ModelAlias.version_id == version.id)).all()
    if holders:
        names = ", ".join(f"{alias.model_name}@{alias.alias}" for alias in holders)
        raise Conflict(f"{version.id} is still pointed to by {names}; move those aliases first.", code="version_in_use")
    if version.status == "archived":
        raise Conflict(f"{version.id} is already archived.", code="already_archived")
    version.status = "archived"
    version.archived_at = utcnow()
    session.flush()
    return version


# --- aliases ------------------------------------------------------------------------------------------------------


def check_alias(alias: str) -> str:
    if not ALIAS_PATTERN.match(alias) or alias.startswith(VERSION_ID_PREFIX):
        raise InvalidRequest(
            f"Invalid alias {alias!r}: lower-case letters, digits, '.', '_', '-', not starting with "
            f"'{VERSION_ID_PREFIX}' (at most 64).",
            param="alias",
        )
    return alias


def require_reason(reason: str | None) -> str:
    if reason is None or not reason.strip():
        raise InvalidRequest("A reason is required for every alias move.", param="reason", code="missing_required")
    return reason.strip()


def find_alias(session: Session, model_name: str, alias: str) -> ModelAlias | None:
    return session.scalars(
        select(ModelAlias).where(ModelAlias.model_name == model_name, ModelAlias.alias == alias)
    ).one_or_none()


@dataclass(frozen=True)
class PlannedMove:
    """An alias move that passed every check; `apply_move` makes it, now or once a second admin approves it."""

    model_name: str
    alias: str
    action: str  # "promote" or "rollback"
    from_version_id: str | None  # the holder when planned: the move is refused if the alias moved since
    target: ModelVersion
    evaluation: dict[str, Any] | None  # the evaluation gate's inputs (promotions with the gate on)

    @property
    def label(self) -> str:
        return f"{self.model_name}@{self.alias}"


# --- the evaluation gate ------------------------------------------------------------------------------------------


def held_out_loss(version: ModelVersion) -> float | None:
    """The version's loss on its job's validation file: the best evaluation (the trainer keeps the best checkpoint),
    else the last one. None when nothing was recorded (no validation file, or registered without metrics)."""
    for key in HELD_OUT_LOSS_METRICS:
        value = (version.metrics or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


def task_scores(version: ModelVersion | None) -> dict[str, float] | None:
    """A version's task evaluation as comparable scores ("exact_match", "<field> accuracy"); None without one."""
    evaluation = version.evaluation if version is not None else None
    if not evaluation or evaluation.get("exact_match") is None:
        return None
    scores = {"exact_match": float(evaluation["exact_match"])}
    scores.update({f"{name} accuracy": float(field["accuracy"]) for name, field in evaluation["fields"].items()})
    return scores


def _evaluated_file(version: ModelVersion) -> str | None:
    """The SHA-256 of the file the version's task evaluation ran on."""
    file_hash: str | None = (version.evaluation or {}).get("data_sha256")
    return file_hash


def evaluation_gate(candidate: ModelVersion, holder: ModelVersion | None, *, label: str, force: bool) -> dict[str, Any]:
    """Refuse a promotion to `label` (`name@alias`) that would make it worse on held-out data.

    Held-out loss:
    - no current holder, or a holder without a held-out loss: allowed (nothing to compare against);
    - both losses known: refused when the candidate's is higher (equal is allowed); `force` does not override this;
    - the holder has a loss but the candidate has none: refused unless `force` (the reason says why).
    Task evaluation (generated answers, `finetune.evaluate`): when both were scored on the same file, refused when
    the candidate's exact match or any field's accuracy is lower; `force` does not override this either.
    Returns what was compared, for the alias history.
    """
    candidate_loss = held_out_loss(candidate)
    holder_loss = held_out_loss(holder) if holder is not None else None
    candidate_task, holder_task = task_scores(candidate), task_scores(holder)
    same_data = False
    if holder is not None and candidate_task is not None and holder_task is not None:
        same_data = _evaluated_file(candidate) == _evaluated_file(holder) is not None
        worse = [
            f"{name} {candidate_task.get(name, 0.0):.4g} < {value:.4g}"
            for name, value in holder_task.items()
            if candidate_task.get(name, 0.0) < value
        ]
        if same_data and worse:
            raise Conflict(
                f"Evaluation gate: on the same validation file {candidate.id} answers worse than {holder.id}, the "
                f"current {label}: {', '.join(worse)}.",
                param="version_id",
                code="evaluation_gate_failed",
            )
    record = {
        "metric": "held_out_loss",
        "candidate_version_id": candidate.id,
        "candidate_loss": candidate_loss,
        "holder_version_id": holder.id if holder is not None else None,
        "holder_loss": holder_loss,
        "candidate_task": candidate_task,
        "holder_task": holder_task,
        "task_compared": same_data,
        "forced": False,
    }
    if holder is None or holder_loss is None:
        return record
    if candidate_loss is None:
        if not force:
            raise Conflict(
                f"Evaluation gate: {candidate.id} has no recorded held-out (validation) loss, so it cannot be compared "
                f"with {holder.id}, the current {label} (held-out loss {holder_loss:.6g}). Train it with a "
                "validation file, or promote with force=true and a reason.",
                param="force",
                code="evaluation_missing",
            )
        return {**record, "forced": True}
    if candidate_loss > holder_loss:
        raise Conflict(
            f"Evaluation gate: {candidate.id} has held-out loss {candidate_loss:.6g}, worse than {holder_loss:.6g} "
            f"of {holder.id}, the current {label}.",
            param="version_id",
            code="evaluation_gate_failed",
        )
    return record


# --- moves --------------------------------------------------------------------------------------------------------


def plan_promotion(
    session: Session, version: ModelVersion, *, alias: str = DEFAULT_ALIAS, gate: bool = True, force: bool = False
) -> PlannedMove:
    """Check a promotion of `version` to `<its name>@alias` (alias, status, evaluation gate) without making it."""
    check_alias(alias)
    if version.status != "active":
        raise Conflict(f"{version.id} is archived and cannot be promoted.", code="version_archived")
    current = find_alias(session, version.name, alias)
    if current is not None and current.version_id == version.id:
        raise Conflict(f"{version.name}@{alias} already points to {version.id}.", code="alias_unchanged")
    holder = get_version(session, current.version_id) if current is not None else None
    evaluation = evaluation_gate(version, holder, label=f"{version.name}@{alias}", force=force) if gate else None
    return PlannedMove(
        model_name=version.name,
        alias=alias,
        action="promote",
        from_version_id=holder.id if holder is not None else None,
        target=version,
        evaluation=evaluation,
    )


def plan_rollback(session: Session, *, model_name: str, alias: str) -> PlannedMove:
    """Check a move of the alias back to the version it held before its latest move, without making it."""
    current = find_alias(session, model_name, alias)
    if current is None:
        raise NotFound(f"No such alias: {model_name}@{alias}", param="alias")
    last_move = session.scalars(
        select(AliasHistory)
        .where(AliasHistory.model_name == model_name, AliasHistory.alias == alias)
        .order_by(AliasHistory.id.desc())
        .limit(1)
    ).first()
    if last_move is None or last_move.from_version_id is None:
        raise Conflict(f"{model_name}@{alias} has no earlier version to roll back to.", code="nothing_to_roll_back")
    previous = get_version(session, last_move.from_version_id)
    if previous.status != "active":
        raise Conflict(f"The earlier version {previous.id} is archived.", code="version_archived")
    return PlannedMove(
        model_name=model_name,
        alias=alias,
        action="rollback",
        from_version_id=current.version_id,
        target=previous,
        evaluation=None,
    )


def apply_move(
    session: Session,
    move: PlannedMove,
    *,
    reason: str,
    actor: str | None,
    approval: AliasApproval | None = None,
    approved_by: str | None = None,
) -> AliasHistory:
    """Move the alias and append the history entry. Flushes; the caller commits.

    Two moves of one alias racing (two API servers, two admins) cannot both win: each history entry carries the
    alias's move number, read here before its holder, and (model name, alias, number) is unique. Of two moves that
    read the same holder, the second to write collides with the first's entry and is refused."""
    sequence = _next_move_number(session, move)  # before the holder is read
    current = _alias_as_planned(session, move)
    previous_id = current.version_id if current else None
    if current is None:
        current = ModelAlias(model_name=move.model_name, alias=move.alias, version_id=move.target.id)
        session.add(current)
    current.version_id = move.target.id
    current.updated_at = utcnow()
    current.updated_by = actor
    entry = AliasHistory(
        model_name=move.model_name,
        alias=move.alias,
        action=move.action,
        from_version_id=previous_id,
        to_version_id=move.target.id,
        reason=reason,
        actor_key_id=actor,
        approved_by_key_id=approved_by,
        approval_id=approval.id if approval is not None else None,
        requested_at=approval.created_at if approval is not None else None,
        evaluation=move.evaluation,
        sequence=sequence,
    )
    session.add(entry)
    try:
        session.flush()
    except IntegrityError as error:  # the unique move number (or, for a new alias, the alias itself) was taken
        raise Conflict(
            f"{move.label} was moved by a concurrent request while this move was being made; look at it again.",
            code="alias_moved",
        ) from error
    return entry


def _next_move_number(session: Session, move: PlannedMove) -> int:
    """The number of the alias's next history entry."""
    latest = session.scalar(
        select(func.max(AliasHistory.sequence)).where(
            AliasHistory.model_name == move.model_name, AliasHistory.alias == move.alias
        )
    )
    return 1 + (latest or 0)


def _alias_as_planned(session: Session, move: PlannedMove) -> ModelAlias | None:
    """The alias (None if it does not exist yet), refused if it moved since the move was planned or holds its
    target."""
    label = move.label
    current = find_alias(session, move.model_name, move.alias)
    previous_id = current.version_id if current else None
    if previous_id != move.from_version_id:
        raise Conflict(
            f"{label} points to {previous_id or 'nothing'} now, not {move.from_version_id or 'nothing'} as when this "
            "move was requested.",
            code="alias_moved",
        )
    if previous_id == move.target.id:
        raise Conflict(f"{label} already points to {move.target.id}.", code="alias_unchanged")
    return current


def promote(
    session: Session,
    version: ModelVersion,
    *,
    alias: str = DEFAULT_ALIAS,
    reason: str | None,
    actor: str | None,
    gate: bool = True,
    force: bool = False,
) -> AliasHistory:
    """Point `<version's name>@alias` at this version now, recording who and why."""
    reason = require_reason(reason)
    move = plan_promotion(session, version, alias=alias, gate=gate, force=force)
    return apply_move(session, move, reason=reason, actor=actor)


def rollback(session: Session, *, model_name: str, alias: str, reason: str | None, actor: str | None) -> AliasHistory:
    """Point the alias back at the version it held before its latest move, now."""
    reason = require_reason(reason)
    return apply_move(session, plan_rollback(session, model_name=model_name, alias=alias), reason=reason, actor=actor)


def list_aliases(session: Session, *, model_name: str | None = None) -> list[ModelAlias]:
    query = select(ModelAlias).order_by(ModelAlias.model_name, ModelAlias.alias)
    if model_name is not None:
        query = query.where(ModelAlias.model_name == model_name)
    return list(session.scalars(query))


def alias_history(session: Session, *, model_name: str | None = None, alias: str | None = None) -> list[AliasHistory]:
    query = select(AliasHistory).order_by(AliasHistory.id.desc())
    if model_name is not None:
        query = query.where(AliasHistory.model_name == model_name)
    if alias is not None:
        query = query.where(AliasHistory.alias == alias)
    return list(session.scalars(query))


# --- lineage ---------------------------------------------------------------------------------------


def _file_summary(session: Session, file_id: str | None) -> dict[str, Any] | None:
    if file_id is None:
        return None
    file = session.get(File, file_id)
    if file is None:
        return {"id": file_id}
    return {
        "id": file.id,
        "filename": file.filename,
        "bytes": file.bytes,
        "sha256": file.sha256,
        "deleted": file.deleted_at is not None,
    }


def lineage(session: Session, version: ModelVersion) -> list[dict[str, Any]]:
    """The chain from this version down to its root: each with the job and dataset files that made it."""
    chain: list[dict[str, Any]] = []
    seen: set[str] = set()
    current: ModelVersion | None = version
    while current is not None and current.id not in seen:
        seen.add(current.id)
        entry: dict[str, Any] = {
            "version_id": current.id,
            "name": current.name,
            "version": current.version,
            "kind": current.kind,
            "path": current.path,
            "job": None,
        }
        job = session.get(FineTuningJob, current.job_id) if current.job_id else None
        if job is not None:
            entry["job"] = {
                "id": job.id,
                "model": job.model,
                "method": job.method,
                "seed": job.seed,
                "training_file": _file_summary(session, job.training_file_id),
                "validation_file": _file_summary(session, job.validation_file_id),
            }
        chain.append(entry)
        current = session.get(ModelVersion, current.base_version_id) if current.base_version_id else None
    return chain
