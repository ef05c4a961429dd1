"""Bad input to `pretrain prepare`: exit 2, one line on stderr, no traceback, nothing written is lost.

Every case runs the real CLI (`python -m app.cli prepare`, what the `pretrain` script runs) as its own
process, several at a time.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.config import PrepareConfig
from app.data.manifest import STATE, Manifest
from app.data.prepare import LOCK, prepare
from app.data.shards import read_header
from app.data.tokenizer import CharTokenizer, train_bpe
from tests.procs import Proc

ROOT = Path(__file__).resolve().parents[1]
PREPARE = [sys.executable, "-m", "app.cli", "prepare"]


def docs(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["sea", "salt", "wind", "grey", "rope", "sail", "deck", "gull"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) for _ in range(n)]


def parquet(path: Path, table: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(table), path, row_group_size=40)
    return path


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    """One input per kind of bad input, plus a tokenizer for runs that should not train one."""
    d = tmp_path_factory.mktemp("bad")
    p: dict[str, Path] = {}
    p["good"] = parquet(d / "good.parquet", {"text": docs(1, 200)})
    p["no_column"] = parquet(d / "nocol.parquet", {"id": [1, 2], "body": ["a", "b"], "url": ["x", "y"]})
    p["int_column"] = parquet(d / "intcol.parquet", {"text": [1, 2, 3]})
    p["empty_docs"] = parquet(d / "emptydocs.parquet", {"text": ["", None, ""]})
    p["no_rows"] = parquet(d / "norows.parquet", {"text": pa.array([], pa.string())})
    (d / "empty_dir").mkdir()
    p["empty_dir"] = d / "empty_dir"
    (d / "garbage.parquet").write_bytes(b"this is not parquet at all" * 100)
    p["garbage"] = d / "garbage.parquet"
    whole = p["good"].read_bytes()
    (d / "truncated.parquet").write_bytes(whole[: len(whole) // 2])
    p["truncated"] = d / "truncated.parquet"
    (d / "nofield.jsonl").write_text(json.dumps({"content": "x", "id": 1}) + "\n")
    p["no_field"] = d / "nofield.jsonl"
    (d / "badline.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    p["bad_json"] = d / "badline.jsonl"
    with gzip.open(d / "cut.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in docs(2, 3000)))
    gz = (d / "cut.jsonl.gz").read_bytes()
    (d / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    p["cut_gz"] = d / "cut.jsonl.gz"
    p["few_docs"] = parquet(d / "few.parquet", {"text": docs(3, 5)})
    (d / "readme.md.csv").write_text("x")
    p["unknown_ext"] = d / "readme.md.csv"
    (d / "a_file").write_text("I am a file")
    p["a_file"] = d / "a_file"
    tok = train_bpe(docs(4, 200), 300)
    (d / "tok").mkdir()
    tok.save(d / "tok")
    p["tok"] = d / "tok"
    (d / "bigtok").mkdir()
    CharTokenizer("".join(chr(0x10000 + i) for i in range(70000))).save(d / "bigtok")
    p["big_tok"] = d / "bigtok"
    return p


def cases(p: dict[str, Path], out: Path) -> list[tuple[str, list[str], str]]:
    """(name, arguments, text the one-line error must contain)."""
    tok = ["--tokenizer", str(p["tok"])]
    return [
        (
            "missing column",
            ["--input", str(p["no_column"]), *tok],
            "has no column 'text'; its columns are: id, body, url",
        ),
        ("not a text column", ["--input", str(p["int_column"]), *tok], "holds int64, not text"),
        (
            "missing jsonl field",
            ["--input", str(p["no_field"]), *tok],
            "has no field 'text'; its fields are: content, id",
        ),
        ("empty documents", ["--input", str(p["empty_docs"]), *tok], "no documents in"),
        ("no rows", ["--input", str(p["no_rows"]), *tok], "no documents in"),
        ("empty dir", ["--input", str(p["empty_dir"]), *tok], "no input files in"),
        ("missing input", ["--input", str(out.parent / "nope.parquet"), *tok], "does not exist"),
        ("unknown format", ["--input", str(p["unknown_ext"]), *tok], "cannot tell the format"),
        (
            "garbage parquet",
            ["--input", str(p["garbage"]), *tok],
            "garbage.parquet is not a readable parquet file",
        ),
        ("truncated parquet", ["--input", str(p["truncated"]), *tok], "truncated.parquet"),
        ("bad json line", ["--input", str(p["bad_json"]), *tok], "badline.jsonl line 2 is not valid JSON"),
        ("truncated gzip", ["--input", str(p["cut_gz"]), *tok, "--val-fraction", "0.2"], "cut.jsonl.gz"),
        (
            "too few documents",
            ["--input", str(p["few_docs"]), *tok],
            "validation split, which would be empty",
        ),
        (
            "vocab too big for uint16",
            ["--input", str(p["good"]), "--vocab-size", "70000", "--dtype", "uint16"],
            "does not fit --dtype uint16",
        ),
        (
            "loaded vocab too big",
            [
                "--input",
                str(p["good"]),
                "--tokenizer",
                str(p["big_tok"]),
                "--dtype",
                "uint16",
                "--val-fraction",
                "0.1",
            ],
            "vocabulary of 70002 tokens does not fit --dtype uint16",
        ),
        ("out is a file", ["--input", str(p["good"]), *tok, "--OUT", str(p["a_file"])], "not a directory"),
        (
            "out under a file",
            ["--input", str(p["good"]), *tok, "--OUT", str(p["a_file"] / "sub")],
            "a_file is a file, not a directory; pick another --out",
        ),
        (
            "bad val fraction",
            ["--input", str(p["good"]), *tok, "--val-fraction", "0.7"],
            "--val-fraction must be in",
        ),
        (
            "bad number",
            ["--input", str(p["good"]), *tok, "--shard-tokens", "lots"],
            "expected a whole number",
        ),
        ("infinite number", ["--input", str(p["good"]), *tok, "--shard-tokens", "inf"], "got 'inf'"),
        (
            "vocab with char",
            ["--input", str(p["good"]), "--tokenizer", "char", "--vocab-size", "300"],
            "--vocab-size applies only",
        ),
        (
            "missing tokenizer",
            ["--input", str(p["good"]), "--tokenizer", str(out.parent / "nope.json")],
            "no such file or directory",
        ),
        ("tiny vocab", ["--input", str(p["good"]), "--vocab-size", "100"], "too small for a byte-level BPE"),
    ]


def _argv(args: list[str], out: Path) -> list[str]:
    if "--OUT" in args:
        i = args.index("--OUT")
        return [*args[:i], "--out", args[i + 1], *args[i + 2 :]]
    return [*args, "--out", str(out)]


def _run_all(cmd: list[str], p: dict[str, Path], tmp: Path) -> None:
    todo = cases(p, tmp / "x")
    env = dict(os.environ)  # as the user's shell has it
    started = [
        Proc(
            [*cmd, *_argv(args, tmp / f"out{i}")],
            tmp / "logs" / f"{i}.log",
            env=env,
            cwd=ROOT,
            separate_stderr=True,
        )
        for i, (_, args, _) in enumerate(todo)
    ]
    for (name, _, needle), proc in zip(todo, started, strict=True):
        code = proc.wait(300)
        err = proc.errors
        assert code == 2, (name, err)
        assert "Traceback" not in err, (name, err)
        assert len(err.strip().splitlines()) == 1, (name, err)
        assert needle in err, (name, err)


def test_bad_inputs_exit_2_with_one_line(bad: dict[str, Path], tmp_path: Path) -> None:
    _run_all(PREPARE, bad, tmp_path)


def test_locked_output_dir(bad: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with open(out / LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        r = subprocess.run(
            [*PREPARE, "--input", str(bad["good"]), "--out", str(out), "--tokenizer", str(bad["tok"])],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2 and "another `pretrain prepare` is writing" in r.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only dirs")
def test_read_only_output_dir(bad: dict[str, Path], tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    r = subprocess.run(
        [*PREPARE, "--input", str(bad["good"]), "--out", str(ro / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "is not writable by uid" in r.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_corrupt_file_midway_keeps_finished_shards(
    bad: dict[str, Path], tmp_path: Path, workers: int
) -> None:
    """A corrupt second file stops the run with exit 2; the shards of the first file stay, and once the file
    is fixed a re-run finishes with exactly what an uninterrupted run writes."""
    inp = tmp_path / "in"
    parquet(inp / "a.parquet", {"text": docs(10, 400)})
    (inp / "b.parquet").write_bytes(b"PAR1" + b"\0" * 500)
    parquet(inp / "c.parquet", {"text": docs(12, 100)})
    out = tmp_path / "out"
    args = [
        *PREPARE,
        "--input",
        str(inp),
        "--out",
        str(out),
        "--tokenizer",
        str(bad["tok"]),
        "--shard-tokens",
        "1000",
        "--val-fraction",
        "0.05",
        "--workers",
        str(workers),
    ]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "b.parquet" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "manifest.json").exists()
    kept = sorted(out.glob("train_*.bin"))
    assert len(kept) >= 5  # every full shard of a.parquet was written, and each is complete
    for k in kept:
        read_header(k)
    assert not list(out.glob(".*.partial"))
    state = json.loads((out / STATE).read_text())
    assert [s["file"] for s in state["train"]] == [k.name for k in kept]
    mtimes = {k.name: k.stat().st_mtime_ns for k in kept}

    parquet(inp / "b.parquet", {"text": docs(11, 100)})
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout
    assert {k.name: k.stat().st_mtime_ns for k in kept} == mtimes  # not rewritten
    fresh = tmp_path / "fresh"
    prepare(
        PrepareConfig(
            [str(inp)],
            fresh,
            tokenizer=str(bad["tok"]),
            shard_tokens=1000,
            val_fraction=0.05,
            workers=1,
            progress="none",
        )
    )
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == {
        p.name: p.read_bytes() for p in fresh.glob("*.bin")
    }
    assert Manifest.load(out).train == Manifest.load(fresh).train


def test_error_line_is_exactly_one_line(bad: dict[str, Path], tmp_path: Path) -> None:
    r = subprocess.run(
        [
            *PREPARE,
            "--input",
            str(bad["no_column"]),
            "--out",
            str(tmp_path / "o"),
            "--tokenizer",
            str(bad["tok"]),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"error: {bad['no_column']} has no column 'text'; its columns are: id, body, url (choose one with --text-column)"
    ]


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("256MB", 256 * 10**6),
        ("256M", 256 * 10**6),
        ("256mb", 256 * 10**6),
        ("268435456", 268435456),
        ("10B", 10 * 10**9),
        ("10GB", 10 * 10**9),
        ("1.5k", 1500),
        ("50_000_000", 50 * 10**6),
    ],
)
def test_sizes_take_a_decimal_suffix_with_or_without_b(text: str, tokens: int) -> None:
    """One reading of a count for every command: `pretrain prepare --shard-tokens 10B` and `pretrain plan
    --prepare-tokens 10B` both mean 10^10 (B: billion; after another suffix, the unit byte)."""
    import argparse

    from app.data.cli import add_arguments
    from app.tools import plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--input", "x", "--out", "o", "--shard-tokens", text, "--tokenizer-sample-bytes", text]
    )
    assert args.shard_tokens == args.tokenizer_sample_bytes == tokens
    planner = argparse.ArgumentParser()
    plan.add_arguments(planner)
    assert planner.parse_args(["--prepare-tokens", text]).prepare_tokens == tokens


@pytest.mark.parametrize("text", ["inf", "nan", "1e400", "-5", "0.5", "1bb", ""])
def test_a_count_that_is_not_a_whole_number_is_refused_in_one_line(text: str) -> None:
    from app.command import Parser
    from app.data.cli import add_arguments
    from app.errors import UserError
    from app.tools import plan

    prepare_parser, plan_parser = Parser(prog="pretrain prepare"), Parser(prog="pretrain plan")
    add_arguments(prepare_parser)
    plan.add_arguments(plan_parser)
    for parser, argv in (
        (prepare_parser, ["--input", "x", "--out", "o", "--shard-tokens", text]),
        (plan_parser, ["--prepare-tokens", text]),
    ):
        with pytest.raises(UserError, match="expected a whole number up to 10\\^18") as refused:
            parser.parse_args(argv)
        assert f"got {text!r}" in str(refused.value) and "\n" not in str(refused.value)
