"""PostgreSQL stopped and started again under load: requests fail cleanly (503 + an OpenAI error body) while it is
down, and the server and a worker reconnect by themselves: the job training meanwhile goes on and loses nothing.

The test runs its own PostgreSQL (`private_services.PrivatePostgres`: initdb + pg_ctl in a temp dir, on a free port)
so it can stop it; the shared server is never touched.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from private_services import PrivatePostgres
from sqlalchemy import func, select

from benchmarks.load_test.stack import Stack
from server.db.models import FineTuningJob, JobEvent, ModelVersion

from .processes import DATASET, assert_no_secret_logged, logs, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def postgres() -> Iterator[PrivatePostgres]:
    with PrivatePostgres.running() as server:
        yield server


class Load:
    """Clients hitting authenticated routes in a loop; every answer (or transport error) is counted by phase."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.phase = "before"
        self.results: dict[str, Counter] = {}
        self.bad_bodies: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(path,)) for path in ("/v1/models", "/v1/files")]

    def _run(self, path: str) -> None:
        with httpx.Client(base_url=self.stack.url, headers=self.stack.headers("admin"), timeout=30) as client:
            while not self.stop.is_set():
                phase = self.phase
                try:
                    response = client.get(path)
                    outcome = response.status_code
                    if outcome == 503 and not (response.headers.get("Retry-After") and "error" in response.json()):
                        self.bad_bodies.append(response.text)
                except httpx.HTTPError as error:
                    outcome = type(error).__name__
                if self.phase != phase:  # in flight across a stop or start: either answer is right
                    phase = "stopping" if phase == "before" else "starting" if phase == "down" else phase
                self.results.setdefault(phase, Counter())[outcome] += 1
                time.sleep(0.05)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def test_requests_fail_cleanly_while_postgres_is_down_and_everything_reconnects(tmp_path, postgres, model_dir):
    # The load runs for as long as the job takes to start training (minutes on a loaded machine): no per-key limit
    # (0 turns it off), so every answer counted is the database's doing.
    unlimited = {"ZAYA_RATE_LIMIT_REQUESTS_PER_MINUTE": "0"}
    with Stack(tmp_path / "data", database_url=postgres.url(), log_dir=tmp_path, env=unlimited) as stack:
        stack.prepare(model_dir)
        stack.start_server()
        worker = stack.start_worker()
        client = httpx.Client(base_url=stack.url, headers=stack.headers("data"), timeout=60)
        # A job long enough to be training when the database goes away.
        upload = client.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", DATASET)})
        hyperparameters = {"n_epochs": 100, "batch_size": 1, "max_steps": 200, "eval_every": 20}
        body = {"model": "zaya-tiny", "training_file": upload.json()["id"]}
        body["method"] = {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}
        created = client.post("/v1/fine_tuning/jobs", json=body)
        assert created.status_code == 200, created.text
        job_id = created.json()["id"]

        def job() -> dict:
            return client.get(f"/v1/fine_tuning/jobs/{job_id}").json()

        def training() -> bool:
            events = client.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]
            return any(event["type"] == "metrics" for event in events)

        with Load(stack) as load:
            wait_for(training, 240, stack, "the job to train", poll=0.2)
            wait_for(lambda: sum(load.results.get("before", {}).values()) >= 4, 60, stack, "requests before the stop")
            assert job()["status"] == "running"
            load.phase = "stopping"  # requests in flight while PostgreSQL shuts down may still succeed
            postgres.stop()
            load.phase = "down"
            wait_for(lambda: sum(load.results.get("down", {}).values()) >= 10, 60, stack, "requests while down")
            down = client.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", DATASET)})
            load.phase = "starting"
            postgres.start()
            load.phase = "after"
            wait_for(lambda: load.results.get("after", {}).get(200, 0) >= 10, 60, stack, "recovery", poll=0.2)

        assert set(load.results["before"]) == set(load.results["after"]) == {200}, load.results
        assert set(load.results["down"]) == {503}, (load.results, logs(stack))  # no 500, no dropped connection
        for phase in ("stopping", "starting"):
            assert set(load.results.get(phase, {})) <= {200, 503}, load.results
        assert not load.bad_bodies, load.bad_bodies[:3]
        assert down.status_code == 503 and down.json()["error"]["code"] == "database_unavailable", down.text
        assert stack.server.poll() is None, "the server died"

        # The worker reconnected too: training went on through the outage and its records waited for the database,
        # so the job finishes in its first attempt with every step's training loss recorded, once.
        wait_for(lambda: job()["status"] in ("succeeded", "failed", "cancelled"), 300, stack, "the job", poll=0.5)
        assert worker.poll() is None, "the worker died"
        with stack.database() as sessions, sessions() as session:
            query = select(JobEvent.message).where(JobEvent.job_id == job_id)
            events = list(session.scalars(query.order_by(JobEvent.id)))
            versions = session.scalar(select(func.count()).where(ModelVersion.job_id == job_id))
            attempts = session.get(FineTuningJob, job_id).attempts
        assert job()["status"] == "succeeded", (job(), events[-20:], logs(stack))
        assert attempts == 1, events
        assert sum("training loss=" in message for message in events) == hyperparameters["max_steps"], events
        assert sum(message.startswith("Job succeeded") for message in events) == 1 and versions == 1, events
    assert_no_secret_logged(stack)
