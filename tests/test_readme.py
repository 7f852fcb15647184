"""The README runs as written: its shell and Python blocks, in order, in a fresh directory, as a newcomer runs them.

The blocks become one bash script (`set -euo pipefail`); a Python block runs through the project's Python. A block
after `<!-- readme-test: background -->` starts a server: it runs in the background, and the next block starts once
the server's `/health` answers 200 (a later background block stops the earlier one first). A block after
`<!-- readme-test: not run ... -->` is the command that runs this test (`make test`). Sizes shrink through the
environment (every `zaya` option reads `ZAYA_<COMMAND>_<OPTION>`), the servers decode eagerly, and they listen on a
free port in place of the README's 8000. A command that drifts from the code fails here.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_ADDRESS = "127.0.0.1:8000"
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<directive>[^>]*?) -->\n)?```(?P<language>bash|python)\n(?P<code>.*?)```", re.S
)
# Small sizes for the blocks that train; the commands are the README's.
SMALL_SIZES = {
    "ZAYA_DATA_SAMPLE_CASES": "20",
    "ZAYA_DATA_SAMPLE_CORPUS": "200",
    "ZAYA_PRETRAIN_MAX_STEPS": "10",
    "ZAYA_PRETRAIN_BATCH_SIZE": "2",
    "ZAYA_FINETUNE_MAX_STEPS": "20",
}
# The servers decode eagerly: compiling the local engine's decode steps has tests of its own
# (tests/server/test_engine_compiled.py) and would cost each server minutes of CPU here.
EAGER_LOCAL_ENGINE = {"ZAYA_LOCAL_ENGINE_COMPILE": "false"}
HEALTH_WAIT_S = 900
SCRIPT_TIMEOUT_S = 2400
# Each server's process group, so that the test stops it even when the script itself is killed.
SERVER_GROUPS = "servers.pgid"


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    directive: str


def readme_blocks() -> list[Block]:
    return [
        Block(match["language"], match["code"], (match["directive"] or "").strip())
        for match in BLOCK.finditer(README.read_text(encoding="utf-8"))
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script(blocks: list[Block], port: int) -> str:
    address = f"127.0.0.1:{port}"
    lines = [
        "set -euo pipefail",
        f"health=http://{address}/health",
        # A server started by a background block: stopped before the next one, and at the end.
        "server=''",
        'stop_server() { if [ -n "$server" ]; then kill -TERM -- "-$server" 2>/dev/null || true;'
        " while kill -0 \"$server\" 2>/dev/null; do sleep 1; done; server=''; fi; }",
        "trap stop_server EXIT",
        f"wait_for_server() {{ for _ in $(seq {HEALTH_WAIT_S}); do"
        ' curl -sf "$health" >/dev/null && return 0;'
        ' kill -0 "$server" 2>/dev/null || { echo "server exited: $1"; tail -n 40 "$1"; return 1; };'
        ' sleep 1; done; echo "server not ready: $1"; tail -n 40 "$1"; return 1; }',
    ]
    for number, block in enumerate(blocks, start=1):
        code = block.code.replace(README_ADDRESS, address)
        # A block may end mid-line; the script's seconds so far tell a slow block from a slow script.
        lines.append(f'echo; echo "--- README block {number} ({block.language}) at ${{SECONDS}} s"')
        if block.directive.startswith("not run"):
            continue
        if block.language == "python":
            lines += ["./.venv/bin/python - <<'README_PYTHON'", code.rstrip("\n"), "README_PYTHON"]
        elif block.directive == "background":
            log = f"server-{number}.log"
            lines += [
                "stop_server",
                f"setsid bash -c {_quoted(code)} > {log} 2>&1 &",
                "server=$!",
                f"echo $server >> {SERVER_GROUPS}",
                f"wait_for_server {log}",
            ]
        else:
            lines.append(code.rstrip("\n"))
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def test_the_readme_marks_only_make_test_as_not_run():
    not_run = [block.code.strip() for block in readme_blocks() if block.directive.startswith("not run")]
    assert [line.split("#")[0].strip() for line in not_run] == ["make test"]


def stop_process_groups(groups: list[int]) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for group in groups:
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 120)
def test_the_readme_runs_as_written(tmp_path):
    # `make run` installs when the environment is older than pyproject.toml: here that would install this temporary
    # directory, so the environment must be current (`make test` installs it first).
    for stamp in (".venv/.installed", ".venv-vllm/.installed"):
        stale = subprocess.run(["make", "-q", stamp], cwd=ROOT, capture_output=True)
        assert stale.returncode == 0, f"{stamp} is older than pyproject.toml: run `make install install-vllm` first"
    for name in (".venv", ".venv-vllm", "Makefile", "pyproject.toml"):
        (tmp_path / name).symlink_to(ROOT / name)
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ZAYA_", "OPENAI_")) and key not in ("PYTHONPATH",)
    }
    port = free_port()
    environment.update(SMALL_SIZES, **EAGER_LOCAL_ENGINE, ZAYA_PORT=str(port), PYTHONPATH=str(ROOT))
    (tmp_path / "readme.sh").write_text(script(readme_blocks(), port))
    process = subprocess.Popen(
        ["bash", "readme.sh"],
        cwd=tmp_path,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=SCRIPT_TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        servers = tmp_path / SERVER_GROUPS
        stop_process_groups([int(line) for line in servers.read_text().split()] if servers.exists() else [])
    logs = "".join(
        f"\n--- {log.name}\n" + "".join(log.read_text(errors="replace").splitlines(True)[-60:])
        for log in sorted(tmp_path.glob("server-*.log"))
    )
    assert process.returncode == 0, output[-6000:] + logs
    ran = re.findall(r"^--- README block (\d+)", output, re.M)
    assert len(ran) == len(readme_blocks())
