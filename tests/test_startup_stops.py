"""A stop at any moment of start-up loses nothing and changes nothing: SIGTERM or SIGKILL before the
model is built, during the step-0 eval, during the first step and during the first save, then a plain
restart, gives the weights and per-step losses of an uninterrupted run (one process and 2 ranks).

Preemption during start-up is common on clusters (spot reclaim, node drains while the image starts).
No checkpoint is written at step 0: nothing has been learned, and a restart from the seed is the
same run.

Each rank stops itself (SIGSTOP, tests/pause_at.py) at the first call of a function of the named phase;
the signal is sent while it is stopped, so it lands in that phase every time, and what the run logged
and saved before it exited proves that it did.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, cli_env, losses_by_step, pretrain, torchrun, train_rows
from tests.procs import Proc, Procs, state
from tests.test_resume import assert_same_run

STEPS = 6
COMMON = [
    *FAST,
    "--max-steps",
    str(STEPS),
    "--set",
    "train.eval_every=3",
    "--set",
    "train.eval_batches=4",
    "--set",
    "checkpoint.every_steps=1",
]
EVAL_OFF = ["--set", "train.eval_every=0"]

# phase: (extra args, where each rank stops itself for SIGTERM, for SIGKILL). The first save is paused
# on the loop's thread for SIGTERM (so the stop step is exact), and in the middle of the write (the
# model shard on disk, the optimizer shard not yet) for SIGKILL, which leaves a half-written temp dir.
PHASES = {
    "before-model": ([], "app.trainer.parallel.parallelize:build_parallel_model", None),
    "step-0-eval": ([], "app.trainer.model.evaluate:validation_loss", None),
    "first-step": (
        EVAL_OFF,
        "torch.nn.utils:clip_grads_with_norm_",
        None,
    ),  # after backward, before the update
    "first-save": (
        EVAL_OFF,
        "app.trainer.checkpoint.writer:model_pieces",
        "app.trainer.checkpoint.writer:write_safetensors:2",
    ),
}


def hook(phase: str, sig: signal.Signals) -> str:
    _, term, kill = PHASES[phase]
    return kill if sig == signal.SIGKILL and kill else term


def start(procs: Procs, run: Path, ranks: int, extra: list[str], pause: str, marks: Path) -> Proc:
    """The trainer (or the launcher and its workers) with every rank stopping itself at `pause`."""
    marks.mkdir()
    env = cli_env(PRETRAIN_TEST_PAUSE=pause, PRETRAIN_TEST_PAUSE_DIR=str(marks))
    args = ["--out", str(run), *COMMON, *extra]
    if ranks == 1:
        return procs.python("-m", "tests.pause_at", "app.cli", "train", *args, env=env)
    return procs.torchrun(
        "-m", "tests.pause_at", "app.train", *args, nproc=ranks, launcher="app.launch", env=env
    )


def pending(pid: int, sig: signal.Signals) -> bool:
    """`sig` is queued for `pid` (it cannot run while stopped)."""
    mask = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            mask |= int(line.split()[1], 16)
    return bool(mask >> (int(sig) - 1) & 1)


def paused_pids(marks: Path, ranks: int) -> list[int]:
    pids = [int(p.name.split("-")[1]) for p in marks.glob("paused-*")]
    return pids if len(pids) == ranks and all(state(p) == "T" for p in pids) else []


def signal_in_phase(proc: Proc, marks: Path, ranks: int, sig: signal.Signals, phase: str) -> int | None:
    """Wait until every rank has stopped itself in `phase`, then deliver `sig` there. SIGKILL takes the
    whole pod at once (torchrun starts its workers in sessions of their own: each is killed by pid).
    Returns the exit code of a SIGTERM'd run."""
    pids = proc.wait_until(lambda: paused_pids(marks, ranks), f"every rank paused in {phase}", 180, 0.01)
    if sig == signal.SIGKILL:
        proc.signal_group(signal.SIGKILL)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        proc.wait(60)
        deadline = time.monotonic() + 60
        while any(state(p) not in ("", "Z") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.01)
        return None
    proc.send_signal(sig)  # to the trainer itself, or to the launcher, which passes it on to the workers
    proc.wait_until(lambda: all(pending(p, sig) for p in pids), f"{sig.name} reached every rank", 180, 0.01)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    return proc.wait(180)


def check_phase(run: Path, phase: str, sig: signal.Signals, ranks: int) -> None:
    """What the run left proves where the signal landed (and that SIGTERM was obeyed, not outrun)."""
    events = train_rows(run, "event")
    starts = [e for e in events if e.get("event") == "start"]
    stops = [e["step"] for e in events if e.get("event") == "stop"]
    evals = [r["step"] for r in train_rows(run, "eval")]
    trains = [r["step"] for r in train_rows(run)]
    root = run / "checkpoints"
    committed = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
    assert "step_000000" not in committed, "a step-0 checkpoint was written"
    if sig == signal.SIGTERM:
        # taken at the first agreement after the signal: before any step when it came during setup,
        # after step 1 (saved once, with its update) when it came during the step-0 eval, step or save
        expect = {"before-model": ([0], [], []), "step-0-eval": ([1], [0], [1])}
        want_stops, want_evals, want_trains = expect.get(phase, ([1], [], [1]))
        assert (stops, evals, trains) == (want_stops, want_evals, want_trains), (stops, evals, trains)
        assert committed == ([] if phase == "before-model" else ["step_000001"])
        return
    assert committed == []
    if phase == "before-model":
        assert not starts, "the set-up had finished"
    elif phase in ("step-0-eval", "first-step"):
        assert len(starts) == 1 and (evals, trains) == ([], [])
    else:  # killed half-way through writing step 1: a temp dir holding every rank's model shard only
        assert trains[:1] == [1] and not evals
        written = sorted(p.name for p in (root / ".tmp-step_000001").glob("*.safetensors"))
        assert written == [f"model-rank{r:05d}.safetensors" for r in range(ranks)], written


class Straight:
    """Uninterrupted reference runs, one per world size and eval setting, each started in the background on
    first use (the test's interrupted run goes on meanwhile) and waited for when it is compared."""

    def __init__(self, procs: Procs, base: Path):
        self.procs, self.base, self.started = procs, base, {}

    def start(self, ranks: int, eval_on: bool) -> None:
        if (ranks, eval_on) not in self.started:
            run = self.base / f"r{ranks}-{'eval' if eval_on else 'noeval'}"
            args = ["--out", str(run), *COMMON, *([] if eval_on else EVAL_OFF)]
            proc = (
                self.procs.pretrain("train", *args) if ranks == 1 else self.procs.torchrun(*args, nproc=ranks)
            )
            self.started[ranks, eval_on] = run, proc

    def __call__(self, ranks: int, eval_on: bool) -> Path:
        self.start(ranks, eval_on)
        run, proc = self.started[ranks, eval_on]
        assert proc.wait(600) == 0, proc.tail()
        return run


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Straight:
    base = tmp_path_factory.mktemp("straight")
    with Procs(base / "logs") as procs:
        yield Straight(procs, base)


def interrupt_and_resume(
    procs: Procs, tmp_path: Path, straight, phase: str, sig: signal.Signals, ranks: int
) -> None:
    extra = PHASES[phase][0]
    straight.start(ranks, not extra)
    run = tmp_path / "run"
    proc = start(procs, run, ranks, extra, hook(phase, sig), tmp_path / "paused")
    code = signal_in_phase(proc, tmp_path / "paused", ranks, sig, phase)
    if sig == signal.SIGTERM:
        out = proc.output
        assert code == 128 + sig, f"exit {code}:\n{out}"
        assert "Traceback" not in out, out
    check_phase(run, phase, sig, ranks)

    if ranks == 1:
        again = pretrain("train", "--out", str(run), *COMMON, *extra)
    else:
        again = torchrun("--out", str(run), *COMMON, *extra, nproc=ranks)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not list((run / "checkpoints").glob(".tmp-*")), "the half-written save was not cleaned"
    assert_same_run(straight(ranks, not extra), run, STEPS)
    assert sorted(losses_by_step(run)) == list(range(1, STEPS + 1))


@pytest.mark.slow  # three phases of ~10 s: `make test-slow` (CI runs it)
@pytest.mark.parametrize("phase", list(PHASES))
def test_sigterm_during_startup_resumes_exactly(procs, tmp_path, straight, phase):
    interrupt_and_resume(procs, tmp_path, straight, phase, signal.SIGTERM, ranks=1)


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASES))
def test_sigkill_during_startup_resumes_exactly(procs, tmp_path, straight, phase):
    interrupt_and_resume(procs, tmp_path, straight, phase, signal.SIGKILL, ranks=1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_two_ranks_stop_during_startup_resume_exactly(procs, tmp_path, straight, phase, sig):
    interrupt_and_resume(procs, tmp_path, straight, phase, sig, ranks=2)


def test_a_step_0_checkpoint_of_an_older_version_resumes_exactly(tmp_path, straight):
    """Older versions saved at step 0, through torch's state-dict API, which made AdamW's first real
    update its second (bias correction off by one step). Such a checkpoint is resumed as a fresh start."""
    import torch

    from app.config import load_config
    from app.trainer.checkpoint.writer import CheckpointWriter
    from app.trainer.model.gpt import build_model
    from app.trainer.optimization.optimizer import build_optimizer

    # an older version's run: AdamW (the recipe then), whose step count the stale save shifted
    cfg = load_config(
        None, None, [a for a in COMMON[1::2] if "=" in a] + ["model.vocab_size=2048", "optim.name=adamw"]
    )
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    stale = get_optimizer_state_dict(model, opt)  # what the old save did: a zero-lr step first
    assert all(float(s["step"]) == 1 for s in stale["state"].values())
    run = tmp_path / "run"
    writer = CheckpointWriter(run, 0, 1)  # writes opt's state: the stale one above
    writer.save(0, model, opt, {"step": 0}, {"config": cfg.to_dict(), "val_loss": None})
    again = pretrain("train", "--out", str(run), *COMMON, *EVAL_OFF)
    assert again.returncode == 0, again.stdout + again.stderr
    assert_same_run(straight(1, False), run, STEPS)
