"""The `zaya` command line: `zaya_cli.main` dispatches to the command modules of each package.

`CommandError` lives here, importing nothing of the project, so every package's commands can raise it without
importing the packages above them (imports run `zaya_model` <- `finetune` <- `server`).
"""

from __future__ import annotations


class CommandError(Exception):
    """An error a command reports as one clear line and a non-zero exit."""
