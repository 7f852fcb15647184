"""Hostile dataset inputs against a real `zaya serve`: how long each takes to answer, how slow `/health` gets
meanwhile and how much the server's memory grows (peak RSS).

    python -m benchmarks.hostile_bench [--only NAME ...] [--code DIR]

- `pii_line`: an upload (`ZAYA_UPLOAD_PII_SCAN=report`) whose one example holds a 200 kB line of "a." (the e-mail
  pattern used to retry it from every position), then one of "1/" (the phone matcher's slowest shape).
- `long_line`: a 200 MB single line, sent lazily (it exists whole nowhere).
- `page_views`: a valid 100,000-line dataset viewed three times on the console's dataset page with the model's
  tokenizer, then estimated three times (`POST /v1/fine_tuning/jobs/estimate`).

`--code DIR` runs the server from another checkout (to measure the code before a change the same way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from benchmarks import environment
from benchmarks.load_test import stack as stack_module
from benchmarks.load_test.stack import MODEL_NAME, Stack


def memory_kib(pid: int) -> dict[str, int]:
    return {key: environment.proc_status_kib(key, pid) for key in ("VmRSS", "VmHWM")}


class HealthProbe:
    """GET /health every 100 ms in a thread; the worst latency seen while it runs."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while True:  # at least one probe, however short the attack
                started = time.perf_counter()
                with contextlib.suppress(httpx.TransportError):
                    client.get(f"{self.url}/health")
                self.worst = max(self.worst, time.perf_counter() - started)
                if self._stop.wait(0.1):
                    return

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def measured(stack: Stack, name: str, action: Callable[[], str]) -> dict[str, object]:
    assert stack.server is not None
    before = memory_kib(stack.server.pid)
    with HealthProbe(stack.url) as probe:
        started = time.perf_counter()
        answer = action()
        seconds = time.perf_counter() - started
    after = memory_kib(stack.server.pid)
    row = {
        "attack": name,
        "answer": answer,
        "seconds": round(seconds, 2),
        "health_worst_s": round(probe.worst, 3),
        "peak_rss_growth_mib": round((after["VmHWM"] - before["VmRSS"]) / 1024, 1),
    }
    print(json.dumps(row), flush=True)
    return row


def chat_line(user: str, answer: str) -> bytes:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages}).encode() + b"\n"


def upload(stack: Stack, content: bytes | Iterator[bytes], boundary: str = "bench") -> httpx.Response:
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="bench.jsonl"\r\n\r\n'
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def body() -> Iterator[bytes]:
        yield head
        yield from [content] if isinstance(content, bytes) else content
        yield tail

    headers = {**stack.headers("data"), "Content-Type": f"multipart/form-data; boundary={boundary}"}
    return httpx.post(f"{stack.url}/v1/files", headers=headers, content=body(), timeout=600)


def answer_of(response: httpx.Response) -> str:
    if response.status_code == 200:
        return "200"
    return f"{response.status_code} {response.json()['error'].get('code')}"


def pii_line(stack: Stack) -> list[dict[str, object]]:
    content = chat_line("a." * 100_000, "noted") + chat_line("write to jane.doe@example.com", "ok")
    rows = [measured(stack, "pii_line (200 kB of 'a.')", lambda: answer_of(upload(stack, content)))]
    # The phone-number matcher is linear but tries many candidates per digit block: its slowest shape.
    content = chat_line("1/" * 100_000, "noted") + chat_line("call (212) 555-0147", "ok")
    rows.append(measured(stack, "pii_line (200 kB of '1/')", lambda: answer_of(upload(stack, content))))
    return rows


def long_line(stack: Stack) -> list[dict[str, object]]:
    def lazily() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        chunk = b"a" * 1024**2
        for _ in range(200):
            yield chunk
        yield b'"}, {"role": "assistant", "content": "ok"}]}\n'

    def send() -> str:
        try:
            return answer_of(upload(stack, lazily()))
        except httpx.TransportError as error:  # the server closed the connection after answering
            return f"connection closed ({type(error).__name__})"

    return [measured(stack, "long_line (200 MB, one line)", send)]


def page_views(stack: Stack) -> list[dict[str, object]]:
    content = b"".join(chat_line(f"Balance of account {i}?", f"It is {100 + i} EUR.") for i in range(100_000))
    response = upload(stack, content)
    assert response.status_code == 200, response.text
    file_id = response.json()["id"]
    rows = []
    with httpx.Client(base_url=stack.url, timeout=600) as console:
        login = console.get("/console/login", params={"next": "/console/"})
        csrf = environment.search_group(r'name="csrf" value="([^"]+)"', login.text)
        console.post("/console/session", data={"api_key": stack.keys["data"], "csrf": csrf, "next": "/console/"})
        for view in range(1, 4):

            def show(view: int = view) -> str:
                page = console.get(f"/console/datasets/{file_id}", params={"model": MODEL_NAME, "line": view})
                return str(page.status_code)

            rows.append(measured(stack, f"dataset page view {view} (100k lines)", show))
    body = {"model": MODEL_NAME, "training_file": file_id, "method": {"supervised": {"hyperparameters": {}}}}
    for attempt in range(1, 4):

        def estimate() -> str:
            url = f"{stack.url}/v1/fine_tuning/jobs/estimate"
            return answer_of(httpx.post(url, headers=stack.headers("data"), json=body, timeout=600))

        rows.append(measured(stack, f"jobs/estimate {attempt} (100k lines)", estimate))
    return rows


SCENARIOS = {"pii_line": pii_line, "long_line": long_line, "page_views": page_views}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--code", type=Path, help="run the server from this checkout")
    parser.add_argument("--out", type=Path, default=environment.default_out("hostile_bench"), help="JSON report")
    arguments = parser.parse_args()
    rows: list[dict[str, object]] = []
    if arguments.code is not None:
        stack_module.REPO_ROOT = arguments.code.resolve()
    with (
        tempfile.TemporaryDirectory(prefix="hostile-bench-") as directory,
        Stack(Path(directory), env={"ZAYA_UPLOAD_PII_SCAN": "report"}, torch_threads=None) as stack,
    ):
        stack.prepare().start_server()
        for name in arguments.only:
            rows.extend(SCENARIOS[name](stack))
    environment.write_report(arguments.out, {"machine": environment.machine_summary(), "rows": rows})


if __name__ == "__main__":
    main()
