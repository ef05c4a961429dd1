"""`pretrain export RUN_DIR --output DIR` on a real run that was restarted (steps logged twice) and tracked
its spend: manifest, metrics.csv, plots that open, and final.safetensors that reloads into the GPT."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app.cli import main as cli_main
from app.config import config_from_dict
from app.files import sha256_file
from app.tools.export import config_hash, effective_rows, load_final
from app.trainer.checkpoint import store as ckpt
from app.trainer.model.gpt import build_model
from tests.conftest import FAST, pretrain
from tests.prom_helpers import sets

STEPS = 30
TRAIN = [
    "--max-steps",
    str(STEPS),
    *FAST,
    *sets("train.eval_every=10", "checkpoint.every_steps=10", "optim.lr=3e-3", "schedule.warmup_steps=5"),
    # a tied head (tiny's is untied since #33): the export writes each tied tensor once
    *sets("model.tie_embeddings=true"),
    "--budget-cap-usd",
    "100",
    "--price-per-gpu-hour",
    "3.6",
    "--gpus",
    "1",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """A run killed after logging steps 21..30 but before their checkpoint, resumed from step 20 (which logs
    21..30 again), then exported."""
    base = tmp_path_factory.mktemp("export")
    run, out = base / "run", base / "out"
    pretrain("train", "--out", str(run), *TRAIN, check=True)
    shutil.rmtree(run / "checkpoints" / "step_000030")  # as if killed before the save at step 30
    second = pretrain("train", "--out", str(run), *TRAIN, check=True)
    assert "resumed from" in second.stdout
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):  # in-process: the CLI path without another torch import
        assert cli_main(["export", str(run), "--output", str(out)]) == 0
    assert f"step {STEPS}" in stdout.getvalue() and "final.safetensors" in stdout.getvalue()
    return run, out


def _log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_manifest(exported):
    run, out = exported
    m = json.loads((out / "manifest.json").read_text())
    info = ckpt.resolve_latest(run)
    assert m["seed"] == 1337
    assert m["torch"] == torch.__version__ and m["python"] and "cuda" in m
    assert m["config_hash"] == config_hash(info.meta["config"]) and m["config_hash"].startswith("sha256:")
    assert m["config"]["model"]["n_layer"] == 2
    env = m["cluster"]["environment"]
    assert env["hostname"] and env["cpu_count"] and env["gpus"] == [] and isinstance(env["env"], dict)
    assert m["cluster"]["training"]["world_size"] == 1
    ledger = json.loads((run / "budget" / "ledger.json").read_text())
    assert m["spend"]["from"] == "budget/ledger.json" and m["spend"]["sessions"] == 2
    assert m["spend"]["total_usd"] == pytest.approx(ledger["spent_usd"]) and m["spend"]["total_usd"] > 0
    assert m["spend"]["cap_usd"] == 100
    assert m["step"] == STEPS and m["tokens"] == STEPS * 8 * 64
    evals = {r["step"]: r["val_loss"] for r in _log(run) if r["kind"] == "eval"}
    assert m["val_loss"]["latest"] == evals[STEPS] and m["val_loss"]["latest_step"] == STEPS
    assert m["val_loss"]["best"] == min(evals.values())
    assert m["stop"]["cause"] == "planned"
    assert m["checkpoint"]["latest_step"] == STEPS
    for name, digest in m["sha256"].items():
        assert sha256_file(out / name) == digest
    assert set(m["files"]) == {p.name for p in out.iterdir()}


def test_metrics_csv_keeps_the_last_of_a_step_logged_twice(exported):
    run, out = exported
    with open(out / "metrics.csv", newline="") as f:
        reader = csv.reader(f)
        assert next(reader) == ["step", "name", "value"]
        rows = [(int(s), n, float(v)) for s, n, v in reader]
    keys = [(s, n) for s, n, _ in rows]
    assert len(keys) == len(set(keys)), "a (step, name) appears twice"
    values = {(s, n): v for s, n, v in rows}
    assert {s for s, n in keys if n == "loss"} == set(range(1, STEPS + 1))
    assert {s for s, n in keys if n == "val_loss"} == {0, 10, 20, 30}
    assert {s for s, n in keys if n == "checkpoint_seconds"} == {10, 20, 30}
    log = _log(run)
    restart = max(i for i, r in enumerate(log) if r.get("event") == "start")
    first = {r["step"]: r for r in log[:restart] if r["kind"] == "train"}
    second = {r["step"]: r for r in log[restart:] if r["kind"] == "train"}
    assert set(second) == set(range(21, STEPS + 1)) and set(first) == set(range(1, STEPS + 1))
    for step, row in second.items():  # timings differ between the attempts: the resumed one is kept
        assert values[(step, "step_seconds")] == row["step_seconds"]
        assert values[(step, "tokens_per_second")] == row["tokens_per_second"]
    assert values[(5, "loss")] == first[5]["loss"]


def test_plots_open(exported):
    import matplotlib.image

    _, out = exported
    for name in ("loss-curve.png", "gradnorm-curve.png", "throughput.png"):
        img = matplotlib.image.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400, name
        assert img.std() > 0.01, f"{name} is blank"


def test_final_safetensors_round_trips(exported):
    run, out = exported
    info = ckpt.resolve_latest(run)
    reference = ckpt.load_model_state(info)
    state, meta = load_final(out / "final.safetensors")
    assert int(meta["step"]) == STEPS and json.loads(meta["tied"]) == info.meta["tied"] != {}

    manifest = json.loads((out / "manifest.json").read_text())
    model = build_model(config_from_dict(manifest["config"]).model)
    model.load_state_dict(state, strict=True)
    assert model.head.weight is model.tok_emb.weight  # still tied after loading
    own = model.state_dict()
    assert set(own) == set(reference)
    for name, t in own.items():
        assert t.dtype == reference[name].dtype and torch.equal(t, reference[name]), name
    # The file holds the checkpoint's tensors byte for byte, consolidated (each tied tensor once).
    raw = load_file(str(out / "final.safetensors"))
    assert set(raw) == set(reference) - set(info.meta["tied"])
    for name in raw:
        assert raw[name].numpy().tobytes() == reference[name].numpy().tobytes(), name
    assert manifest["checkpoint"]["model_sha256"] == sha256_file(out / "final.safetensors")
    # the padded rows are kept and said so: a consumer slices [:vocab_size]
    m = model.cfg
    rows = {"vocab_size": m.vocab_size, "padded_vocab": m.padded_vocab}
    assert {k: manifest["weights"][k] for k in rows} == rows == {k: int(meta[k]) for k in rows}
    assert raw["tok_emb.weight"].shape[0] == m.padded_vocab


def test_tokenizer_is_copied(exported):
    run, out = exported
    info = ckpt.resolve_latest(run)
    assert (out / "tokenizer.json").read_bytes() == (info.path / "tokenizer.json").read_bytes()


def test_rows_of_an_abandoned_attempt_are_dropped():
    rows = [
        {"kind": "event", "step": 0, "event": "start"},
        *({"kind": "train", "step": s, "loss": 10.0 - s} for s in (1, 2, 3, 4, 5, 6)),
        {"kind": "checkpoint", "step": 4, "seconds": 0.1},
        {"kind": "event", "step": 4, "event": "start"},  # resumed from step 4: 5 and 6 are re-done
        {"kind": "train", "step": 5, "loss": 1.5},
    ]
    kept = effective_rows(rows)
    train = {r["step"]: r["loss"] for r in kept if r["kind"] == "train"}
    assert train == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0, 5: 1.5}  # 6 belonged to the abandoned attempt
    assert [r["step"] for r in kept] == sorted(r["step"] for r in kept)
    assert sum(r["kind"] == "event" for r in kept) == 2


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    def run(*args: str) -> str:
        assert cli_main(["export", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    assert "is not a directory" in run(str(tmp_path / "missing"), "--output", str(tmp_path / "o"))
    assert "no metrics.jsonl" in run(str(tmp_path), "--output", str(tmp_path / "o"))
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n')
    assert "no usable checkpoint" in run(str(tmp_path), "--output", str(tmp_path / "o"))
    step_dir = tmp_path / "checkpoints" / "step_000001"
    step_dir.mkdir(parents=True)
    (step_dir / "meta.json").write_text("{}")
    assert "pass its run dir" in run(str(step_dir), "--output", str(tmp_path / "o"))
    assert "--output" in run(str(tmp_path))  # argparse: the required flag, still one line
