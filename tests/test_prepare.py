"""`pretrain prepare` end to end on real files: exact token streams, shard boundaries, validation split,
manifest, determinism across worker counts, every input format, idempotent and repairing re-runs."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.config import PrepareConfig
from app.data.corpus import documents as embedded_documents
from app.data.corpus import embedded_dataset
from app.data.manifest import STATE, Manifest, is_val_document
from app.data.prepare import prepare
from app.data.shards import HEADER_BYTES, open_shard, read_header
from app.data.tokenizer import load_tokenizer, train_bpe
from app.errors import UserError

WORDS = [
    "the",
    "of",
    "river",
    "stone",
    "light",
    "north",
    "quiet",
    "over",
    "under",
    "bright",
    "é",
    "雪",
    "ünïcode",
]


def make_docs(seed: int, n: int, lo: int = 1, hi: int = 120) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi)))) for _ in range(n)]


def write_parquet(path: Path, docs: list, column: str = "text", row_group_size: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), column: docs, "url": [f"u{i}" for i in range(len(docs))]})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Three parquet files (with an empty and a null document), and a tokenizer trained on other text."""
    root = tmp_path_factory.mktemp("corpus")
    a, b, c = make_docs(1, 300), make_docs(2, 200), make_docs(3, 150)
    a[5], b[7] = "", None  # skipped: not documents
    files = [write_parquet(root / "in" / f"part-{i}.parquet", d) for i, d in enumerate((a, b, c))]
    tok = train_bpe(make_docs(9, 300), 400)
    tok_dir = root / "tok"
    tok_dir.mkdir()
    tok.save(tok_dir)
    docs = [d for d in a + b + c if d]
    return {"root": root, "files": files, "docs": docs, "tok_dir": tok_dir, "tok": tok}


def cfg(inputs, out, **kw) -> PrepareConfig:
    kw.setdefault("progress", "none")
    kw.setdefault("workers", 1)
    return PrepareConfig([str(i) for i in inputs], Path(out), **kw)


def expected_streams(docs: list[str], tok, val_fraction: float) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"train": [], "val": []}
    for i, d in enumerate(docs):
        out["val" if is_val_document(i, val_fraction) else "train"] += [*tok.encode(d), tok.eot_id]
    return out


def stream(out: Path, split: str) -> np.ndarray:
    m = Manifest.load(out)
    return np.concatenate([np.asarray(open_shard(out / s.file)) for s in m.split(split)])


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


def test_parquet_exact_streams_boundaries_and_manifest(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    S, f = 3000, 0.05
    res = prepare(
        cfg([corpus["root"] / "in"], out, tokenizer=str(corpus["tok_dir"]), shard_tokens=S, val_fraction=f)
    )
    m = Manifest.load(out)
    tok = load_tokenizer(out)
    assert tok.sha256() == corpus["tok"].sha256() == m.tokenizer["sha256"]
    exp = expected_streams(corpus["docs"], tok, f)
    for split in ("train", "val"):
        shards = m.split(split)
        assert stream(out, split).tolist() == exp[split]  # token counts and ids equal direct encoding
        # Fixed-size shards: every shard but the last has exactly S tokens, each file matches its entry.
        assert [s.tokens for s in shards[:-1]] == [S] * (len(shards) - 1) and 0 < shards[-1].tokens <= S
        assert shards == sorted(shards, key=lambda s: s.file)
        for i, s in enumerate(shards):
            assert s.file == f"{split}_{i:06d}.bin"
            assert read_header(out / s.file)[1] == s.tokens
            ids = np.asarray(open_shard(out / s.file))
            assert s.documents == int((ids == tok.eot_id).sum())  # documents that end in the shard
        for prev, nxt in zip(shards, shards[1:], strict=False):
            assert prev.end == nxt.start
    val_docs = [d for i, d in enumerate(corpus["docs"]) if is_val_document(i, f)]
    train_docs = [d for i, d in enumerate(corpus["docs"]) if not is_val_document(i, f)]
    assert sum(s.documents for s in m.val) == len(val_docs) == len(corpus["docs"]) // 20
    assert sum(s.documents for s in m.train) == len(train_docs)
    assert sum(s.bytes for s in m.train) == sum(len(d.encode()) for d in train_docs)
    assert m.documents == len(corpus["docs"])
    assert m.dtype == "uint16" and m.shard_tokens == S and m.vocab_size == tok.vocab_size
    assert m.sources == [str(p) for p in corpus["files"]]
    assert res.new_tokens == len(exp["train"]) + len(exp["val"])
    assert not list(out.glob(".*partial"))


def test_worker_count_does_not_change_a_byte(corpus: dict, tmp_path: Path) -> None:
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare(
            cfg(
                [corpus["root"] / "in"],
                out,
                tokenizer=str(corpus["tok_dir"]),
                shard_tokens=2000,
                val_fraction=0.1,
                workers=workers,
            )
        )
        outs.append(out)
    assert shard_bytes(outs[0]) == shard_bytes(outs[1])
    assert (outs[0] / "manifest.json").read_text() == (outs[1] / "manifest.json").read_text()


def test_trained_bpe_uses_only_training_documents_and_is_saved(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    logs: list[str] = []
    prepare(
        cfg([corpus["files"][0]], out, vocab_size=300, shard_tokens=10**6, val_fraction=0.1), log=logs.append
    )
    tok = load_tokenizer(out)
    assert tok.kind == "bpe" and tok.vocab_size <= 300
    m = Manifest.load(out)
    assert m.tokenizer == {
        "kind": "bpe",
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "sha256": tok.sha256(),
    }
    docs = [d for d in json.loads(json.dumps(pq.read_table(corpus["files"][0])["text"].to_pylist())) if d]
    assert stream(out, "train").tolist() == expected_streams(docs, tok, 0.1)["train"]
    assert any("trained the tokenizer" in line for line in logs)
    assert any("bytes/token" in line for line in logs)  # the summary


def test_uint32_when_asked_and_char_tokenizer(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare(
        cfg([corpus["files"][1]], out, tokenizer="char", dtype="uint32", shard_tokens=5000, val_fraction=0.1)
    )
    m = Manifest.load(out)
    tok = load_tokenizer(out)
    assert m.dtype == "uint32" and read_header(out / m.train[0].file)[0] == np.uint32
    assert tok.kind == "char" and set(tok.chars) == set(
        "".join(d for d in pq.read_table(corpus["files"][1])["text"].to_pylist() if d)
    )
    docs = [d for d in pq.read_table(corpus["files"][1])["text"].to_pylist() if d]
    assert stream(out, "val").tolist() == expected_streams(docs, tok, 0.1)["val"]


def _zst(path: Path, data: bytes) -> None:
    with pa.CompressedOutputStream(str(path), "zstd") as f:
        f.write(data)


def test_jsonl_gz_zst_and_txt_inputs(tmp_path: Path, corpus: dict) -> None:
    docs = make_docs(5, 120)
    lines = "".join(json.dumps({"text": d, "meta": {"i": i}}) + "\n" for i, d in enumerate(docs[:40]))
    inp = tmp_path / "in"
    (inp / "sub").mkdir(parents=True)
    (inp / "a.jsonl").write_text(lines)
    with gzip.open(inp / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[40:80]))
    _zst(inp / "sub" / "c.jsonl.zst", "".join(json.dumps({"text": d}) + "\n" for d in docs[80:]).encode())
    (inp / "notes.csv").write_text("ignored")
    (inp / ".hidden.jsonl").write_text("not json")
    out = tmp_path / "out"
    prepare(cfg([inp], out, tokenizer=str(corpus["tok_dir"]), shard_tokens=1500, val_fraction=0.1))
    m = Manifest.load(out)
    assert [Path(s).name for s in m.sources] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    exp = expected_streams(docs, corpus["tok"], 0.1)
    assert stream(out, "train").tolist() == exp["train"] and stream(out, "val").tolist() == exp["val"]

    # txt: one document per file, per line, or paragraph runs.
    txt = tmp_path / "txt"
    txt.mkdir()
    (txt / "one.txt").write_text("first line\nsecond line\n\nnew paragraph here\n")
    with gzip.open(txt / "two.txt.gz", "wt") as f:
        f.write("third\r\n\r\nfourth line\r\n")
    got = {}
    for split_mode in ("file", "line", "paragraph"):
        o = tmp_path / f"txt-{split_mode}"
        prepare(
            cfg(
                [txt],
                o,
                tokenizer="char",
                char_alphabet="abcdefghijklmnopqrstuvwxyz \n",
                txt_split=split_mode,
                doc_chars=5,
                val_fraction=0.4,
                shard_tokens=10**6,
            )
        )
        got[split_mode] = Manifest.load(o).documents
    assert got == {"file": 2, "line": 5, "paragraph": 4}


def test_rerun_is_a_verified_no_op(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    c = cfg(
        [corpus["root"] / "in"], out, tokenizer=str(corpus["tok_dir"]), shard_tokens=3000, val_fraction=0.05
    )
    prepare(c)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    manifest = (out / "manifest.json").read_text()
    logs: list[str] = []
    res = prepare(c, log=logs.append)
    assert res.up_to_date and res.new_tokens == 0
    assert any("up to date" in line for line in logs)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")} == before
    assert (out / "manifest.json").read_text() == manifest


def test_damaged_or_missing_shards_are_remade_identically(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    c = cfg(
        [corpus["root"] / "in"], out, tokenizer=str(corpus["tok_dir"]), shard_tokens=2500, val_fraction=0.05
    )
    prepare(c)
    good = shard_bytes(out)
    m = Manifest.load(out)
    assert len(m.train) >= 6
    flip = out / m.train[3].file  # same size, one token changed: only the sha256 notices
    data = bytearray(flip.read_bytes())
    data[HEADER_BYTES + 10] ^= 1
    flip.write_bytes(bytes(data))
    (out / m.val[0].file).unlink()
    with open(out / m.train[5].file, "r+b") as f:
        f.truncate(HEADER_BYTES + 7)
    logs: list[str] = []
    res = prepare(c, log=logs.append)
    assert not res.up_to_date
    assert shard_bytes(out) == good
    assert res.new_tokens < sum(s.tokens for s in m.train + m.val)  # shards 0-2 were kept, not redone
    assert sum("re-making" in line for line in logs) == 2  # train_000003 and val_000000


def test_appending_input_extends_like_a_fresh_run(corpus: dict, tmp_path: Path) -> None:
    inp = tmp_path / "in"
    for p in corpus["files"][:2]:
        (inp / p.name).parent.mkdir(parents=True, exist_ok=True)
        (inp / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    c = cfg([inp], out, tokenizer=str(corpus["tok_dir"]), shard_tokens=2000, val_fraction=0.05)
    prepare(c)
    (inp / corpus["files"][2].name).write_bytes(corpus["files"][2].read_bytes())
    res = prepare(c)
    fresh = tmp_path / "fresh"
    prepare(
        cfg(
            [corpus["root"] / "in"],
            fresh,
            tokenizer=str(corpus["tok_dir"]),
            shard_tokens=2000,
            val_fraction=0.05,
        )
    )
    assert shard_bytes(out) == shard_bytes(fresh)
    assert res.new_tokens < sum(s.tokens for s in Manifest.load(fresh).train)


def test_changed_input_file_remakes_only_what_depends_on_it(corpus: dict, tmp_path: Path) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    for p in corpus["files"]:
        (inp / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    c = cfg([inp], out, tokenizer=str(corpus["tok_dir"]), shard_tokens=2000, val_fraction=0.05)
    prepare(c)
    new_docs = make_docs(77, 100)
    write_parquet(inp / corpus["files"][2].name, new_docs)
    prepare(c)
    m = Manifest.load(out)
    docs = corpus["docs"][:-150] + new_docs  # part-2 had 150 rows, all non-empty
    assert len(corpus["docs"]) - 150 == sum(
        1 for p in corpus["files"][:2] for d in pq.read_table(p)["text"].to_pylist() if d
    )
    exp = expected_streams(docs, corpus["tok"], 0.05)
    assert stream(out, "train").tolist() == exp["train"] and stream(out, "val").tolist() == exp["val"]
    assert m.documents == len(docs)


def test_other_settings_are_refused_and_nothing_is_lost(corpus: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare(
        cfg([corpus["files"][0]], out, tokenizer=str(corpus["tok_dir"]), shard_tokens=2000, val_fraction=0.05)
    )
    before = shard_bytes(out)
    with pytest.raises(UserError, match="other settings.*shard_tokens"):
        prepare(
            cfg(
                [corpus["files"][0]],
                out,
                tokenizer=str(corpus["tok_dir"]),
                shard_tokens=999,
                val_fraction=0.05,
            )
        )
    assert shard_bytes(out) == before and (out / "manifest.json").exists() and (out / STATE).exists()


def test_loader_reads_prepared_dir(corpus: dict, tmp_path: Path) -> None:
    from app.data.loader import TokenWindows

    out = tmp_path / "out"
    prepare(
        cfg(
            [corpus["root"] / "in"],
            out,
            tokenizer=str(corpus["tok_dir"]),
            shard_tokens=2000,
            val_fraction=0.05,
        )
    )
    w = TokenWindows(out, "train", 64)
    exp = expected_streams(corpus["docs"], corpus["tok"], 0.05)["train"]
    assert w.window(0).tolist() == exp[:65]
    m = Manifest.load(out)
    assert m.bytes_per_token("train") == pytest.approx(
        sum(s.bytes for s in m.train) / sum(s.tokens for s in m.train)
    )


def check_embedded(out: Path, kind: str) -> None:
    m = Manifest.load(out)
    docs = list(embedded_documents())
    assert m.documents == len(docs) > 1000
    assert (out / STATE).exists() and m.settings["txt_split"] == "paragraph"
    tok = load_tokenizer(out)
    assert tok.kind == kind and m.tokenizer["sha256"] == tok.sha256()
    assert kind == "char" or tok.vocab_size == 2048
    val = [d for i, d in enumerate(docs) if is_val_document(i, 0.02)]
    assert stream(out, "val").tolist() == [t for d in val for t in (*tok.encode(d), tok.eot_id)]
    head = [
        t
        for i, d in enumerate(docs[:40])
        if not is_val_document(i, 0.02)
        for t in (*tok.encode(d), tok.eot_id)
    ]
    assert stream(out, "train")[: len(head)].tolist() == head
    assert sum(s.documents for s in m.train + m.val) == len(docs)


def test_embedded_corpus_goes_through_the_pipeline(embedded_data: Path) -> None:
    """The session's embedded corpus (tests/conftest.py builds it with the trainer's defaults)."""
    check_embedded(embedded_data, "bpe")
    assert (
        embedded_dataset(cache_dir=str(embedded_data.parent), log=lambda s: None) == embedded_data
    )  # cached


def test_embedded_char_corpus(tmp_path: Path) -> None:
    out = embedded_dataset("char", val_fraction=0.02, cache_dir=str(tmp_path), log=lambda s: None)
    check_embedded(out, "char")


def test_progress_log_lines(corpus: dict, tmp_path: Path) -> None:
    logs: list[str] = []
    prepare(
        cfg(
            [corpus["root"] / "in"],
            tmp_path / "o",
            tokenizer=str(corpus["tok_dir"]),
            progress="log",
            log_every=0.0,
            val_fraction=0.05,
        ),
        log=logs.append,
    )
    lines = [x for x in logs if x.startswith("prepare: ")]
    assert lines and all("docs/s" in x and "tok/s" in x and "ETA" in x for x in lines)
    assert os.environ.get("TOKENIZERS_PARALLELISM") != "false"  # the inline encoder restores it
