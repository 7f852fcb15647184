"""The console's Jinja2 templates (autoescaped) and the filters they use."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.templating import Jinja2Templates

TEMPLATES_DIR = Path(__file__).parent / "templates"
STATIC_DIR = Path(__file__).parent / "static"

templates = Jinja2Templates(directory=TEMPLATES_DIR)


def _when(moment: datetime | None) -> str:
    if moment is None:
        return "—"
    if moment.tzinfo is None:  # SQLite hands back naive UTC times
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _number(value: object, digits: int = 4) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else ("—" if value is None else str(value))


def _task_evaluation(evaluation: dict[str, Any] | None) -> str:
    """A stored task evaluation in one line: "exact match 0.800 (30 examples); Disposition 0.967, Reasons 0.800"."""
    if not evaluation or evaluation.get("exact_match") is None:
        return "—"
    line = f"exact match {evaluation['exact_match']:.3f} ({evaluation['n_examples']} examples)"
    fields = ", ".join(f"{name} {field['accuracy']:.3f}" for name, field in evaluation.get("fields", {}).items())
    return f"{line}; {fields}" if fields else line


templates.env.filters["when"] = _when
templates.env.filters["task_evaluation"] = _task_evaluation
templates.env.filters["number"] = _number
