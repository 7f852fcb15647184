"""The loss curve of a pretraining run as a PNG, drawn from its `metrics.jsonl` (training and validation loss).

Uses matplotlib's object API with the Agg canvas (no pyplot global state, no display), so it is safe on the
checkpoint writer thread. The PNG is written to a temporary name and renamed, so a reader never sees half of it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..training.atomic_io import atomic_file


def read_losses(metrics_path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """(training, validation) loss by step; a step redone after a resume or rollback keeps its last value."""
    train, validation = {}, {}
    lines = metrics_path.read_text().splitlines() if metrics_path.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line the training thread is appending right now
            continue
        if "loss" in record and "event" not in record:  # a step's metrics (a rollback event has a loss too)
            train[record["step"]] = record["loss"]
        elif record.get("event") == "eval" and record.get("val_loss") is not None:
            validation[record["step"]] = record["val_loss"]
    return train, validation


def write_loss_plot(metrics_path: Path, png_path: Path) -> None:
    """Draw the curves into `png_path` (atomically); does nothing before the first trained step."""
    train, validation = read_losses(metrics_path)
    if not train:  # the step-0 checkpoint: nothing trained yet
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # imported on first use: slow to import
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(sorted(train), [train[s] for s in sorted(train)], label="training loss", linewidth=1)
    if validation:
        axes.plot(sorted(validation), [validation[s] for s in sorted(validation)], "o-", label="validation loss")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss (nats per token)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    with atomic_file(png_path) as temporary:
        figure.savefig(temporary, format="png")
