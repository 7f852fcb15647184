"""Person names through spaCy (the optional `pii` extra): found, counted, redacted; clear errors when unusable.

The pipeline here is built in the test (blank English + an entity ruler labelling PERSON), so the test runs offline
without spaCy's trained pipelines, which are not on PyPI; it checks our integration, not spaCy's NER quality.
"""

from __future__ import annotations

import json

import pytest
import spacy  # the `pii` extra, which `make install` installs
from finetune_helpers import chat

from finetune.datasets.person_names import PersonModelError, load_person_finder
from finetune.datasets.pii import find_pii, scan_file
from zaya_cli.main import main

NAMES = [["Maria", "Okafor"], ["James", "Novak"]]


@pytest.fixture(scope="module")
def person_pipeline(tmp_path_factory):
    nlp = spacy.blank("en")
    ruler = nlp.add_pipe("entity_ruler")
    ruler.add_patterns([{"label": "PERSON", "pattern": [{"TEXT": part} for part in name]} for name in NAMES])
    directory = tmp_path_factory.mktemp("spacy") / "person-pipeline"
    nlp.to_disk(directory)
    return str(directory)


def test_person_names_are_found_beside_the_structured_types(person_pipeline):
    finder = load_person_finder(person_pipeline)
    text = "Maria Okafor paid with card 4111-1111-1111-1111; James Novak did not."
    found = [(match.type, match.text) for match in find_pii(text, person_finder=finder)]
    assert found == [("PERSON", "Maria Okafor"), ("CARD_NUMBER", "4111-1111-1111-1111"), ("PERSON", "James Novak")]
    assert [match.type for match in find_pii(text)] == ["CARD_NUMBER"]  # without a pipeline, no names


def test_scan_counts_and_redacts_person_names(person_pipeline, write_jsonl, tmp_path):
    data = write_jsonl([chat(user="Case of Maria Okafor."), chat(), chat(user="James Novak, SSN 123-45-6789")])
    out = tmp_path / "redacted.jsonl"
    report = scan_file(data, redact_to=out, person_model=person_pipeline)
    assert report.counts["PERSON"] == 2 and report.example_lines["PERSON"] == [1, 3]
    assert report.counts["US_SSN"] == 1 and "PERSON" not in report.not_scanned
    redacted = [json.loads(line)["messages"][1]["content"] for line in out.read_text().splitlines()]
    assert redacted[0] == "Case of [PERSON]." and redacted[2] == "[PERSON], SSN [US_SSN]"


def test_unusable_pipelines_are_refused_with_the_reason(tmp_path, write_jsonl):
    with pytest.raises(PersonModelError, match="'no_such_pipeline' is not installed"):
        load_person_finder("no_such_pipeline")
    no_person = spacy.blank("en")
    no_person.add_pipe("entity_ruler").add_patterns([{"label": "ORG", "pattern": "Acme"}])
    no_person.to_disk(tmp_path / "orgs")
    with pytest.raises(PersonModelError, match="has no PERSON entity label"):
        load_person_finder(str(tmp_path / "orgs"))


def test_cli_person_model_option(person_pipeline, write_jsonl, capsys):
    data = write_jsonl([chat(user="Case of Maria Okafor.")])
    assert main(["data", "pii", str(data), "--person-model", person_pipeline]) == 0
    printed = capsys.readouterr().out
    assert "PERSON: 1 (lines 1)" in printed and "not scanned" not in printed
    assert main(["data", "pii", str(data), "--person-model", "no_such_pipeline"]) != 0
    assert "--person-model: spaCy pipeline 'no_such_pipeline' is not installed" in capsys.readouterr().err
