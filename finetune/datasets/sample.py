"""A sample fine-tuning dataset and pretraining corpus from the synthetic bank cases (`zaya data sample`).

`write_sample` writes `train.jsonl` and `validation.jsonl`: disposition chats (system prompt, the task and the case
file, the answer `Disposition: <LABEL>` then `Reason: ...`), labels balanced, the validation cases drawn with another
seed so no case appears in both. `write_corpus` writes case files (JSONL with a `text` field) for `zaya
pretrain`: by default an archive of closed cases, each file ending with the investigator's closing note (the
disposition and its reason, other cases than the chats'), so the base model learns the words and the reasoning of an
answer before fine-tuning teaches the chat format; `closed=False` writes the bare case files.

`variant` words and formats everything in another style (`styles.py`: a name or an integer seed), the corpus and the
chats alike. `validation_variant` writes the held-out case files in another style than the training ones, with
answers worded as in training: does the fine-tuned model read a layout and number format it never saw?
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zaya_model.training.atomic_io import write_text_atomic

from .styles import get_style
from .synthetic import explain_disposition, generate_cases, generate_chat_examples, render_case_file

TRAIN_FILE, VALIDATION_FILE, CORPUS_FILE = "train.jsonl", "validation.jsonl", "corpus.jsonl"
CORPUS_SEED = 7  # the corpus's cases differ from the chats' (seeds 1 and 2 + seed)


def validation_size(n_cases: int) -> int:
    """Held-out chats besides `n_cases` training ones: 10% of them, at least 3 (one per label), at most 200."""
    return min(200, max(3, n_cases // 10))


def write_sample(
    directory: str | Path,
    n_cases: int,
    *,
    n_validation: int | None = None,
    seed: int = 0,
    variant: str = "standard",
    validation_variant: str | None = None,
) -> dict[str, dict[str, Any]]:
    """`train.jsonl` (`n_cases` chats) and `validation.jsonl` in `directory`; returns their paths and sizes."""
    if n_cases < 1:
        raise ValueError("n_cases must be at least 1")
    n_validation = validation_size(n_cases) if n_validation is None else n_validation
    style = get_style(variant)
    held_out_style = style if validation_variant is None else get_style(validation_variant)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: dict[str, dict[str, Any]] = {}
    files = ((TRAIN_FILE, n_cases, 2 * seed + 1, style), (VALIDATION_FILE, n_validation, 2 * seed + 2, held_out_style))
    for name, n, chat_seed, file_style in files:
        records = generate_chat_examples(
            n, seed=chat_seed, tasks=("disposition",), style=file_style, answer_style=style
        )
        path = directory / name
        write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in records))
        written[name] = {"path": str(path), "n_examples": n}
    return written


def closed_case_text(case_file: str, note: str) -> str:
    """A closed case as the corpus holds it: the case file, then the investigator's closing note (`note=""` gives the
    text a base model continues with the note)."""
    return f"{case_file}\nClosing note:\n{note}"


def write_corpus(
    path: str | Path, n_cases: int, *, closed: bool = True, seed: int = CORPUS_SEED, variant: str = "standard"
) -> Path:
    """`n_cases` case files as pretraining documents (JSONL, one `{"text": ...}` per line); `closed`: each file ends
    with the investigator's closing note (`Disposition: ...` / `Reason: ...`), as a bank's archive of closed cases."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cases = generate_cases(n_cases, seed=seed)
    style = get_style(variant)
    texts = (render_case_file(case, style) for case in cases)
    if closed:
        notes = (explain_disposition(case, style) for case in cases)
        texts = (closed_case_text(text, note) for text, note in zip(texts, notes, strict=True))
    write_text_atomic(path, "".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path
