"""The benchmarks as a package: each runs as `python -m benchmarks.<name>` from the repository root, the wheel leaves
them out, and `benchmarks.environment` sets up the process and writes the reports."""

import json
import os
import tomllib

import pytest
from benchmark_helpers import REPO_ROOT, run_benchmark
from setuptools import find_packages

from benchmarks import environment

BENCHMARKS = sorted(
    [path.stem for path in (REPO_ROOT / "benchmarks").glob("*.py") if path.stem not in ("__init__", "environment")]
    + ["load_test"]
)


def test_every_benchmark_is_listed():
    assert set(BENCHMARKS) >= {"model_bench", "serve_bench", "gpu_check", "load_test"}


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARKS)
def test_runs_as_a_module_from_the_repository_root(name):
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = run_benchmark(name, "--help", timeout=300, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--out" in done.stdout


def test_the_wheel_leaves_the_benchmarks_out():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    packages = find_packages(str(REPO_ROOT), **config["packages"]["find"])
    assert "server" in packages and "zaya_model" in packages
    assert not [package for package in packages if package.split(".")[0] == "benchmarks"]


def test_process_defaults_keep_what_is_set(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    environment.set_process_defaults()
    assert os.environ["HF_HUB_OFFLINE"] == "0"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_threads_must_be_positive():
    with pytest.raises(SystemExit, match="--threads must be at least 1"):
        environment.use_threads(0)


def test_report_is_written_with_its_folder(tmp_path):
    path = tmp_path / "results" / "nested" / "bench.json"
    environment.write_report(path, {"mode": "quick", "rows": [1, 2]})
    assert json.loads(path.read_text()) == {"mode": "quick", "rows": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]  # no temporary file left


def test_rows_are_aligned_under_a_rule():
    text = environment.format_rows([("metric", "value"), ("tokens/s", 1234), ("seconds", None)])
    assert text.splitlines() == ["metric    value", "--------  -----", "tokens/s  1234", "seconds   None"]
    piped = environment.format_rows([("a", "bb"), ("ccc", "d")], separator=" | ")
    assert piped.splitlines() == ["a   | bb", "----+---", "ccc | d"]
    assert environment.fmt(None) == "n/a" and environment.fmt(1234.5) == "1,234"
    assert environment.fmt_ratio(1.234) == "1.23x"


def test_search_group_answers_the_first_group_or_fails():
    assert environment.search_group(r'name="csrf" value="([^"]+)"', '<input name="csrf" value="t0k">') == "t0k"
    with pytest.raises(ValueError, match="nothing matches"):
        environment.search_group(r"VmHWM:\s+(\d+) kB", "VmRSS: 12 kB")


def test_proc_status_fields_are_read_in_kib():
    assert environment.proc_status_kib("VmHWM") >= environment.proc_status_kib("VmRSS", os.getpid()) > 0
    with pytest.raises(RuntimeError, match="NoSuchField not in /proc/self/status"):
        environment.proc_status_kib("NoSuchField")


def test_publish_report_prints_the_table_then_writes(tmp_path, capsys):
    path = tmp_path / "bench.json"
    environment.publish_report(path, {"mode": "quick"}, lambda report: print(f"table of {report['mode']}"))
    assert capsys.readouterr().out == f"table of quick\nwrote {path}\n"
    assert json.loads(path.read_text()) == {"mode": "quick"}
