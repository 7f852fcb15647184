"""Imports run one way: `zaya_model` <- `finetune` <- `server`, and `zaya_cli`'s dispatcher names its commands by
string. Every module's imports are read from its syntax tree (those inside functions included), so a lazy import
that points the wrong way fails here too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zaya_model", "finetune", "server", "zaya_cli")

# package -> the packages it must not import
FORBIDDEN = {
    "zaya_model": {"finetune", "server"},
    "finetune": {"server"},
    # Lower packages raise `zaya_cli.CommandError`: the CLI package may not import them back.
    "zaya_cli": {"zaya_model", "finetune", "server"},
}
# Engines share helpers through modules of their own (`server.engines.model_files`), never through each other.
ENGINE_MODULES = {"server.engines.local", "server.engines.vllm"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Absolute names of every module `source` imports; relative imports resolved against `module`."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            names.add(target)
            # `from server import app` may import the module `server.app`.
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def project_modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_relative_imports_are_resolved() -> None:
    source = "from ..training import checkpointing\nfrom . import corpus\nimport server.app\n"
    names = imported_modules(source, "zaya_model.pretrain.cli")
    assert {"zaya_model.training.checkpointing", "zaya_model.pretrain.corpus", "server.app"} <= names


def test_every_package_is_walked() -> None:
    walked = {module_name(path).split(".")[0] for path in project_modules()}
    assert walked == set(PACKAGES)


@pytest.mark.parametrize("path", project_modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_imports_run_one_way(path: Path) -> None:
    module = module_name(path)
    imported = imported_modules(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py")
    forbidden = FORBIDDEN.get(module.split(".")[0], set())
    wrong_way = sorted(name for name in imported if name.split(".")[0] in forbidden)
    assert not wrong_way, f"{module} imports {wrong_way}"
    if module in ENGINE_MODULES:
        other_engines = sorted(name for name in imported if name in ENGINE_MODULES - {module})
        assert not other_engines, f"{module} imports another engine: {other_engines}"
