"""A full disk while receiving an upload and while writing a checkpoint, on a real small tmpfs.

The data dir (uploads, job outputs) lives on a tmpfs of a few MiB that the test fills up; the database, the base
model and the logs live elsewhere, as they would on their own volumes.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open
from sqlalchemy import func, select

from benchmarks.load_test.stack import Stack
from server.db.models import Checkpoint, File, FineTuningJob, ModelVersion
from server.services.storage import INCOMING_DIR

from .processes import DATASET, assert_no_secret_logged, dataset, freeze, logs, thaw, visible_files, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory) -> Iterator[Path]:
    mountpoint = tmp_path_factory.mktemp("disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mountpoint)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {mounted.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "--lazy", str(mountpoint)], check=False)


def fill(directory: Path, leave: int = 0) -> Path:
    """Write a filler file until the disk is full, then give back `leave` bytes."""
    filler = directory / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(descriptor, b"\0" * 65536)
    except OSError as error:
        assert error.errno == errno.ENOSPC
    os.ftruncate(descriptor, max(os.fstat(descriptor).st_size - leave, 0))
    os.close(descriptor)
    return filler


@pytest.fixture(scope="module")
def disk_stack(tmp_path_factory, small_disk, model_dir, fresh_database) -> Iterator[Stack]:
    """One server for both tests (each start costs seconds); the tests free the space they filled."""
    elsewhere = tmp_path_factory.mktemp("not-on-the-small-disk")
    with (
        fresh_database(elsewhere) as database_url,
        Stack(small_disk / "data", database_url=database_url, log_dir=elsewhere) as stack,
    ):
        stack.prepare(model_dir)
        stack.start_server()
        yield stack
    assert_no_secret_logged(stack)


def test_an_upload_on_a_full_disk_is_a_clear_507_and_leaves_nothing(disk_stack, small_disk):
    stack = disk_stack
    client = httpx.Client(base_url=stack.url, headers=stack.headers("data"), timeout=60)
    form = {"purpose": "fine-tune"}
    files_dir = stack.data_dir / "files"
    with stack.database() as sessions, sessions() as session:
        rows_before = set(session.scalars(select(File.id)))
    first = client.post("/v1/files", data=form, files={"file": ("a.jsonl", DATASET)})
    assert first.status_code == 200, first.text
    stored = {first.json()["id"]} | rows_before

    filler = fill(small_disk, leave=32 * 1024)
    big = dataset(8000)  # ~0.8 MB: does not fit in what is left
    try:
        refused = client.post("/v1/files", data=form, files={"file": ("big.jsonl", big)})
    finally:
        filler.unlink()  # space again, whatever happens: the next checks and tests need it
    assert refused.status_code == 507, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("disk_full", "file", "server_error")
    assert "no space left" in error["message"]

    with stack.database() as sessions, sessions() as session:
        assert set(session.scalars(select(File.id))) == stored
    assert visible_files(files_dir) == stored
    assert not list((files_dir / INCOMING_DIR).iterdir()), "the temp file was left behind"
    assert (files_dir / first.json()["id"]).read_bytes() == DATASET

    # Once there is space again, the same upload goes through.
    again = client.post("/v1/files", data=form, files={"file": ("big.jsonl", big)})
    assert again.status_code == 200, again.text
    assert (files_dir / again.json()["id"]).read_bytes() == big


def test_a_checkpoint_on_a_full_disk_fails_the_job_clearly_and_keeps_the_previous_one(disk_stack, small_disk):
    stack = disk_stack
    client = httpx.Client(base_url=stack.url, headers=stack.headers("data"), timeout=60)
    upload = client.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", DATASET)})
    hyperparameters = {"n_epochs": 100, "batch_size": 1, "max_steps": 8, "eval_every": 4}
    body = {"model": "zaya-tiny", "training_file": upload.json()["id"]}
    body["method"] = {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}
    job_id = client.post("/v1/fine_tuning/jobs", json=body).json()["id"]
    worker = stack.start_worker()

    with stack.database() as sessions:

        def checkpoint_steps() -> list[int]:
            with sessions() as session:
                return sorted(session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))

        def job() -> FineTuningJob:
            with sessions() as session:
                return session.get(FineTuningJob, job_id)

        # Right after the first checkpoint is published, the disk fills up (the worker and its training process are
        # frozen meanwhile). The disk is watched, not the database: the worker records a checkpoint after its
        # training process has moved on.
        checkpoints = stack.data_dir / "jobs" / job_id / "attempt-1" / "checkpoints"
        wait_for((checkpoints / "checkpoint-4").is_dir, 240, stack, "the first checkpoint", poll=0.002)
        freeze(worker)
        filler = fill(small_disk)
        thaw(worker)
        try:
            wait_for(lambda: job().status in ("succeeded", "failed", "cancelled"), 240, stack, "the job to end")
        finally:
            filler.unlink()
        finished, recorded = job(), checkpoint_steps()
        with sessions() as session:
            versions = session.scalar(select(func.count()).where(ModelVersion.job_id == job_id))

    assert finished.status == "failed", (finished.status, logs(stack))
    assert "No space left on device" in finished.error["message"], finished.error
    assert versions == 0 and finished.fine_tuned_model is None
    assert worker.poll() is None, "the worker died"

    # The previous checkpoint is whole (its weights and metrics read back); nothing half-written is left around it.
    assert recorded == [4]
    assert sorted(path.name for path in checkpoints.iterdir()) == ["checkpoint-4"]
    assert json.loads((checkpoints / "checkpoint-4" / "metrics.json").read_text())["step"] == 4
    with safe_open(checkpoints / "checkpoint-4" / "adapter_model.safetensors", framework="pt") as weights:
        assert all(weights.get_tensor(name).numel() > 0 for name in weights.keys())  # noqa: SIM118
    assert not (stack.data_dir / "jobs" / job_id / "attempt-1" / "final").exists()
