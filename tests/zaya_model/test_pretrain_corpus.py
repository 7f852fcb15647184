"""Streaming corpus reading and packing: document boundaries, determinism, the validation split, exact resume."""

import json

import pytest
import torch

from zaya_model.pretrain.corpus import (
    IGNORE_INDEX,
    PACKINGS,
    CorpusError,
    PackedStream,
    PackingSpec,
    corpus_files,
    iter_split,
    pack_row,
    validation_rows,
)
from zaya_model.pretrain.tokenizer import train_tokenizer

DOCUMENTS = [
    f"Case {i}: customer {i * 7} sent {i * 13} USD to account {i % 5}." + " More." * (i % 9) for i in range(60)
]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS[30:]))
    (root / "nested").mkdir()
    (root / "nested" / "a.txt").write_text("\n\n".join(DOCUMENTS[:30]) + "\n")
    (root / "ignored.csv").write_text("not,a,corpus\n")
    return root


@pytest.fixture(scope="module")
def tokenizer():
    # Digits split: the documents run 18-39 tokens, so 20 rows of 48 take fewer documents than the corpus holds.
    return train_tokenizer(DOCUMENTS, vocab_size=400, split_digits=True)


def make_spec(tokenizer, seed=0, fraction=0.2, seq_len=24, packing="concatenate"):
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return PackingSpec(seq_len, *ids, seed, fraction, packing)


def test_reads_text_and_jsonl_in_sorted_order(corpus_dir):
    files = corpus_files(corpus_dir)
    assert [f.name for f in files] == ["b.jsonl", "a.txt"]  # sorted by path: "b.jsonl" < "nested/a.txt"
    everything = list(iter_split(files, "train", 0, 0.0))
    assert everything == DOCUMENTS[30:] + DOCUMENTS[:30]


def test_validation_split_is_disjoint_and_complete(corpus_dir):
    files = corpus_files(corpus_dir)
    train = list(iter_split(files, "train", 0, 0.2))
    validation = list(iter_split(files, "validation", 0, 0.2))
    assert validation and train
    assert not set(train) & set(validation)
    assert sorted(train + validation) == sorted(DOCUMENTS)
    assert list(iter_split(files, "validation", 1, 0.2)) != validation  # the seed picks the split


def test_rows_restart_positions_at_each_document_and_round_trip(corpus_dir, tokenizer):
    files = corpus_files(corpus_dir)
    spec = make_spec(tokenizer)
    stream = PackedStream(files, tokenizer, spec, shuffle_buffer=1)  # buffer of 1: corpus order
    batches = [stream.next_batch(4) for _ in range(12)]
    ids = torch.cat([b["input_ids"].reshape(-1) for b in batches])
    positions = torch.cat([b["position_ids"].reshape(-1) for b in batches])
    labels = torch.cat([b["labels"].reshape(-1) for b in batches])
    assert all(b["input_ids"].shape == (4, spec.seq_len) for b in batches)

    starts = (positions == 0).nonzero().flatten().tolist()
    assert all(ids[s] == tokenizer.bos_token_id for s in starts)
    assert (ids == tokenizer.bos_token_id).sum() == len(starts)
    assert (labels == IGNORE_INDEX).nonzero().flatten().tolist() == starts  # no prediction across documents
    # Positions count up by one inside a document, across row boundaries too.
    steps = positions[1:] - positions[:-1]
    assert torch.all((steps == 1) | (positions[1:] == 0))

    train_docs = list(iter_split(files, "train", spec.seed, spec.validation_fraction))
    decoded = [tokenizer.decode(ids[s + 1 : e - 1].tolist()) for s, e in zip(starts, starts[1:], strict=False)]
    assert all(ids[e - 1] == tokenizer.eos_token_id for e in starts[1:])
    assert decoded == train_docs[: len(decoded)]
    assert len(decoded) > 20


def test_order_is_deterministic_from_the_seed(corpus_dir, tokenizer):
    files = corpus_files(corpus_dir)

    def draw(seed):
        stream = PackedStream(files, tokenizer, make_spec(tokenizer, seed=seed), shuffle_buffer=16)
        return torch.cat([stream.next_batch(4)["input_ids"] for _ in range(10)])

    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))


@pytest.mark.parametrize("packing", PACKINGS)
def test_saved_position_continues_with_the_exact_next_batch(corpus_dir, tokenizer, tmp_path, packing):
    files = corpus_files(corpus_dir)
    spec = make_spec(tokenizer, packing=packing)
    stream = PackedStream(files, tokenizer, spec, shuffle_buffer=8)
    for _ in range(7):
        stream.next_batch(3)
    torch.save(stream.state_dict(), tmp_path / "position.pt")
    expected = [stream.next_batch(3) for _ in range(40)]  # far enough to wrap into the next epoch
    assert stream.epoch >= 1

    resumed = PackedStream(files, tokenizer, spec, shuffle_buffer=8)
    resumed.load_state_dict(torch.load(tmp_path / "position.pt", weights_only=False))
    for want in expected:
        got = resumed.next_batch(3)
        assert all(torch.equal(got[key], want[key]) for key in want)


def test_best_fit_never_splits_a_document_that_fits_a_row(corpus_dir, tokenizer):
    files = corpus_files(corpus_dir)
    spec = make_spec(tokenizer, fraction=0.0, seq_len=48, packing="best_fit")
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2 for text in DOCUMENTS]
    assert max(lengths) <= spec.seq_len < sum(lengths) // 10  # several documents per row, none too long
    stream = PackedStream(files, tokenizer, spec, shuffle_buffer=1)
    batches = [stream.next_batch(4) for _ in range(5)]
    documents, document_tokens = [], 0
    for batch in batches:
        for ids, positions, labels in zip(batch["input_ids"], batch["position_ids"], batch["labels"], strict=True):
            starts = (positions == 0).nonzero().flatten().tolist()
            for start, end in zip(starts, starts[1:] + [spec.seq_len], strict=True):
                piece = ids[start:end].tolist()
                if piece[0] != tokenizer.bos_token_id:
                    assert all(token == tokenizer.pad_token_id for token in piece)  # padding: no loss
                    assert (labels[start:end] == IGNORE_INDEX).all()
                    continue
                assert piece[-1] == tokenizer.eos_token_id  # whole: it ends in its own row
                documents.append(tokenizer.decode(piece[1:-1]))
                document_tokens += len(piece)
    assert len(documents) == len(set(documents)) and set(documents) <= set(DOCUMENTS)
    # Rows fill up from the window (these documents run 18-39 tokens: one per row alone would fill about half).
    assert document_tokens > 0.75 * 20 * spec.seq_len


def test_best_fit_cuts_only_documents_longer_than_a_row():
    waiting = [(list(range(10)), list(range(10))), ([7] * 3, [0, 1, 2]), ([8] * 5, list(range(5)))]
    row = pack_row(waiting, 8, pad_token_id=0, packing="best_fit")
    assert row == (list(range(8)), list(range(8)))  # the oldest first, longer than the row: cut
    row = pack_row(waiting, 8, pad_token_id=0, packing="best_fit")
    assert row == ([8, 9, 8, 8, 8, 8, 8, 0], [8, 9, 0, 1, 2, 3, 4, 0], 7)  # its rest, then the best fit
    assert waiting == [([7] * 3, [0, 1, 2])]


@pytest.mark.parametrize("packing", PACKINGS)
def test_validation_rows_hold_every_validation_document_once(corpus_dir, tokenizer, packing):
    files = corpus_files(corpus_dir)
    spec = make_spec(tokenizer, packing=packing)
    rows = validation_rows(files, tokenizer, spec, max_rows=1000)
    validation = list(iter_split(files, "validation", spec.seed, spec.validation_fraction))
    tokens = [t for ids, _, length in rows for t in ids[:length]]
    assert tokens.count(tokenizer.bos_token_id) == len(validation)
    assert len(tokens) == sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 2 for text in validation)


def test_validation_rows_pad_the_last_row_and_hold_only_validation_text(corpus_dir, tokenizer):
    files = corpus_files(corpus_dir)
    spec = make_spec(tokenizer)
    rows = validation_rows(files, tokenizer, spec, max_rows=1000)
    validation = list(iter_split(files, "validation", spec.seed, spec.validation_fraction))
    tokens = [t for ids, _, length in rows for t in ids[:length]]
    assert tokens.count(tokenizer.bos_token_id) == len(validation)
    assert rows[-1][2] <= spec.seq_len
    assert all(length == spec.seq_len for _, _, length in rows[:-1])
    assert len(validation_rows(files, tokenizer, spec, max_rows=2)) == 2


def test_bad_corpora_give_clear_errors(tmp_path, tokenizer):
    with pytest.raises(CorpusError, match="not found"):
        corpus_files(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no .txt or .jsonl files"):
        corpus_files(tmp_path / "empty")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(CorpusError, match="not UTF-8"):
        list(iter_split([latin1], "train", 0, 0.0))
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text('{"body": "x"}\n')
    with pytest.raises(CorpusError, match="`text` field"):
        list(iter_split([no_text], "train", 0, 0.0))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    stream = PackedStream([blank], tokenizer, make_spec(tokenizer))
    with pytest.raises(CorpusError, match="no training documents"):
        stream.next_batch(1)
