"""Stop causes and their exit codes: stop file (graceful, immediate), planned ends by steps, tokens and
time, early stopping, and the cross-rank agreement under torchrun."""

from __future__ import annotations

import json
import os
import signal

import pytest

from app.trainer.checkpoint.store import list_checkpoints
from tests.conftest import FAST, cli_env, pretrain, spawn_train, torchrun, train_rows
from tests.procs import children


def stop_and_wait(run, proc, body, step=3):
    proc.wait_for_step(run, step)
    (run / "stop.json").write_text(json.dumps(body))
    code = proc.wait(60)
    return code, proc.output


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
    proc.wait_for_step(run, 2)
    custom.touch()
    assert proc.wait(60) == 0
    assert list_checkpoints(run)


@pytest.mark.parametrize("where", ["missing-dir", "file-in-the-way"])
def test_a_stop_file_that_can_never_arrive_is_refused_at_start(tmp_path, where, capsys):
    """--stop-file in a directory that does not exist (or under a file) could never be written by the
    watcher, so its stop would never come: exit 2 at once, one line, before any work."""
    from app.train import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    stop = tmp_path / "nonexistent" / "dir" / "stop.json" if where == "missing-dir" else blocker / "stop.json"
    run = tmp_path / "run"
    assert main(["--out", str(run), *FAST, "--max-steps", "1", "--stop-file", str(stop)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--stop-file {stop}: {stop.parent}" in err[0], err
    assert not run.exists()  # refused before the run dir was made


def test_a_sigterm_after_an_evaluation_names_that_val_loss_with_the_checkpoint(tmp_path, procs):
    """SIGTERM at step 7 of a run evaluated every 4 steps: the stop's checkpoint (step 7) was not evaluated,
    so no checkpoint ranks as best; the summary says so and names the evaluation of step 4 and its val loss,
    which the checkpoint's trainer state records as its last evaluation."""
    from app.trainer.checkpoint.store import load_trainer_state, resolve_latest

    run = tmp_path / "run"
    env = cli_env(
        PRETRAIN_TEST_PAUSE="app.trainer.optimization.optimizer:step_unless:7",
        PRETRAIN_TEST_PAUSE_DIR=str(tmp_path),
    )
    every = [
        "--set",
        "train.eval_every=4",
        "--set",
        "train.eval_batches=1",
        "--set",
        "train.stop_check_every=1",
    ]
    cmd = ["-m", "tests.pause_at", "app.cli", "train", "--out", str(run), *FAST, *every, "--max-steps", "100"]
    proc = procs.python(*cmd, env=env)
    proc.wait_paused(tmp_path)  # in step 7's update, after step 4's eval
    proc.signal(signal.SIGTERM)
    proc.signal(signal.SIGCONT)
    code, out = proc.wait(120), proc.output
    assert code == 128 + signal.SIGTERM, out
    val = [r for r in train_rows(run, "eval") if r["step"] == 4][0]["val_loss"]
    assert "latest checkpoint: " in out and "(step 7)" in out, out
    (best,) = [ln for ln in out.splitlines() if "best checkpoint:" in ln]
    assert f"the last evaluation, at step 4, gave val loss {val:.4f}" in best, best
    state = load_trainer_state(resolve_latest(run))
    assert state["last_eval_step"] == 4 and state["last_val_loss"] == val


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


def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path, procs):
    """Ranks agree through the all-reduce: a signal to rank 1 alone stops rank 0 at the same step, and
    both write their part of the checkpoint."""
    run = tmp_path / "ddp"
    proc = procs.torchrun("--out", str(run), *FAST, "--max-steps", "100000")
    proc.wait_for_step(run, 3)
    # rank 0 writes the heartbeat the budget watcher reads, with its PID: the launcher's other child is rank 1
    rank0 = json.loads((run / "status.json").read_text())["pid"]
    (rank1,) = set(children(proc.pid)) - {rank0}
    os.kill(rank1, signal.SIGTERM)
    proc.wait(60)
    out = proc.output
    assert "agreed with another rank" in out  # rank 0 learned of the stop through the collective
    ckpt = list_checkpoints(run)[0]
    assert (ckpt / "rng_rank0.json").exists() and (ckpt / "rng_rank1.json").exists()
    assert ckpt.name == f"step_{train_rows(run)[-1]['step']:06d}"


def test_launcher_turns_sigterm_into_143_after_the_workers_checkpoint(tmp_path, procs):
    """`python -m app.launch` (the container's PID 1) signals the workers, not torchrun, and exits 143
    so the PyTorchJob ExitCode policy restarts the job."""
    run = tmp_path / "launch"
    proc = procs.torchrun("--out", str(run), *FAST, "--max-steps", "100000", launcher="app.launch")
    proc.wait_for_step(run, 3)
    proc.signal(signal.SIGTERM)
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


def test_mfu_floor_checkpoints_and_exits_7_with_its_own_cause(tmp_path):
    """A peak no CPU reaches makes the floor unreachable: after the warm-up windows and
    train.mfu_floor_minutes under the floor the run saves, says why in one line and exits 7."""
    run = tmp_path / "run"
    proc = pretrain(
        "train",
        "--out",
        str(run),
        *FAST,
        "--max-steps",
        "100000",
        "--set",
        "metrics.peak_tflops=1000",
        "--set",
        "train.mfu_floor=0.3",
        "--set",
        "train.mfu_floor_minutes=0.02",
        "--set",
        "train.log_every=2",
    )
    assert proc.returncode == 7, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "under train.mfu_floor=0.3" in proc.stdout + proc.stderr
    stop = [r for r in train_rows(run, "event") if r.get("event") == "stop"][-1]
    assert stop["cause"] == "low_mfu" and stop["exit_code"] == 7
    last = stop["step"]
    assert list_checkpoints(run)[0].name == f"step_{last:06d}"  # stopped on a checkpoint of its last step
    assert last >= 6  # the three warm-up windows (2 steps each) never count
    # no cluster here: the Event is left in status.json for a budget watcher to relay
    event = json.loads((run / "status.json").read_text())["event"]
    assert event["reason"] == "LowMFU" and event["posted"] is False and "mfu_floor" in event["message"]


def test_mfu_floor_without_a_known_peak_is_refused_in_one_line(tmp_path):
    proc = pretrain("train", "--out", str(tmp_path / "run"), *FAST, "--set", "train.mfu_floor=0.3")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "metrics.peak_tflops" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_low_mfu_stop_yields_to_preemption_divergence_and_an_immediate_stop():
    from app.trainer.stopping.agreement import StopCause, StopDecision

    low = StopDecision(StopCause.LOW_MFU).encode()
    for stronger in (StopCause.PREEMPTED, StopCause.IMMEDIATE, StopCause.DIVERGED):
        assert StopDecision(stronger).encode() > low
    for weaker in (StopCause.PLANNED, StopCause.EARLY, StopCause.BUDGET):
        assert StopDecision(weaker).encode() < low
    assert StopDecision(StopCause.LOW_MFU).gauge_code == 8 and StopDecision(StopCause.LOW_MFU).exit_code == 7


@pytest.mark.slow  # three 2-rank runs
def test_a_stop_waits_for_the_agreement_every_k_steps_and_the_run_resumes_exactly(tmp_path, procs):
    """train.stop_check_every=4 on 2 ranks: a stop file seen between agreements stops both ranks at the
    next multiple of 4, on a checkpoint, and the resumed run equals a straight one bit for bit."""
    from tests.test_resume import assert_same_run

    every = ["--set", "train.stop_check_every=4", "--set", "train.log_every=1", "--max-steps", "24", *FAST]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    reference = procs.torchrun("--out", str(straight), *every)  # meanwhile, beside the stopped run
    proc = procs.torchrun("--out", str(stopped), *every)
    proc.wait_for_step(stopped, 1)
    (stopped / "stop.json").write_text(json.dumps({"mode": "graceful", "cause": "test"}))
    assert proc.wait(120) == 0
    last = train_rows(stopped)[-1]["step"]
    assert last % 4 == 0 and last < 24, last
    assert list_checkpoints(stopped)[0].name == f"step_{last:06d}"
    resumed = torchrun("--out", str(stopped), *every)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert reference.wait(300) == 0, reference.tail()
    assert_same_run(straight, stopped, 24)


def test_auto_k_keeps_the_agreement_cheap_and_the_stop_delay_bounded():
    from app.trainer.stopping.agreement import (
        MAX_STOP_DELAY,
        BadSteps,
        EarlyStopping,
        PlannedEnd,
        SignalFlag,
        StopAgreement,
    )

    stopper = StopAgreement(
        stop_file=None,
        planned=PlannedEnd(100),
        early=EarlyStopping(0, 0.0),
        signals=SignalFlag(),
        bad_steps=BadSteps(5),
    )
    stopper.costs = [0.004, 0.002, 0.009]  # the cheapest, 2 ms, is the cost; the rest waited for a peer
    assert stopper._k(step_seconds=1.0) == 1  # 2 ms is under 1% of a 1 s step
    assert stopper._k(step_seconds=0.05) == 4  # 2 ms / 0.5 ms
    stopper.costs = [0.05]  # a slow ring: 1% of a 10 ms step would ask for k=500
    assert stopper._k(step_seconds=0.01) == int(MAX_STOP_DELAY / 0.01)  # capped by the stop delay
    fixed = StopAgreement(
        stop_file=None,
        planned=PlannedEnd(100),
        early=EarlyStopping(0, 0.0),
        signals=SignalFlag(),
        bad_steps=BadSteps(5),
        every=3,
    )
    fixed.costs = [1.0]
    assert fixed._k(step_seconds=0.001) == 3  # train.stop_check_every wins
