"""The `zaya` command line: a thin dispatcher.

Each command group lives in the package that owns the work; this module only wires argparse subcommands to
`register(subparsers)` functions, imported lazily so `zaya --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules exposing `register(subparsers)`, which adds their subcommands and sets `func` on each.
COMMAND_MODULES: list[str] = ["server.commands", "finetune.cli", "zaya_model.pretrain.cli", "server.run"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zaya", description="ZAYA1 fine-tuning and inference platform")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


class CommandError(Exception):
    """An error a command reports as one clear line and a non-zero exit."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CommandError as error:
        print(f"zaya {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # Run the imported module's `main`, so `CommandError` raised by commands is the class we catch (under `-m` this
    # file is `__main__`, a second copy of the module).
    from server.cli import main as package_main

    sys.exit(package_main())
