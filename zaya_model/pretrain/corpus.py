"""Streaming corpus reading and document packing for pretraining.

A corpus is a text file, a JSONL file with a `text` field per line, or a directory holding any number of them
(`.txt` and `.jsonl`, found recursively and read in sorted path order). In a text file, documents are separated by
blank lines; in JSONL every line is one document.

Nothing is held in memory beyond a bounded window of documents waiting to be packed and a bounded shuffle buffer:
`PackedStream` reads the files with a byte cursor, tokenizes one document at a time, wraps it in BOS/EOS and packs
rows of `seq_len` tokens. Each row carries `position_ids` that restart at 0 where a document starts (a document split
across rows continues its positions), and `labels` that are -100 on every document's first token so no token is
trained to predict the next document. Two packings:
- `best_fit` (the default): a document that fits in a row is never split. Each row starts with the oldest waiting
  document and is filled with the longest waiting documents that still fit (best fit over a window of
  `PACK_WINDOW` documents); what no document fills is padding, which carries no loss. Only documents longer than a
  row are cut, into row-long pieces. A split document's end is trained without its beginning in view: a closing note
  whose case file was cut off can only be guessed, which teaches the model to invent values instead of copying them
  ("Fewer Truncations Improve Language Modeling", Ding et al., 2024).
- `concatenate`: the documents' tokens end to end, cut every `seq_len` tokens (no padding; most documents longer
  than a fraction of a row are split).
Rows pass through a seeded shuffle buffer, so the order is deterministic given the seed. `PackedStream.state_dict()`
is the exact data position (file, byte offset, waiting documents, shuffle buffer, RNG): loading it continues with the
very next batch, without re-reading what came before.

Each document belongs to the training or the held-out validation split by a keyed hash of its text, so the two
splits are disjoint (a duplicated document lands in one split only) and stable under reordering.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

CORPUS_SUFFIXES = (".txt", ".jsonl")
IGNORE_INDEX = -100
PACKINGS = ("best_fit", "concatenate")
PACK_WINDOW = 64  # documents best-fit packing chooses from


class CorpusError(ValueError):
    """The corpus cannot be used: missing, empty, not UTF-8, or malformed JSONL."""


def corpus_files(path: str | Path) -> list[Path]:
    """The corpus files under `path` (a file or a directory), in a deterministic order."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in CORPUS_SUFFIXES)
    else:
        raise CorpusError(f"corpus not found: {path}")
    if not files:
        raise CorpusError(f"no {' or '.join(CORPUS_SUFFIXES)} files under {path}")
    return files


def corpus_fingerprint(files: list[Path]) -> list[list]:
    """Names and sizes of the files: a resumed run checks its byte cursor still points into the same corpus."""
    return [[str(f), f.stat().st_size] for f in files]


def read_documents(path: Path, start: int = 0) -> Iterator[tuple[str, int]]:
    """Yield `(document, byte offset just after it)` from one file, starting at byte `start`."""
    is_jsonl = path.suffix == ".jsonl"
    paragraph: list[str] = []
    offset = start
    with path.open("rb") as handle:
        handle.seek(start)
        for raw in handle:
            offset += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CorpusError(f"{path}: not UTF-8 text (byte {offset - len(raw) + error.start})") from None
            if is_jsonl:
                if line.strip():
                    yield _jsonl_text(path, line, offset), offset
            elif line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "".join(paragraph).rstrip("\n"), offset
                paragraph = []
        if paragraph:
            yield "".join(paragraph).rstrip("\n"), offset


def _jsonl_text(path: Path, line: str, offset: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise CorpusError(f"{path}: invalid JSON on the line ending at byte {offset}: {error.msg}") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise CorpusError(f"{path}: every JSONL line needs a string `text` field (line ending at byte {offset})")
    return record["text"]


def is_validation(text: str, seed: int, fraction: float) -> bool:
    """Whether a document belongs to the held-out split: a seeded hash of its text, so identical texts agree."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def iter_split(files: list[Path], split: str, seed: int, fraction: float) -> Iterator[str]:
    """Every document of one split (`"train"` or `"validation"`), in corpus order, one pass."""
    want_validation = split == "validation"
    for path in files:
        for text, _ in read_documents(path):
            if is_validation(text, seed, fraction) == want_validation:
                yield text


@dataclass
class PackingSpec:
    seq_len: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    seed: int
    validation_fraction: float
    packing: str = "best_fit"


# A packed document, or the rest of one cut at a row's end: its token ids and their positions in the document.
Piece = tuple[list[int], list[int]]


def pack_row(waiting: list[Piece], seq_len: int, pad_token_id: int, packing: str) -> tuple:
    """The next row from the pieces `waiting` (oldest first; consumed in place): `(ids, positions)` when the row is
    full, `(ids, positions, real length)` when its end is padding. `concatenate` takes the pieces in order and cuts
    the last one at the row's end; `best_fit` starts with the oldest and adds the longest that still fit, cutting only
    a piece longer than the whole row."""
    ids: list[int] = []
    positions: list[int] = []
    while waiting and len(ids) < seq_len:
        space = seq_len - len(ids)
        index = 0
        if packing == "best_fit" and ids:
            fitting = [i for i, (piece, _) in enumerate(waiting) if len(piece) <= space]
            if not fitting:
                break
            index = max(fitting, key=lambda i: len(waiting[i][0]))
        piece_ids, piece_positions = waiting.pop(index)
        if len(piece_ids) > space:  # the rest waits at the front, its positions continuing
            waiting.insert(0, (piece_ids[space:], piece_positions[space:]))
        ids += piece_ids[:space]
        positions += piece_positions[:space]
    if len(ids) == seq_len:
        return ids, positions
    padding = seq_len - len(ids)
    return ids + [pad_token_id] * padding, positions + list(range(padding)), len(ids)


class PackedStream:
    """An endless, resumable stream of packed training rows (the corpus repeats, one epoch after another)."""

    def __init__(self, files: list[Path], tokenizer, spec: PackingSpec, shuffle_buffer: int = 256):
        self.files = files
        self.tokenizer = tokenizer
        self.spec = spec
        self.shuffle_buffer = shuffle_buffer
        self.epoch = 0
        self.file_index = 0
        self.byte_offset = 0
        self.waiting: list[Piece] = []  # documents (or their rest) read but not yet packed, oldest first
        self.buffer: list[tuple] = []
        self.rng = random.Random(spec.seed)
        self.batches_drawn = 0
        self._documents: Iterator[tuple[str, int]] | None = None
        self._documents_in_epoch = 0

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        rows = [self._next_row() for _ in range(batch_size)]
        self.batches_drawn += 1
        return rows_to_batch(rows)

    def _next_row(self) -> tuple:
        while len(self.buffer) < self.shuffle_buffer:
            self.buffer.append(self._pack_row())
        index = self.rng.randrange(len(self.buffer))
        self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
        return self.buffer.pop()

    def _pack_row(self) -> tuple:
        spec = self.spec
        if spec.packing == "best_fit":
            while len(self.waiting) < PACK_WINDOW:
                self.waiting.append(self._next_piece())
        else:
            while sum(len(ids) for ids, _ in self.waiting) < spec.seq_len:
                self.waiting.append(self._next_piece())
        return pack_row(self.waiting, spec.seq_len, spec.pad_token_id, spec.packing)

    def _next_piece(self) -> Piece:
        ids = self.tokenizer(self._next_document(), add_special_tokens=False)["input_ids"]
        document = [self.spec.bos_token_id, *ids, self.spec.eos_token_id]
        return document, list(range(len(document)))

    def _next_document(self) -> str:
        while True:
            if self._documents is None:
                self._documents = read_documents(self.files[self.file_index], self.byte_offset)
            for text, offset in self._documents:
                self.byte_offset = offset
                if not is_validation(text, self.spec.seed, self.spec.validation_fraction):
                    self._documents_in_epoch += 1
                    return text
            self._documents = None
            self.byte_offset = 0
            self.file_index += 1
            if self.file_index == len(self.files):
                if self._documents_in_epoch == 0:
                    raise CorpusError("the corpus has no training documents")
                self.file_index, self.epoch, self._documents_in_epoch = 0, self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "file_index": self.file_index,
            "byte_offset": self.byte_offset,
            "documents_in_epoch": self._documents_in_epoch,
            "waiting": [(list(ids), list(positions)) for ids, positions in self.waiting],
            "buffer": [tuple(list(part) if isinstance(part, list) else part for part in row) for row in self.buffer],
            "rng": self.rng.getstate(),
            "batches_drawn": self.batches_drawn,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.file_index = state["file_index"]
        self.byte_offset = state["byte_offset"]
        self._documents_in_epoch = state["documents_in_epoch"]
        if "waiting" in state:
            self.waiting = [(list(ids), list(positions)) for ids, positions in state["waiting"]]
        else:  # a checkpoint of the concatenating stream before it kept whole documents waiting
            pending = list(state["pending_ids"])
            self.waiting = [(pending, list(state["pending_positions"]))] if pending else []
        self.buffer = [tuple(list(part) if isinstance(part, list) else part for part in row) for row in state["buffer"]]
        self.rng.setstate(as_rng_state(state["rng"]))
        self.batches_drawn = state["batches_drawn"]
        self._documents = None  # reopened at the saved byte offset on the next read


def as_rng_state(state) -> tuple:
    # A round trip through torch.save may turn the state's inner tuple into a list.
    version, internal, gauss = state
    return version, tuple(internal), gauss


def validation_rows(files: list[Path], tokenizer, spec: PackingSpec, max_rows: int) -> list[tuple]:
    """Pack the validation split as training packs (`spec.packing`), in corpus order: `(ids, positions, real
    length)` rows, padded where no document fills them."""
    rows: list[tuple] = []
    waiting: list[Piece] = []
    enough = PACK_WINDOW if spec.packing == "best_fit" else 1
    documents = iter_split(files, "validation", spec.seed, spec.validation_fraction)
    while len(rows) < max_rows:
        for text in documents:
            document = [spec.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"], spec.eos_token_id]
            waiting.append((document, list(range(len(document)))))
            if len(waiting) >= enough and sum(len(ids) for ids, _ in waiting) >= spec.seq_len:
                break
        if not waiting:
            break
        row = pack_row(waiting, spec.seq_len, spec.pad_token_id, spec.packing)
        rows.append(row if len(row) == 3 else (*row, spec.seq_len))
    return rows


def rows_to_batch(rows: list[tuple]) -> dict[str, torch.Tensor]:
    """Stack rows into model inputs; a row's optional third item is its real length (the rest is padding)."""
    input_ids = torch.tensor([row[0] for row in rows], dtype=torch.long)
    position_ids = torch.tensor([row[1] for row in rows], dtype=torch.long)
    labels = input_ids.clone()
    labels[position_ids == 0] = IGNORE_INDEX  # the first token of a document is not predicted from the previous one
    for index, row in enumerate(rows):
        if len(row) > 2:
            labels[index, row[2] :] = IGNORE_INDEX
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
