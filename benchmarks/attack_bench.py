"""Hostile requests against a real `zaya serve` (default settings, the tiny model): how each is answered, how long the
answer takes, the worst `/health` latency while it runs (polled every 50 ms from another thread, a fresh connection
each time) and how much the server's resident memory grew.

Run: `python -m benchmarks.attack_bench [--out benchmarks/results/attack_bench.json]` (about a minute). It prints
the rows of docs/reliability.md's table. `tests/security/test_stall.py` runs the same attacks with assertions.
"""

from __future__ import annotations

import argparse
import json
import math
import select
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks import environment
from benchmarks.load_test.stack import MODEL_NAME, Stack

PROMPT_CHARS = 8_000_000  # just under the default 8 MiB body limit once in JSON
HEADER_BYTES = 100 * 1024**2
TARGET_BYTES = 1024**2
KEYLESS_REQUESTS = 200
KEYLESS_PATH_CHARS = 8 * 1024


@dataclass
class HealthProbe:
    """`/health` polled from a thread of its own (a fresh connection each time) while an attack runs."""

    url: str
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=math.inf)


@contextmanager
def health_probed(url: str, interval_s: float = 0.05) -> Iterator[HealthProbe]:
    probe = HealthProbe(url)
    done = threading.Event()

    def poll() -> None:
        while True:
            started = time.perf_counter()
            try:
                response = httpx.get(f"{url}/health", timeout=30)
                if response.status_code != 200:
                    probe.failures.append(f"/health answered {response.status_code}")
            except httpx.HTTPError as error:
                probe.failures.append(f"/health failed: {error!r}")
            probe.latencies.append(time.perf_counter() - started)
            if done.wait(interval_s):
                return

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    time.sleep(0.2)  # probed before the attack starts, too
    try:
        yield probe
    finally:
        time.sleep(0.1)
        done.set()
        thread.join(timeout=60)


def rss_bytes(pid: int) -> int:
    return environment.proc_status_kib("VmRSS", pid) * 1024


def send_raw(port: int, start: bytes, filler: int, *, chunk: int = 64 * 1024) -> tuple[bytes, int]:
    """Send `start`, then up to `filler` bytes of 'a' until the server answers: its answer, and the filler sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(start)
        sent, piece = 0, b"a" * chunk
        while sent < filler and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(piece)
            except OSError:  # closed by the server after its answer
                break
            sent += len(piece)
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
        except OSError:
            pass
        return answer, sent


def status_and_error(answer: bytes) -> tuple[int, dict]:
    """The status of a raw HTTP answer and its OpenAI error object."""
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def raw_answer_text(answer: bytes) -> str:
    if not answer:
        return "connection closed, no answer"
    try:
        status, error = status_and_error(answer)
    except (ValueError, IndexError, KeyError):
        return answer.split(b"\r\n", 1)[0].decode(errors="replace")
    return f"{status} {error.get('code')}"


@dataclass
class Row:
    attack: str
    answer: str
    seconds: float
    health_worst_s: float
    health_failures: int
    memory_growth_mib: float


def measure(stack: Stack, attack: str, run: Callable[[], str]) -> Row:
    assert stack.server is not None
    before = rss_bytes(stack.server.pid)
    with health_probed(stack.url) as probe:
        started = time.perf_counter()
        answer = run()
        seconds = time.perf_counter() - started
    growth = (rss_bytes(stack.server.pid) - before) / 1024**2
    return Row(attack, answer, seconds, probe.worst, len(probe.failures), growth)


def attacks(stack: Stack) -> list[tuple[str, Callable[[], str]]]:
    text = ("Summarise case 12: 40 cash deposits of 9,900 EUR. " * (PROMPT_CHARS // 50 + 1))[:PROMPT_CHARS]

    def post(route: str, body: dict, role: str) -> str:
        response = httpx.post(f"{stack.url}{route}", json=body, headers=stack.headers(role), timeout=600)
        code = response.json().get("error", {}).get("code") if response.status_code >= 400 else ""
        return f"{response.status_code} {code}".strip()

    def chat() -> str:
        messages = [{"role": "user", "content": text}]
        return post("/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 4}, "analyst")

    def completion() -> str:
        return post("/v1/completions", {"model": MODEL_NAME, "prompt": text, "max_tokens": 4}, "admin")

    def header() -> str:
        start = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: "
        answer, sent = send_raw(stack.port, start, HEADER_BYTES)
        return f"{raw_answer_text(answer)} after {sent / 1024**2:.1f} MiB sent"

    def target() -> str:
        return raw_answer_text(send_raw(stack.port, b"GET /v1/" + b"a" * TARGET_BYTES + b" HTTP/1.1\r\n\r\n", 0)[0])

    def keyless() -> str:
        counts: dict[int, int] = {}
        path = "/v1/files/" + "f" * KEYLESS_PATH_CHARS
        with httpx.Client(base_url=stack.url, timeout=60) as client:
            for _ in range(KEYLESS_REQUESTS):
                status = client.delete(path).status_code
                counts[status] = counts.get(status, 0) + 1
        return ", ".join(f"{count} x {status}" for status, count in sorted(counts.items()))

    return [
        (f"chat prompt of {PROMPT_CHARS / 1e6:.0f} M characters", chat),
        (f"text completion prompt of {PROMPT_CHARS / 1e6:.0f} M characters", completion),
        (f"{HEADER_BYTES // 1024**2} MB header field, no key", header),
        (f"{TARGET_BYTES // 1024**2} MB request target, no key", target),
        (f"{KEYLESS_REQUESTS} keyless DELETEs with {KEYLESS_PATH_CHARS // 1024} kB paths, one client", keyless),
    ]


def audit_paths(stack: Stack) -> tuple[int, int]:
    """Audit rows without a key, and the longest path among them."""
    from sqlalchemy import func, select

    from server.db.models import AuditLog

    with stack.database() as sessions, sessions() as session:
        count, longest = session.execute(
            select(func.count(), func.max(func.length(AuditLog.path))).where(AuditLog.actor_key_id.is_(None))
        ).one()
    return count, longest or 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=environment.default_out("attack_bench"))
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="attack-bench-") as directory,
        Stack(Path(directory), env={"ZAYA_LOCAL_ENGINE_COMPILE": "false"}) as stack,
    ):
        stack.prepare()
        stack.start_server()
        rows = [measure(stack, name, run) for name, run in attacks(stack)]
        audited, longest_path = audit_paths(stack)
    print("| attack | answer | time to answer | /health worst latency during it | memory growth |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        failures = f" ({row.health_failures} failed)" if row.health_failures else ""
        print(
            f"| {row.attack} | {row.answer} | {row.seconds:.3f} s | {row.health_worst_s:.3f} s{failures} "
            f"| {row.memory_growth_mib:+.1f} MiB |"
        )
    print(f"audit rows of keyless requests: {audited}, longest path stored: {longest_path} characters")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": environment.machine_summary(),
        "rows": [asdict(row) for row in rows],
        "keyless_audit_rows": audited,
        "longest_audited_path": longest_path,
    }
    environment.write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
