"""Tokenizers: the shard encoding equals direct encoding plus a boundary token, the boundary token only
ever marks a document end, tokenizer files round-trip, and parallel encoding keeps input order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from app.data.tokenizer import (
    EOT,
    CharTokenizer,
    ParallelEncoder,
    load_tokenizer,
    tokenizer_from_json,
    train_bpe,
    train_char,
)
from app.errors import UserError

TEXTS = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "naïve café — 雪が降る 🙂",
    "a",
    "  leading spaces and\ttabs\n\nand blank lines  ",
] * 20


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, 300)


def test_bpe_encode_docs_is_encode_plus_boundary(bpe) -> None:
    enc = bpe.encode_docs(TEXTS, np.dtype(np.uint16))
    expected = [t for text in TEXTS for t in (*bpe.encode(text), bpe.eot_id)]
    assert enc.tokens.dtype == np.uint16 and enc.tokens.tolist() == expected
    assert enc.lengths.tolist() == [len(bpe.encode(t)) + 1 for t in TEXTS]
    assert enc.nbytes.tolist() == [len(t.encode()) for t in TEXTS]
    assert bpe.decode(bpe.encode(TEXTS[2])) == TEXTS[2]  # byte-level: lossless on any text


def test_literal_boundary_text_inside_a_document_is_plain_text(bpe) -> None:
    doc = f"before {EOT} after"
    enc = bpe.encode_docs([doc], np.dtype(np.uint32))
    ids = enc.tokens.tolist()
    assert ids.count(bpe.eot_id) == 1 and ids[-1] == bpe.eot_id  # only the real document end
    assert bpe.decode(ids[:-1]) == doc


def test_bpe_vocab_and_boundary_token(bpe) -> None:
    assert bpe.kind == "bpe" and bpe.vocab_size <= 300 and bpe.tok.token_to_id(EOT) == bpe.eot_id
    with pytest.raises(UserError, match="too small"):
        train_bpe(TEXTS, 100)


def test_save_load_round_trip(tmp_path: Path, bpe) -> None:
    bpe.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.sha256() == bpe.sha256() and loaded.encode(TEXTS[0]) == bpe.encode(TEXTS[0])
    assert loaded.describe() == {
        "kind": "bpe",
        "vocab_size": bpe.vocab_size,
        "eot_id": bpe.eot_id,
        "sha256": bpe.sha256(),
    }
    assert not list(tmp_path.glob(".*tmp"))


def test_foreign_tokenizer_gets_a_boundary_token() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        TEXTS, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"], show_progress=False)
    )
    n = tok.get_vocab_size()
    loaded = tokenizer_from_json(tok.to_str())
    assert loaded.vocab_size == n + 1 and loaded.eot_id == n
    assert loaded.encode_docs(["to be"], np.dtype(np.uint16)).tokens.tolist()[-1] == n


def test_bad_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": "nope"}))
    with pytest.raises(UserError, match="not a valid HF tokenizers file"):
        load_tokenizer(tmp_path)
    with pytest.raises(UserError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing")


def test_char_tokenizer() -> None:
    tok = train_char(TEXTS)
    assert tok.kind == "char" and tok.eot_id == 0 and tok.vocab_size == len(set("".join(TEXTS))) + 2
    enc = tok.encode_docs(TEXTS[:5], np.dtype(np.uint16))
    naive = [t for text in TEXTS[:5] for t in ([tok.stoi[c] for c in text] + [0])]
    assert enc.tokens.tolist() == naive
    assert tok.decode(tok.encode(TEXTS[2])) == TEXTS[2]
    fixed = CharTokenizer("abc ")
    assert (
        fixed.encode("abz c") == [3, 4, 1, 2, 5] and fixed.vocab_size == 6
    )  # sorted " abc"; z: unknown id 1
    assert fixed.encode("😀") == [1]
    assert tokenizer_from_json(fixed.to_json()).encode("cab") == fixed.encode("cab")
    assert train_char(["ignored"], alphabet="xy").chars == "xy"
    empty = CharTokenizer("")
    assert empty.encode_docs(["ab"], np.dtype(np.uint16)).tokens.tolist() == [1, 1, 0]


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_parallel_encoder_keeps_order(bpe, kind: str) -> None:
    tok = bpe if kind == "bpe" else train_char(TEXTS)
    batches = [(i, TEXTS[i : i + 7]) for i in range(0, len(TEXTS), 7)]
    with (
        ParallelEncoder(tok, 1, np.dtype(np.uint16)) as one,
        ParallelEncoder(tok, 2, np.dtype(np.uint16)) as two,
    ):
        a = list(one.map(batches))
        b = list(two.map(batches))
    assert [m for m, _ in a] == [m for m, _ in b] == [i for i, _ in batches]
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist() and x.lengths.tolist() == y.lengths.tolist()


def test_parallel_encoder_returns_finished_work_before_a_read_error(bpe) -> None:
    def batches():
        yield 0, TEXTS[:5]
        yield 1, TEXTS[5:10]
        raise UserError("file 3 is corrupt")

    got = []
    with ParallelEncoder(bpe, 2, np.dtype(np.uint16)) as enc, pytest.raises(UserError, match="corrupt"):
        for meta, _ in enc.map(batches()):
            got.append(meta)
    assert got == [0, 1]
