"""The console's Jinja2 templates (autoescaped) and the filters they use."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

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


templates.env.filters["when"] = _when
templates.env.filters["number"] = _number
