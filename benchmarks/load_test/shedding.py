"""Which refusals are load shedding (what the server should answer to more work than it takes), phase by phase.

429 with `Retry-After` and an OpenAI error body is shedding in any phase (the engine's full queue, a key's limit).
503 with both is shedding only in the overload phase, where the load is meant to exceed what the server queues; in
any other phase a 503 (`database_unavailable`, an engine that is not ready) means something failed: an error.
"""

from __future__ import annotations

OVERLOAD_PHASE = "overload"


def shed_statuses(phase: str) -> tuple[int, ...]:
    return (429, 503) if phase == OVERLOAD_PHASE else (429,)


def refusal_problem(status: int, retry_after: str | None, has_error_body: bool, phase: str) -> str | None:
    """None when a non-2xx answer is load shedding in `phase`; otherwise what makes it an error."""
    if status not in shed_statuses(phase):
        return f"HTTP {status}" + (f" outside the {OVERLOAD_PHASE} phase" if status == 503 else "")
    if not retry_after or not has_error_body:
        return f"{status} without Retry-After or OpenAI error body"
    return None
