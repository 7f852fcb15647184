"""Command-line flags generated from a pydantic settings model, so a command and its settings never drift apart.

Every leaf field of the model becomes one flag named after it (`batch_size` -> `--batch-size`); the fields of a
nested model are prefixed with its field name (`lora.r` -> `--lora-r`) unless it is marked `Cli(flatten=True)`.
Help texts come from the fields' descriptions and defaults from the model itself: a flag that is not given is
absent from the parsed values, so the model's default (or the preset's value) applies. Values are parsed and
checked by the model; an error names the flag.

    flags = model_flags(Settings)
    add_flags(parser, flags)
    settings = Settings.model_validate(flag_values(flags, parser.parse_args()))  # FlagError names the flag
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class Cli:
    """Field metadata for the flag generator: `Annotated[type, Cli(...)]`.

    name: the flag's name instead of the field's (without the dashes); flatten: a nested model's fields get no
    prefix; skip: no flag (a field set some other way, such as a preset's model shape)."""

    name: str | None = None
    flatten: bool = False
    skip: bool = False


class FlagError(ValueError):
    """A flag's value is invalid; `flag` is the option string (`--lora-r`)."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class Flag:
    dest: str  # the argparse destination, unique per command
    path: tuple[str, ...]  # where the value goes in the model, e.g. ("lora", "r")
    field: FieldInfo

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def is_bool(self) -> bool:
        return self.field.annotation is bool

    @property
    def is_list(self) -> bool:
        return any(typing.get_origin(member) is list for member in _members(self.field.annotation))

    def parse(self, value: Any) -> Any:
        """The flag's text (or list of texts) as the field's type; FlagError when it is not one."""
        annotation: Any = self.field.annotation
        if self.field.metadata:
            annotation = typing.Annotated[annotation, *self.field.metadata]
        adapter: TypeAdapter[Any] = TypeAdapter(annotation)
        try:
            return adapter.validate_strings(value) if isinstance(value, str) else adapter.validate_python(value)
        except ValidationError as error:
            raise FlagError(self.option, error.errors()[0]["msg"]) from None


def model_flags(model: type[BaseModel], *, path: tuple[str, ...] = (), prefix: str = "") -> list[Flag]:
    """One flag per leaf field of `model`, nested models walked in declaration order."""
    flags = []
    for name, field in model.model_fields.items():
        cli = next((item for item in field.metadata if isinstance(item, Cli)), Cli())
        if cli.skip:
            continue
        nested = _model_type(field.annotation)
        if nested is not None:
            inner_prefix = prefix if cli.flatten else f"{prefix}{cli.name or name}_"
            flags += model_flags(nested, path=(*path, name), prefix=inner_prefix)
        else:
            flags.append(Flag(f"{prefix}{cli.name or name}".replace("-", "_"), (*path, name), field))
    return flags


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: list[Flag], **defaults_shown: str
) -> None:
    """Add `flags` to `parser`; `defaults_shown` overrides the default a help text names (e.g. "the preset's")."""
    for flag in flags:
        default = defaults_shown.get(flag.dest, _default_text(flag.field))
        help_text = (flag.field.description or "").rstrip(".")
        if default is not None:
            help_text = f"{help_text} (default: {default})" if help_text else f"default: {default}"
        options: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": help_text}
        if flag.is_bool:
            parser.add_argument(flag.option, action=argparse.BooleanOptionalAction, **options)
            continue
        choices = _literal_choices(flag.field.annotation)
        if choices is not None and all(isinstance(choice, str) for choice in choices):
            options["choices"] = choices
        else:
            options["metavar"] = _metavar(flag.field.annotation)
        if flag.is_list:
            options["nargs"] = "+"
        parser.add_argument(flag.option, **options)


def flag_values(flags: list[Flag], namespace: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line, parsed, as the nested dict the model validates."""
    values: dict[str, Any] = {}
    for flag in flags:
        if hasattr(namespace, flag.dest):
            set_path(values, flag.path, flag.parse(getattr(namespace, flag.dest)))
    return values


def set_path(values: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        values = values.setdefault(key, {})
    values[path[-1]] = value


def flag_error(flags: list[Flag], error: ValidationError, *, strip: int = 0) -> FlagError:
    """The first problem of a model's ValidationError, named by its flag (`strip`: leading location parts that are
    not in the flags' paths)."""
    problem = error.errors()[0]
    location = tuple(str(part) for part in problem["loc"][strip:])
    for flag in flags:
        if location[: len(flag.path)] == flag.path:
            return FlagError(flag.option, problem["msg"])
    return FlagError(".".join(location) or "settings", problem["msg"])


def _without_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _model_type(annotation: Any) -> type[BaseModel] | None:
    annotation = _without_none(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _members(annotation: Any) -> list[Any]:
    """The leaf types of an annotation: unions flattened, Annotated unwrapped, None dropped."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [leaf for member in typing.get_args(annotation) for leaf in _members(member)]
    return [] if annotation is type(None) else [annotation]


def _literal_choices(annotation: Any) -> list[Any] | None:
    members = _members(annotation)
    if members and all(typing.get_origin(member) is Literal for member in members):
        return [value for member in members for value in typing.get_args(member)]
    return None


def _metavar(annotation: Any) -> str:
    names = []
    for member in _members(annotation):
        if typing.get_origin(member) is Literal:
            names += [str(value) for value in typing.get_args(member)]
        elif typing.get_origin(member) is list:
            names.append("NAME")
        else:
            names.append({int: "N", float: "X"}.get(member, "VALUE"))
    return "|".join(dict.fromkeys(names))


def _default_text(field: FieldInfo) -> str | None:
    if field.default is PydanticUndefined or field.default is None:
        return None
    if field.annotation is bool:
        return "on" if field.default else "off"
    return str(field.default)
