"""Stop causes and their exit codes: stop file (graceful, immediate), planned ends by steps, tokens and
time, early stopping, and the cross-rank agreement under torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from app.trainer.checkpoint import list_checkpoints
from tests.conftest import FAST, REPO, cli_env, pretrain, spawn_train, train_rows, wait_for_step


def stop_and_wait(run, proc, body, step=3):
    wait_for_step(run, step, proc)
    (run / "stop.json").write_text(json.dumps(body))
    code = proc.wait(60)
    return code, proc.stdout.read()


def test_graceful_stop_file_checkpoints_exits_0_and_is_consumed(tmp_path):
    run = tmp_path / "run"
    proc = spawn_train("--out", str(run), *FAST, "--max-steps", "100000")
    code, out = stop_and_wait(
        run, proc, {"mode": "graceful", "cause": "budget", "reason": "projected over cap"}
    )
    assert code == 0
    assert "budget: projected over cap" in out
    last = train_rows(run)[-1]["step"]
    assert list_checkpoints(run)[0].name == f"step_{last:06d}"
    assert not (run / "stop.json").exists() and (run / "stop.json.handled").exists()
    stop = [r for r in train_rows(run, "event") if r["event"] == "stop"][-1]
    assert stop["cause"] == "budget" and stop["exit_code"] == 0
    again = pretrain("train", "--out", str(run), *FAST, "--max-steps", str(last + 2))
    assert again.returncode == 0 and train_rows(run)[-1]["step"] == last + 2  # the handled file stops nothing


def test_immediate_stop_file_exits_0_without_saving(tmp_path):
    run = tmp_path / "run"
    proc = spawn_train("--out", str(run), *FAST, "--max-steps", "100000")
    code, out = stop_and_wait(run, proc, {"mode": "immediate", "cause": "budget", "reason": "cap crossed"})
    assert code == 0 and "cap crossed" in out
    assert list_checkpoints(run) == []


def test_touching_a_stop_file_is_a_graceful_stop(tmp_path):
    run = tmp_path / "run"
    custom = tmp_path / "elsewhere" / "STOP"
    custom.parent.mkdir()
    proc = spawn_train("--out", str(run), *FAST, "--max-steps", "100000", "--stop-file", str(custom))
    wait_for_step(run, 2, proc)
    custom.touch()
    assert proc.wait(60) == 0
    assert list_checkpoints(run)


def test_planned_end_by_tokens(tmp_path):
    run = tmp_path / "run"
    proc = pretrain(
        "train", "--out", str(run), *FAST, "--max-steps", "1000", "--set", f"train.max_tokens={8 * 64 * 5}"
    )
    assert proc.returncode == 0 and "max_tokens" in proc.stdout
    assert train_rows(run)[-1]["step"] == 5


def test_planned_end_by_wall_clock(tmp_path):
    run = tmp_path / "run"
    proc = pretrain(
        "train", "--out", str(run), *FAST, "--max-steps", "1000000", "--set", "train.max_hours=0.0005"
    )
    assert proc.returncode == 0 and "max_hours" in proc.stdout
    assert list_checkpoints(run)


def test_early_stopping_on_val_loss(tmp_path):
    run = tmp_path / "run"
    proc = pretrain(
        "train",
        "--out",
        str(run),
        *FAST,
        "--max-steps",
        "1000",
        "--set",
        "train.eval_every=2",
        "--set",
        "train.eval_batches=1",
        "--set",
        "train.early_stop_patience=2",
        "--set",
        "train.early_stop_min_delta=100",
    )
    assert proc.returncode == 0 and "early stop" in proc.stdout
    assert train_rows(run)[-1]["step"] == 4  # evals at 2 and 4 do not improve on step 0 by 100
    assert list_checkpoints(run)[0].name == "step_000004"


def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    """Ranks agree through the all-reduce: a signal to rank 1 alone stops rank 0 at the same step, and
    both write their part of the checkpoint."""
    run = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "app.train",
        "--out",
        str(run),
        *FAST,
        "--max-steps",
        "100000",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_step(run, 3, proc)
        pids = [int(p) for p in subprocess.check_output(["pgrep", "-P", str(proc.pid)], text=True).split()]
        ranks = {}
        for pid in pids:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(e.split(b"=")[1] for e in env if e.startswith(b"RANK="))
            ranks[int(rank)] = pid
        os.kill(ranks[1], signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = proc.stdout.read()
    assert "agreed with another rank" in out  # rank 0 learned of the stop through the collective
    ckpt = list_checkpoints(run)[0]
    assert (ckpt / "rng_rank0.json").exists() and (ckpt / "rng_rank1.json").exists()
    assert ckpt.name == f"step_{train_rows(run)[-1]['step']:06d}"


def test_launcher_turns_sigterm_into_143_after_the_workers_checkpoint(tmp_path):
    """`python -m app.launch` (the container's PID 1) signals the workers, not torchrun, and exits 143
    so the PyTorchJob ExitCode policy restarts the job."""
    run = tmp_path / "launch"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.launch",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "app.train",
            "--out",
            str(run),
            *FAST,
            "--max-steps",
            "100000",
        ],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for_step(run, 3, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    ckpt = list_checkpoints(run)[0]
    assert ckpt.name == f"step_{train_rows(run)[-1]['step']:06d}"


def test_time_based_checkpoints_and_retention(tmp_path):
    """checkpoint.every_minutes saves while training (agreed across ranks like a stop), and retention
    keeps only the newest `keep_last`."""
    run = tmp_path / "run"
    proc = pretrain(
        "train",
        "--out",
        str(run),
        *FAST,
        "--max-steps",
        "150",
        "--set",
        "checkpoint.every_minutes=0.004",
        "--set",
        "checkpoint.keep_last=2",
        "--set",
        "checkpoint.keep_best=false",
    )
    assert proc.returncode == 0, proc.stderr
    saves = [r for r in train_rows(run, "checkpoint")]
    assert sum(r["reason"] == "every_minutes" for r in saves) >= 2, saves
    assert [p.name for p in list_checkpoints(run)] == ["step_000150", f"step_{saves[-2]['step']:06d}"]
