"""Fine-tuning workers as the API sees them: each says, at least every `REFRESH`, how many devices one job may train
with on its host (processes: one per GPU, or one per CPU core on a host without GPUs). A job asking for more devices
than any worker seen in the last `SEEN_WITHIN` has is refused: at creation (400 naming `devices`) when a worker has
been seen, else when a worker validates it (the job fails naming `devices`). A worker claims only jobs it can run.
"""

from __future__ import annotations

import os
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from server.db.base import utcnow
from server.db.models import RegisteredWorker
from server.db.session import matched_rows
from server.errors import InvalidRequest

REFRESH = timedelta(seconds=30)
SEEN_WITHIN = timedelta(minutes=5)
DEVICE_NAMES = {"gpu": "GPUs", "cpu": "CPU cores"}


def host_devices() -> tuple[int, str]:
    """This host's devices for one job and their kind: its GPUs (CUDA or ROCm), else the CPU cores it may use."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), "gpu"
    return len(os.sched_getaffinity(0)), "cpu"


def announce(session: Session, worker_id: str, *, devices: int, device_kind: str) -> None:
    """Record that the worker is running, with its devices. Commits."""
    values = {"devices": devices, "device_kind": device_kind, "seen_at": utcnow()}
    updated = session.execute(update(RegisteredWorker).where(RegisteredWorker.id == worker_id).values(**values))
    if matched_rows(updated) == 0:
        session.add(RegisteredWorker(id=worker_id, **values))
    session.commit()


def largest_seen(session: Session) -> RegisteredWorker | None:
    """The recently seen worker with the most devices, or None when no worker was seen lately."""
    return session.scalars(
        select(RegisteredWorker)
        .where(RegisteredWorker.seen_at >= utcnow() - SEEN_WITHIN)
        .order_by(RegisteredWorker.devices.desc(), RegisteredWorker.id)
        .limit(1)
    ).first()


def devices_problem(session: Session, devices: int) -> str | None:
    """Why no recently seen worker can train a job on `devices` devices; None when one can, or none was seen."""
    largest = largest_seen(session)
    if largest is None or devices <= largest.devices:
        return None
    return (
        f"devices: {devices} is more than any worker can train one job with; the largest, {largest.id}, has "
        f"{largest.devices} {DEVICE_NAMES.get(largest.device_kind, 'devices')}."
    )


def check_devices(session: Session, devices: int) -> None:
    """400 naming `devices` when no recently seen worker has that many."""
    if (problem := devices_problem(session, devices)) is not None:
        raise InvalidRequest(problem, param="devices", code="devices_unavailable")
