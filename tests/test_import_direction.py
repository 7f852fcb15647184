"""Imports run one way: `command_line` <- `zaya_model` <- `finetune` <- `server`, with `zaya_cli`'s dispatcher on top
naming the packages' command modules by string; and no package's modules import each other in a circle. Every
module's imports are read from its syntax tree (those inside functions included), so a lazy import that points the
wrong way or closes a circle fails here too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("command_line", "zaya_model", "finetune", "server", "zaya_cli")

# package -> the packages it must not import
FORBIDDEN = {
    # The leaf: command-line plumbing (`CommandError`, flags generated from settings) every package may import.
    "command_line": {"zaya_model", "finetune", "server", "zaya_cli"},
    "zaya_model": {"finetune", "server", "zaya_cli"},
    "finetune": {"server", "zaya_cli"},
    "server": {"zaya_cli"},
    # The dispatcher names the command modules by string: it imports only the leaf.
    "zaya_cli": {"zaya_model", "finetune", "server"},
}
# The benchmarks measure the packages and are not shipped with them: no package imports them.
FORBIDDEN = {package: forbidden | {"benchmarks"} for package, forbidden in FORBIDDEN.items()}
# Engines share helpers through `server.engines.base` and modules of their own, never through each other.
ENGINE_MODULES = {"server.engines.local", "server.engines.vllm"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, *, is_package: bool = False, at_run_time: bool = False) -> set[str]:
    """Absolute names of every module `source` imports; relative imports resolved against `module`.

    `at_run_time`: leave out the imports under `if TYPE_CHECKING:`, which never run."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    type_checking_only = set()
    if at_run_time:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                type_checking_only.update(id(child) for statement in node.body for child in ast.walk(statement))
    names = set()
    for node in ast.walk(tree):
        if id(node) in type_checking_only:
            continue
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


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports at run time. A module's own packages are left out: Python imports
    them before the module in any case, so importing a name from one does not close a circle."""
    paths = {module_name(path): path for path in project_modules()}
    graph = {}
    for module, path in paths.items():
        ancestors = {".".join(module.split(".")[:depth]) for depth in range(1, module.count(".") + 1)}
        source = path.read_text(encoding="utf-8")
        imported = imported_modules(source, module, is_package=path.name == "__init__.py", at_run_time=True)
        graph[module] = {name for name in imported if name in paths} - ancestors - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    order: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in order:
            continue
        work = [(root, iter(sorted(graph[root])))]
        order[root] = lowest[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in order:
                    order[successor] = lowest[successor] = len(order)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                elif successor in on_stack:
                    lowest[module] = min(lowest[module], order[successor])
                continue
            work.pop()
            if work:
                lowest[work[-1][0]] = min(lowest[work[-1][0]], lowest[module])
            if lowest[module] == order[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_relative_imports_are_resolved() -> None:
    source = "from ..training import checkpointer\nfrom . import corpus\nimport server.app\n"
    names = imported_modules(source, "zaya_model.pretrain.cli")
    assert {"zaya_model.training.checkpointer", "zaya_model.pretrain.corpus", "server.app"} <= names


def test_type_checking_imports_do_not_run() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .modeling import Model\nimport json\n"
    assert "zaya_model.modeling" not in imported_modules(source, "zaya_model", is_package=True, at_run_time=True)
    assert "zaya_model.modeling" in imported_modules(source, "zaya_model", is_package=True)


def test_every_package_is_walked() -> None:
    walked = {module_name(path).split(".")[0] for path in project_modules()}
    assert walked == set(PACKAGES)


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("path", project_modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_imports_run_one_way(path: Path) -> None:
    module = module_name(path)
    imported = imported_modules(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py")
    forbidden = FORBIDDEN[module.split(".")[0]]
    wrong_way = sorted(name for name in imported if name.split(".")[0] in forbidden)
    assert not wrong_way, f"{module} imports {wrong_way}"
    if module in ENGINE_MODULES:
        other_engines = sorted(name for name in imported if name in ENGINE_MODULES - {module})
        assert not other_engines, f"{module} imports another engine: {other_engines}"


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles(import_graph()) == []


# The training infrastructure every package shares sits just above the model: it never imports its users.
TRAINING_USERS = ("zaya_model.pretrain", "zaya_model.vllm_plugin", "zaya_model.cpu", "finetune", "server", "benchmarks")
# Modules the server and the job worker use without loading torch: the standard library only.
STANDARD_LIBRARY_ONLY = ("zaya_model.training.atomic_io", "zaya_model.training.checkpoint_dirs")


@pytest.mark.parametrize("path", sorted((ROOT / "zaya_model" / "training").glob("*.py")), ids=lambda path: path.name)
def test_training_infrastructure_imports_none_of_its_users(path: Path) -> None:
    module = module_name(path)
    imported = imported_modules(path.read_text(encoding="utf-8"), module, is_package=path.name == "__init__.py")
    users = sorted(name for name in imported if name.startswith(TRAINING_USERS))
    assert not users, f"{module} imports {users}"
    if module in STANDARD_LIBRARY_ONLY:
        outside = sorted(
            name for name in imported if name.split(".")[0] not in sys.stdlib_module_names | {"__future__"}
        )
        assert not outside, f"{module} must need the standard library only; it imports {outside}"
