"""Locust users for `python -m benchmarks.load_test` (run by it in a subprocess; not meant to be imported).

Analysts stream chat, data users upload files and create and poll fine-tuning jobs, an admin promotes model
versions; `FloodUser` only streams long chats with no pause, to overload the engine. Every request is recorded by
the listener at the bottom (status, latency, time to first token, whether a refusal carried `Retry-After`), and the
samples are written as JSON to `$ZAYA_LOAD_SAMPLES` when locust quits. Load shedding, which is what the server should
do, counts as shed, not as an error: a 429 with `Retry-After` and an OpenAI error body, and a 503 with both only in the
overload phase (`$ZAYA_LOAD_PHASE`; see `shedding.py`).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections import defaultdict

from locust import HttpUser, between, constant, events, task
from locust.clients import HttpSession

from benchmarks.load_test.shedding import refusal_problem, shed_statuses

KEYS: dict[str, str] = json.loads(os.environ.get("ZAYA_LOAD_KEYS", "{}"))
MODEL = os.environ.get("ZAYA_LOAD_MODEL", "zaya-tiny")
MODEL_DIR = os.environ.get("ZAYA_LOAD_MODEL_DIR", "")
MAX_TOKENS = int(os.environ.get("ZAYA_LOAD_MAX_TOKENS", "16"))
FLOOD_MAX_TOKENS = int(os.environ.get("ZAYA_LOAD_FLOOD_MAX_TOKENS", "64"))
PHASE = os.environ.get("ZAYA_LOAD_PHASE", "")
SHED_STATUSES = shed_statuses(PHASE)

DATASET = b"".join(
    b'{"messages": [{"role": "user", "content": "Summarise case %d."}, '
    b'{"role": "assistant", "content": "Case %d: no suspicious activity found."}]}\n' % (i, i)
    for i in range(8)
)
PROMPTS = [
    "Summarise case 17 for the compliance review.",
    "Recommend a disposition for the wire transfer alert on account 4411.",
    "List the red flags in a structuring pattern.",
]


def _auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


def _judge(response) -> None:
    """Success, load shedding, or a failure with the reason."""
    status = response.status_code
    if 200 <= status < 300:
        response.success()
        return
    try:
        has_error_body = "error" in response.json()
    except ValueError:
        has_error_body = False
    problem = refusal_problem(status, response.headers.get("Retry-After"), has_error_body, PHASE)
    if problem is None:
        response.success()
    else:
        response.failure(problem)


class ChatMixin:
    client: HttpSession  # set by the `HttpUser` this is mixed into

    def stream_chat(self, name: str, max_tokens: int) -> float:
        """One streamed chat; returns the `Retry-After` seconds of a refusal (0 otherwise)."""
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0.8,
        }
        started = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions", json=body, headers=_auth("analyst"), stream=True, catch_response=True, name=name
        ) as response:
            if response.status_code != 200:
                _judge(response)
                try:
                    return float(response.headers.get("Retry-After") or 0)
                except ValueError:
                    return 0.0
            first_token_ms, done, failed = None, False, None
            try:
                for line in response.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    if first_token_ms is None:
                        first_token_ms = (time.perf_counter() - started) * 1000
                    payload = line[len(b"data: ") :]
                    if payload == b"[DONE]":
                        done = True
                    elif b'"error"' in payload and json.loads(payload).get("error"):
                        failed = "error event in the stream"
            except Exception as error:  # a connection cut mid-stream
                failed = f"stream broken: {type(error).__name__}"
            response.request_meta["response_time"] = (time.perf_counter() - started) * 1000
            response.request_meta["context"] = {"ttft_ms": first_token_ms}
            if failed or not done:
                response.failure(failed or "stream ended without [DONE]")
            else:
                response.success()
        return 0.0


class AnalystUser(ChatMixin, HttpUser):
    weight = 6
    wait_time = between(0.2, 1.0)

    @task(6)
    def chat_stream(self) -> None:
        self.stream_chat("chat stream", MAX_TOKENS)

    @task(2)
    def chat(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
            "max_tokens": MAX_TOKENS,
        }
        with self.client.post(
            "/v1/chat/completions", json=body, headers=_auth("analyst"), catch_response=True, name="chat"
        ) as response:
            _judge(response)

    @task(1)
    def models(self) -> None:
        with self.client.get("/v1/models", headers=_auth("analyst"), catch_response=True, name="models") as response:
            _judge(response)


class DataUser(HttpUser):
    weight = 2
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        self.file_ids: list[str] = []
        self.job_ids: list[str] = []
        self.upload()  # a data user's first step: there is something to train on before any job

    @task(3)
    def upload(self) -> None:
        files = {"file": ("cases.jsonl", DATASET, "application/jsonl")}
        with self.client.post(
            "/v1/files",
            data={"purpose": "fine-tune"},
            files=files,
            headers=_auth("data"),
            catch_response=True,
            name="file upload",
        ) as response:
            _judge(response)
            if response.status_code == 200:
                self.file_ids.append(response.json()["id"])

    @task(1)
    def create_job(self) -> None:
        if not self.file_ids:
            return
        hyperparameters = {"n_epochs": 1, "batch_size": 1, "max_steps": 2}
        body = {
            "model": MODEL,
            "training_file": random.choice(self.file_ids),
            "method": {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}},
        }
        with self.client.post(
            "/v1/fine_tuning/jobs", json=body, headers=_auth("data"), catch_response=True, name="job create"
        ) as response:
            _judge(response)
            if response.status_code == 200:
                self.job_ids.append(response.json()["id"])

    @task(4)
    def poll_job(self) -> None:
        if not self.job_ids:
            return
        job_id = random.choice(self.job_ids)
        with self.client.get(
            f"/v1/fine_tuning/jobs/{job_id}", headers=_auth("data"), catch_response=True, name="job poll"
        ) as response:
            _judge(response)
        with self.client.get(
            f"/v1/fine_tuning/jobs/{job_id}/events", headers=_auth("data"), catch_response=True, name="job events"
        ) as response:
            _judge(response)

    @task(1)
    def list_files(self) -> None:
        with self.client.get("/v1/files", headers=_auth("data"), catch_response=True, name="file list") as response:
            _judge(response)


class AdminUser(HttpUser):
    """One admin: registers a second version of the model, then moves `production` back and forth."""

    fixed_count = 1
    wait_time = between(2.0, 4.0)

    def on_start(self) -> None:
        self.versions: list[str] = []
        listed = self.client.get(f"/v1/admin/models?name={MODEL}", headers=_auth("admin"), name="admin versions")
        if listed.status_code == 200:
            self.versions = [version["id"] for version in listed.json()["data"]]
        if MODEL_DIR:
            body = {"name": MODEL, "path": MODEL_DIR, "description": "second version for the load test"}
            with self.client.post(
                "/v1/admin/models", json=body, headers=_auth("admin"), catch_response=True, name="admin register"
            ) as response:
                _judge(response)
                if response.status_code == 200:
                    self.versions.append(response.json()["id"])
        self.cycle = itertools.cycle(self.versions[::-1])

    @task(2)
    def promote(self) -> None:
        if len(self.versions) < 2:
            return
        version_id = next(self.cycle)
        body = {"alias": "production", "reason": "load test: alternate versions"}
        with self.client.post(
            f"/v1/admin/models/{version_id}/promote",
            json=body,
            headers=_auth("admin"),
            catch_response=True,
            name="admin promote",
        ) as response:
            _judge(response)

    @task(1)
    def history(self) -> None:
        with self.client.get(
            "/v1/admin/model_aliases/history", headers=_auth("admin"), catch_response=True, name="admin history"
        ) as response:
            _judge(response)


class FloodUser(ChatMixin, HttpUser):
    """Overload: long streamed chats back to back, many users; the engine's bounded queue must shed the excess.

    A refused client waits the `Retry-After` it was given, as the official `openai` client does by default.
    """

    wait_time = constant(0)

    @task
    def flood(self) -> None:
        retry_after = self.stream_chat("chat stream (flood)", FLOOD_MAX_TOKENS)
        if retry_after:
            time.sleep(retry_after)  # gevent-patched: only this user waits


# --- recording ----------------------------------------------------------------------------------------------------

SAMPLES: dict[str, dict] = defaultdict(
    lambda: {"ok_ms": [], "ttft_ms": [], "shed": 0, "errors": 0, "statuses": defaultdict(int)}
)
FAILURES: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


@events.request.add_listener
def _record(request_type, name, response_time, response_length, response=None, context=None, exception=None, **_):
    sample = SAMPLES[name]
    status = getattr(response, "status_code", 0) or 0  # 0: no HTTP response at all (refused, reset, timeout)
    sample["statuses"][str(status)] += 1
    if exception is not None:
        sample["errors"] += 1
        FAILURES[name][str(exception)[:200]] += 1
    elif status in SHED_STATUSES:
        sample["shed"] += 1
    else:
        sample["ok_ms"].append(response_time)
        if context and context.get("ttft_ms") is not None:
            sample["ttft_ms"].append(context["ttft_ms"])


@events.quitting.add_listener
def _write(environment, **_):
    path = os.environ.get("ZAYA_LOAD_SAMPLES")
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"endpoints": SAMPLES, "failures": FAILURES}, handle)
