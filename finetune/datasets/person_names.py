"""Person names in free text through a spaCy NER pipeline: the optional detector behind `zaya data pii --person-model`.

spaCy (a maintained NLP library, the engine Microsoft Presidio uses for names too) runs offline once a pipeline is
installed; it comes with the `pii` extra (`pip install 'zaya-platform[pii]'`). Its trained English pipelines
(`en_core_web_sm`, `_md`, `_lg`, `_trf`) are published by spaCy as wheels on its GitHub releases, not on PyPI: PyPI
only has third-party re-uploads, which this project does not depend on. Download the wheel once, `pip install` the
file on the offline machine, and pass its package name; a pipeline directory (`nlp.to_disk`) works too. Any pipeline
whose entity recognizer labels `PERSON` (as spaCy's OntoNotes-trained ones do) fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

PERSON_LABEL = "PERSON"
# Components a named-entity pass does not need in spaCy's trained pipelines (their NER has its own tok2vec).
_UNNEEDED = ["tagger", "parser", "attribute_ruler", "lemmatizer", "senter", "morphologizer"]

PersonFinder = Callable[[str, str], Iterator[tuple[int, int]]]


class PersonModelError(ValueError):
    """spaCy or the named pipeline is missing, or the pipeline does not label persons."""


def load_person_finder(model: str) -> PersonFinder:
    """A finder yielding the (start, end) character spans of the person names spaCy's pipeline `model` sees."""
    try:
        import spacy
    except ImportError:
        raise PersonModelError(
            "person names need spaCy: install the `pii` extra (pip install 'zaya-platform[pii]')"
        ) from None
    try:
        nlp = spacy.load(model, exclude=_UNNEEDED)
    except OSError as error:
        raise PersonModelError(
            f"spaCy pipeline {model!r} is not installed: pip install its wheel (spaCy publishes "
            f"en_core_web_sm and the larger English pipelines on its GitHub releases) or pass a pipeline directory "
            f"({error})"
        ) from None
    if not any(PERSON_LABEL in labels for labels in nlp.pipe_labels.values()):
        raise PersonModelError(f"spaCy pipeline {model!r} has no {PERSON_LABEL} entity label (pipes: {nlp.pipe_names})")

    def find_persons(text: str, _region: str) -> Iterator[tuple[int, int]]:
        for entity in nlp(text).ents:
            if entity.label_ == PERSON_LABEL:
                yield entity.start_char, entity.end_char

    return find_persons
