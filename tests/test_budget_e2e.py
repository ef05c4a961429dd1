"""End to end with the real trainer: a tiny cap ($0.01 at $3.60/h = 10 s of training) stops the run gracefully
with exit 0 and a checkpoint, and a restart exits 0 at once. Both hosts: the in-process thread, and the
`pretrain watch` sidecar with the trainer on budget.in_process=false (the Kubernetes layout)."""

from __future__ import annotations

import json
import time

import pytest

from app.budget.ledger import load_ledger
from app.budget.view import ledger_path_for
from tests.conftest import FAST, pretrain

CAP = ["--budget-cap-usd", "0.01", "--price-per-gpu-hour", "3.6", "--gpus", "1"]
FAST_BUDGET = [
    "--set",
    "budget.poll_seconds=0.5",
    "--set",
    "budget.margin_seconds=1",
    "--set",
    "train.log_every=20",
]


def checkpoints(run) -> list:
    return sorted(p for p in (run / "checkpoints").glob("step_*") if (p / "meta.json").exists())


@pytest.mark.slow
def test_tiny_cap_stops_gracefully_and_a_restart_exits_at_once(tmp_path):
    run = tmp_path / "run"
    args = ["train", *CAP, "--out", str(run), "--max-steps", "1000000", *FAST, *FAST_BUDGET]
    t0 = time.monotonic()
    p = pretrain(*args, timeout=180)
    elapsed = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "budget graceful stop" in p.stdout + p.stderr
    ckpts = checkpoints(run)
    assert ckpts, "the graceful stop must leave a checkpoint"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "done" and status["last_checkpoint_step"] == int(ckpts[-1].name.split("_")[1])
    led = load_ledger(ledger_path_for(run))
    assert led.stop.mode == "graceful" and not led.open_session
    assert 0.005 < led.spent_usd <= 0.01, led.spent_usd
    sessions = len(led.sessions)

    t0 = time.monotonic()
    p = pretrain(*args, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout + p.stderr
    assert "budget stop already reached" in out and "raise --budget-cap-usd" in out
    assert checkpoints(run) == ckpts  # no training, no new checkpoint
    led2 = load_ledger(ledger_path_for(run))
    assert led2.spent_usd == led.spent_usd and len(led2.sessions) == sessions
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_sidecar_stops_an_out_of_process_trainer(tmp_path, procs):
    run, stop = tmp_path / "run", tmp_path / "stopdir" / "stop.json"
    stop.parent.mkdir()
    watcher = procs.pretrain(
        *("watch", "--budget-cap-usd", "0.02", "--price-per-gpu-hour", "3.6", "--gpus", "1"),
        *("--run-dir", str(run), "--stop-file", str(stop), "--poll-seconds", "0.5", "--margin-seconds", "1"),
        *("--metrics-port", "0", "--kube", "off"),
    )
    p = pretrain(
        "train",
        "--out",
        str(run),
        "--stop-file",
        str(stop),
        "--max-steps",
        "1000000",
        *FAST,
        *FAST_BUDGET,
        "--budget-cap-usd",
        "0.02",
        "--set",
        "budget.in_process=false",
        timeout=180,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert watcher.wait(30) == 0, watcher.output  # exits once status.json says done
    out = watcher.output
    assert "budget graceful stop" in out and "the trainer is done" in out
    assert checkpoints(run)
    led = load_ledger(ledger_path_for(run))
    assert led.stop.mode == "graceful" and led.sessions[-1].host == "sidecar" and led.spent_usd <= 0.02
    p = pretrain(
        "train", "--out", str(run), *FAST, "--budget-cap-usd", "0.02", "--set", "budget.in_process=false"
    )
    assert p.returncode == 0 and "budget stop already reached" in p.stdout + p.stderr
