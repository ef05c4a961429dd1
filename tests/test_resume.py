"""Exact resume and fault injection with real processes and real signals.

N steps straight versus interrupted runs must give bit-identical weights and identical per-step losses.
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from app.trainer.checkpoint import store as ckpt
from tests.conftest import (
    FAST,
    kill_inside_a_write,
    losses_by_step,
    pretrain,
    pretrain_meanwhile,
    spawn_train,
    torchrun,
    wait_for_step,
)


def weights(run_dir, step):
    info, why = ckpt.verify(run_dir / "checkpoints" / f"step_{step:06d}")
    assert info is not None, why
    return ckpt.load_model_state(info)


def assert_same_run(a, b, steps):
    wa, wb = weights(a, steps), weights(b, steps)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] == wb[k]).all(), f"{k} differs"
    la, lb = losses_by_step(a), losses_by_step(b)
    assert [la[s] for s in range(1, steps + 1)] == [lb[s] for s in range(1, steps + 1)]


@pytest.mark.parametrize(
    "extra", [[], ["--set", f"train.batch_tokens={8 * 64 * 2}"]], ids=["plain", "grad-accum"]
)
def test_half_stop_half_equals_straight(tmp_path, extra):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    reference = pretrain_meanwhile("train", "--out", str(straight), "--max-steps", "16", *FAST, *extra)
    assert pretrain("train", "--out", str(halves), "--max-steps", "8", *FAST, *extra).returncode == 0
    second = pretrain("train", "--out", str(halves), "--max-steps", "16", *FAST, *extra)
    assert second.returncode == 0 and "resumed from" in second.stdout
    assert reference.finished().returncode == 0
    assert_same_run(straight, halves, 16)


@pytest.mark.slow  # over 8 s: `make test-slow` (CI runs it); keeps `make test` near 10 min
def test_exact_resume_with_two_ddp_ranks(tmp_path, procs):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    extra = ["--set", f"train.batch_tokens={8 * 64 * 2 * 2}"]  # 2 ranks x 2 accumulation steps
    reference = procs.torchrun("--out", str(straight), "--max-steps", "10", *FAST, *extra)  # meanwhile
    assert torchrun("--out", str(halves), "--max-steps", "5", *FAST, *extra).returncode == 0
    resumed = torchrun("--out", str(halves), "--max-steps", "10", *FAST, *extra)
    assert resumed.returncode == 0, resumed.stderr
    assert reference.wait(300) == 0, reference.tail()
    assert_same_run(straight, halves, 10)


@pytest.mark.slow  # over 10 s: `make test-slow`, which CI runs too
def test_fault_injection_sigterm_and_sigkill_lose_nothing(tmp_path, procs):
    """SIGTERM at random steps several times, SIGKILL during a save, resume each time: the final
    weights equal an uninterrupted run's."""
    steps = 24
    common = [*FAST, "--max-steps", str(steps), "--set", "checkpoint.every_steps=1"]
    ref, run = tmp_path / "ref", tmp_path / "faulty"
    assert pretrain("train", "--out", str(ref), *common).returncode == 0
    rng = random.Random(1234)

    # Several SIGTERMs at random steps: each one checkpoints and exits 143.
    for _ in range(3):
        proc = spawn_train("--out", str(run), *common)
        done = max(losses_by_step(run) or {0: 0})
        wait_for_step(run, done + rng.randint(1, 5), proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        out = proc.output
        assert "preempted: SIGTERM" in out

    # SIGKILL in the middle of a save: the resumed run's first save stops itself inside its second file
    # (the optimizer's; the model's is already in the temp dir; tests/pause_at.py) and is killed there.
    kill_inside_a_write(procs, run, common, tmp_path, 2)
    assert list((run / "checkpoints").glob(".tmp-*")), "the kill did not land during a save"

    final = pretrain("train", "--out", str(run), *common)
    assert final.returncode == 0, final.stderr
    assert not list((run / "checkpoints").glob(".tmp-*"))  # cleaned at start
    assert_same_run(ref, run, steps)


def test_second_sigterm_during_save_corrupts_nothing(tmp_path):
    run = tmp_path / "run"
    proc = spawn_train("--out", str(run), *FAST, "--max-steps", "100000", "--set", "model.d_model=256")
    wait_for_step(run, 3, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143
    from app.trainer.checkpoint.store import resolve_latest

    info = resolve_latest(run, warn=lambda m: pytest.fail(m))
    assert info is not None and info.step >= 3


def test_sigint_exits_130_after_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = spawn_train("--out", str(run), *FAST, "--max-steps", "100000")
    wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    assert list((run / "checkpoints").glob("step_*"))
