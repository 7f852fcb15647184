"""`GET /v1/models` in OpenAI's list shape, read with the official client; a model's tokenizer files."""

from __future__ import annotations

import io
import zipfile

import openai
import pytest

from server.db.base import utcnow
from server.db.models import File, FineTuningJob, JobStatus, ModelAlias, ModelVersion


@pytest.fixture
def analyst_client(live_server, keys):
    with openai.OpenAI(base_url=f"{live_server}/v1", api_key=keys["analyst"], max_retries=0, timeout=30) as client:
        yield client


def test_no_models_registered_is_an_empty_list(analyst_client):
    assert list(analyst_client.models.list()) == []
    with pytest.raises(openai.NotFoundError):
        analyst_client.models.retrieve("zaya-tiny")


def test_lists_names_aliases_and_fine_tuned_models(analyst_client, sessions):
    with sessions() as session:
        version = ModelVersion(name="zaya-tiny", version=1, kind="full", path="/m/1")
        archived = ModelVersion(name="old", version=1, kind="full", path="/m/old", status="archived")
        dataset = File(filename="t.jsonl", purpose="fine-tune", bytes=1, sha256="0" * 64)
        session.add_all([version, archived, dataset])
        session.flush()
        session.add(ModelAlias(model_name="zaya-tiny", alias="production", version_id=version.id))
        session.add(
            FineTuningJob(
                model="zaya-tiny",
                training_file_id=dataset.id,
                status=JobStatus.succeeded,
                fine_tuned_model="ft:zaya-tiny:org:bank:ftjob-1",
                finished_at=utcnow(),
            )
        )
        session.commit()

    models = {model.id: model for model in analyst_client.models.list()}
    assert set(models) == {"zaya-tiny", "zaya-tiny@production", "ft:zaya-tiny:org:bank:ftjob-1"}
    assert all(model.object == "model" and model.created > 0 for model in models.values())
    assert analyst_client.models.retrieve("zaya-tiny@production").id == "zaya-tiny@production"


def test_a_models_tokenizer_is_served_to_keys_as_its_files(client, auth, sessions, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    with sessions() as session:
        version = ModelVersion(name="zaya-tiny", version=1, kind="full", path=str(tiny_model_dir))
        session.add(version)
        session.flush()
        session.add(ModelAlias(model_name="zaya-tiny", alias="production", version_id=version.id))
        session.commit()
    assert client.get("/v1/models/zaya-tiny/tokenizer").status_code == 401  # behind a key, as chat is
    missing = client.get("/v1/models/other/tokenizer", headers=auth("analyst"))
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"

    response = client.get("/v1/models/zaya-tiny@production/tokenizer", headers=auth("analyst"))
    assert response.status_code == 200 and response.headers["content-type"] == "application/zip"
    assert response.headers["content-disposition"] == 'attachment; filename="zaya-tiny_production-tokenizer.zip"'
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "tokenizer")
    assert "tokenizer.json" in names and not [name for name in names if name.endswith((".safetensors", ".bin"))]
    served, original = (
        AutoTokenizer.from_pretrained(tmp_path / "tokenizer"),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    text = "Case 7: transfer of 9,400 EUR flagged."
    assert served.encode(text) == original.encode(text) and served.chat_template == original.chat_template
    assert (served.eos_token, served.bos_token, len(served)) == (original.eos_token, original.bos_token, len(original))
