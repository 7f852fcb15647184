"""The `zaya` entry point: a thin dispatcher.

Each command group lives in the package that owns the work; this module only wires argparse subcommands to
`register(subparsers)` functions, imported lazily by name so `zaya --help` stays fast and this package imports
nothing of the packages it dispatches to.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pydantic import ValidationError

from command_line import CommandError
from command_line.environment import apply_environment

# Modules exposing `register(subparsers)`, which adds their subcommands and sets `func` on each.
COMMAND_MODULES: list[str] = [
    "server.commands.manage",
    "finetune.cli",
    "zaya_model.pretrain.cli",
    "server.commands.run",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zaya", description="ZAYA1 fine-tuning and inference platform")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    apply_environment(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CommandError as error:
        print(f"zaya {args.command}: error: {error}", file=sys.stderr)
        return 1
    except ValidationError as error:  # settings read from the environment, for one
        problems = "; ".join(f"{'.'.join(map(str, item['loc']))}: {item['msg']}" for item in error.errors())
        print(f"zaya {args.command}: error: invalid {error.title}: {problems}", file=sys.stderr)
        return 1
