"""Options from the environment: every option of a `zaya` command may also be set as `ZAYA_<COMMAND>_<OPTION>`.

`zaya pretrain --max-steps 20` is `ZAYA_PRETRAIN_MAX_STEPS=20 zaya pretrain`, `zaya data sample --cases 60` is
`ZAYA_DATA_SAMPLE_CASES=60`; a switch takes `true`/`false` (`1`/`0`, `yes`/`no`, `on`/`off`); an option taking
several values takes them separated by spaces. The command line wins over the environment. Containers and job
schedulers configure commands this way, and so do scripts that shrink a documented command (the README's test).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping
from typing import Any

PREFIX = "ZAYA"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
# Options whose argparse action takes no value: the environment says whether they are given.
SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def environment_name(command: tuple[str, ...], action: argparse.Action) -> str:
    """`ZAYA_DATA_SAMPLE_CASES` for `--cases` of `zaya data sample`: the longest option string names it."""
    option = max(action.option_strings, key=len).lstrip("-")
    return "_".join((PREFIX, *command, option)).upper().replace("-", "_")


def command_options(
    parser: argparse.ArgumentParser, command: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.Action]]:
    """Every option of every command under `parser`, with the command's words (`("data", "sample")`).

    argparse keeps a parser's actions and a subcommand's parsers in attributes without a public accessor
    (`_actions`, `_SubParsersAction.choices`); completion and documentation tools read them the same way."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from command_options(subparser, (*command, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction) and command:
            yield command, action


def apply_environment(parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> None:
    """Make each option set in `environ` the option's default, so a flag on the command line still overrides it."""
    for command, action in command_options(parser):
        text = environ.get(environment_name(command, action))
        if text is None:
            continue
        action.default = _switch_value(action, text) if isinstance(action, SWITCHES) else _option_value(action, text)
        action.required = False


def _switch_value(action: argparse.Action, text: str) -> bool:
    word = text.strip().lower()
    if word not in TRUE_WORDS | FALSE_WORDS:
        raise argparse.ArgumentError(action, f"{text!r} in the environment is not true or false")
    given = word in TRUE_WORDS
    # `--no-measure` stores False when given.
    return (not given) if isinstance(action, argparse._StoreFalseAction) else given


def _option_value(action: argparse.Action, text: str) -> str | list[Any]:
    # argparse parses a string default with the option's type, as if it had been given on the command line.
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        convert = action.type if callable(action.type) else str  # no type: the words as given
        return [convert(value) for value in text.split()]
    return text
