"""End-to-end training on the embedded corpus: loss falls, samples, checkpoints, torchrun with gloo."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import FAST, pretrain, torchrun, train_rows


def test_loss_falls_and_sample_reads_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = pretrain(
        "train",
        "--out",
        str(run),
        "--max-steps",
        "80",
        *FAST,
        "--set",
        "train.eval_every=40",
        "--set",
        "optim.lr=3e-3",
        "--set",
        "schedule.warmup_steps=10",
    )
    assert proc.returncode == 0, proc.stderr
    evals = train_rows(run, "eval")
    assert [e["step"] for e in evals] == [0, 40, 80]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.5  # from ~7.6 (uniform over 2048)
    assert evals[-1]["val_bpb"] > 0
    assert "parameters" in proc.stdout and "non-embedding" in proc.stdout
    assert "latest checkpoint:" in proc.stdout and "best checkpoint:" in proc.stdout
    ckpt = run / "checkpoints" / "step_000080"
    assert (ckpt / "model-rank00000.safetensors").exists() and json.loads((ckpt / "meta.json").read_text())[
        "step"
    ] == 80

    out = pretrain("sample", "--checkpoint", str(run), "--prompt", "KING", "--max-new-tokens", "30")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("KING") and len(out.stdout) > 40


def test_torchrun_two_gloo_ranks_finish_and_agree(tmp_path):
    run = tmp_path / "ddp"
    proc = torchrun("--out", str(run), "--max-steps", "12", *FAST, "--set", "train.eval_every=6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size 2" in proc.stdout
    assert [r["step"] for r in train_rows(run)] == list(range(1, 13))
    assert (run / "checkpoints" / "step_000012" / "rng_rank1.json").exists()  # every rank's RNG saved
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == 12


def test_gradient_accumulation_reaches_the_token_batch(tmp_path):
    run = tmp_path / "accum"
    proc = pretrain(
        "train", "--out", str(run), "--max-steps", "3", *FAST, "--set", f"train.batch_tokens={8 * 64 * 3}"
    )
    assert proc.returncode == 0, proc.stderr
    assert "3 accum" in proc.stdout
    assert train_rows(run)[-1]["tokens"] == 3 * 8 * 64 * 3


def test_sample_on_missing_run_is_one_line(tmp_path):
    proc = pretrain("sample", "--checkpoint", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_looped_model_trains_with_deep_supervision(tmp_path):
    run = tmp_path / "looped"
    proc = pretrain(
        "train",
        "--out",
        str(run),
        "--max-steps",
        "4",
        *FAST,
        "--set",
        "model.loop.prelude=1",
        "--set",
        "model.loop.recurrent=1",
        "--set",
        "model.loop.coda=1",
        "--set",
        "model.loop.recurrence=3",
        "--set",
        "model.loop.deep_supervision=true",
    )
    assert proc.returncode == 0, proc.stderr
    row = train_rows(run)[-1]
    assert len(row["loop_losses"]) == 3
    first, last = row["loop_losses"][0], row["loop_losses"][-1]
    assert abs(row["refinement"] - (first - last) / first) < 1e-9
    assert Path(run / "checkpoints" / "step_000004").is_dir()
