"""Skips under CI: with `CI=true` a skipped test fails the run unless `tests/allowed_skips.toml` allows it.

A skip hides a missing feature as easily as it marks a missing machine, so under CI (`.ci/run` sets `CI=true`) every
skip, xfail and skipped module becomes a failure, except where the allow-list names the test and the reason its skip
gives. The allow-list holds facts about the hardware only (CPU features, core count): a missing package, program,
service or permission is something `make test` installs or starts, never a reason to skip. The run ends with the
number of allow-listed skips it had. Outside CI, skips stay skips (a laptop without chromium).
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from pathlib import Path

import pytest

ALLOW_LIST = Path(__file__).with_name("allowed_skips.toml")
ALLOWED_PROPERTY = "allowed_skip"
ENTRY_KEYS = {"test", "reason", "hardware"}


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def load_allow_list(path: Path) -> list[dict[str, str]]:
    """The `[[skip]]` entries: `test` (a node id, `*` and `[...]` allowed), `reason` (text the skip's message
    contains) and `hardware` (the fact about the machine that makes the test impossible there)."""
    entries = tomllib.loads(path.read_text()).get("skip", [])
    for entry in entries:
        if set(entry) != ENTRY_KEYS or not all(isinstance(value, str) and value for value in entry.values()):
            raise pytest.UsageError(f"{path}: each [[skip]] needs exactly {sorted(ENTRY_KEYS)}, got {entry}")
    return entries


def allowing_entry(nodeid: str, message: str, entries: list[dict[str, str]]) -> dict[str, str] | None:
    for entry in entries:
        # fnmatch reads `[...]` as a character class; a parametrized id is matched literally first.
        if (nodeid == entry["test"] or fnmatch.fnmatchcase(nodeid, entry["test"])) and entry["reason"] in message:
            return entry
    return None


def skip_message(report: pytest.TestReport | pytest.CollectReport) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # (path, line, "Skipped: <reason>")
        return str(longrepr[2])
    return str(longrepr)


def refusal(message: str) -> str:
    return (
        f"skipped under CI=true: {message}\n"
        f"Only a fact about the hardware may skip a test in CI: list it, with that reason, in {ALLOW_LIST}; "
        "anything else must be installed or started by `make test`."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not under_ci():
        return
    message = skip_message(report)
    entry = None if hasattr(report, "wasxfail") else allowing_entry(report.nodeid, message, allow_list(item.config))
    if entry is not None:
        report.user_properties.append((ALLOWED_PROPERTY, entry["hardware"]))
        return
    report.outcome = "failed"
    report.longrepr = refusal(message)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A whole module skipped (`allow_module_level`, `importorskip`) is never allowed: mark its tests instead."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and under_ci():
        report.outcome = "failed"
        report.longrepr = refusal(skip_message(report))


def allow_list(config: pytest.Config) -> list[dict[str, str]]:
    if not hasattr(config, "_zaya_allowed_skips"):
        config._zaya_allowed_skips = load_allow_list(ALLOW_LIST)
    return config._zaya_allowed_skips


def pytest_configure(config: pytest.Config) -> None:
    if under_ci():
        allow_list(config)  # a malformed allow-list stops the run before any test


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if not under_ci():
        return
    allowed = [
        (report.nodeid, dict(report.user_properties)[ALLOWED_PROPERTY])
        for report in terminalreporter.stats.get("skipped", [])
        if ALLOWED_PROPERTY in dict(report.user_properties)
    ]
    terminalreporter.write_sep("-", f"allow-listed skips: {len(allowed)} ({ALLOW_LIST.name})")
    for nodeid, hardware in sorted(allowed):
        terminalreporter.write_line(f"{nodeid}: {hardware}")
