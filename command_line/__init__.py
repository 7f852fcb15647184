"""Command-line plumbing every package may import: `CommandError` and the flags generated from settings (`flags`).

It imports nothing of the project, so the packages' command modules (`server.commands`, `finetune.cli`,
`zaya_model.pretrain.cli`) use it without importing the packages above them; `zaya_cli` dispatches to them.
"""

from __future__ import annotations


class CommandError(Exception):
    """An error a command reports as one clear line and a non-zero exit."""
