"""The CI skip policy (`skip_policy.py`) on small generated suites, run as pytest processes of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

POLICY_SOURCE = (Path(__file__).parent / "skip_policy.py").read_text()

ALLOW_LIST = """
[[skip]]
test = "test_suite.py::test_needs_a_feature*"
reason = "needs the frobnicate CPU feature"
hardware = "CPU without frobnicate"
"""

SUITE = """
import pytest

def test_passes():
    pass

@pytest.mark.skipif(True, reason="needs the frobnicate CPU feature")
def test_needs_a_feature():
    pass

@pytest.mark.parametrize("size", [1, 2])
def test_needs_a_feature_too(size):
    pytest.skip("needs the frobnicate CPU feature")

def test_needs_a_program():
    pytest.skip("needs chromium")

@pytest.mark.skipif(True, reason="needs chromium")
def test_needs_a_feature_but_skips_for_a_program():
    pass

@pytest.mark.xfail(reason="not built yet")
def test_not_built():
    assert False
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(skip_policy=POLICY_SOURCE)
    pytester.makeconftest('pytest_plugins = ["skip_policy"]')
    (pytester.path / "allowed_skips.toml").write_text(ALLOW_LIST)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


@pytest.fixture(autouse=True)
def only_named_plugins(monkeypatch):
    """The inner runs load no installed plugin but those they name (schemathesis' alone takes seconds to import)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["one process", "xdist"])
def test_under_ci_only_allow_listed_skips_pass_and_they_are_counted(suite, monkeypatch, workers):
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest_subprocess(*workers)
    # A skip in the test's body fails it; one from a `skipif` mark happens in set-up, and fails that (an error).
    result.assert_outcomes(passed=1, skipped=3, failed=2, errors=1)
    result.stdout.fnmatch_lines(["*allow-listed skips: 3 (allowed_skips.toml)*"])
    output = result.stdout.str()
    for refused in ("FAILED test_suite.py::test_needs_a_program", "FAILED test_suite.py::test_not_built"):
        assert refused in output, output
    assert "ERROR test_suite.py::test_needs_a_feature_but_skips_for_a_program" in output
    assert "skipped under CI=true: xfail: not built yet" in output


def test_outside_ci_skips_stay_skips(suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = suite.runpytest_subprocess()
    result.assert_outcomes(passed=1, skipped=5, xfailed=1)
    assert "allow-listed skips" not in result.stdout.str()


def test_under_ci_a_skipped_module_fails_the_run(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    suite.makepyfile(test_module='import pytest\npytest.importorskip("no_such_package")\n\ndef test_x():\n    pass\n')
    result = suite.runpytest_subprocess("test_module.py")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*skipped under CI=true*no_such_package*"])


def test_a_malformed_allow_list_stops_the_run(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    (suite.path / "allowed_skips.toml").write_text('[[skip]]\ntest = "test_suite.py::test_passes"\nreason = "x"\n')
    result = suite.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "each [[skip]] needs exactly ['hardware', 'reason', 'test']" in result.stderr.str()
