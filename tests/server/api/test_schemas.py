"""Response objects read from database rows (`from_attributes`), and the one list envelope."""

from __future__ import annotations

from datetime import UTC, datetime

from server.api.routes.admin_models import AliasObject
from server.api.routes.fine_tuning import EventObject, JobObject
from server.api.schemas import FileObject, ListResponse
from server.db.models import File, FineTuningJob, JobEvent, ModelAlias

MOMENT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def test_a_list_reads_its_rows_and_names_its_ends():
    files = [
        File(id=f"file-{n}", filename=f"{n}.jsonl", purpose="fine-tune", bytes=n, status="processed", created_at=MOMENT)
        for n in (1, 2, 3)
    ]
    page = ListResponse[FileObject](data=files, has_more=True)
    assert page.model_dump(mode="json") == {
        "object": "list",
        "data": [
            {
                "id": f"file-{n}",
                "object": "file",
                "bytes": n,
                "created_at": int(MOMENT.timestamp()),
                "expires_at": None,
                "filename": f"{n}.jsonl",
                "purpose": "fine-tune",
                "status": "processed",
                "status_details": None,
            }
            for n in (1, 2, 3)
        ],
        "first_id": "file-1",
        "last_id": "file-3",
        "has_more": True,
    }
    assert ListResponse[FileObject](data=[]).model_dump()["first_id"] is None


def test_objects_rename_and_derive_openai_fields_from_the_row():
    job = FineTuningJob(
        id="ftjob-1",
        model="base",
        training_file_id="file-1",
        validation_file_id=None,
        status="queued",
        suffix="risk",
        seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
        user_metadata={"team": "aml"},
        devices=1,
        created_at=MOMENT,
    )
    shown = JobObject.model_validate(job)
    assert (shown.training_file, shown.validation_file, shown.user_provided_suffix) == ("file-1", None, "risk")
    assert shown.metadata == {"team": "aml"} and shown.created_at == int(MOMENT.timestamp())
    assert shown.hyperparameters == {"batch_size": "auto", "learning_rate_multiplier": "auto", "n_epochs": 2}
    assert shown.method == job.method and shown.organization_id == "zaya" and shown.result_files == []

    event = EventObject.model_validate(
        JobEvent(id=42, job_id="ftjob-1", level="info", message="m", type="message", created_at=MOMENT)
    )
    assert event.id == "ftevent-42"
    alias = ModelAlias(model_name="bank", alias="production", version_id="mv-1", updated_at=MOMENT)
    assert AliasObject.model_validate(alias).model_dump()["model"] == "bank@production"
