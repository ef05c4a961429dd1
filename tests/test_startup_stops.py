"""A stop at any moment of start-up loses nothing and changes nothing: SIGTERM or SIGKILL before the
model is built, during the step-0 eval, during the first step and during the first save, then a plain
restart, gives the weights and per-step losses of an uninterrupted run (one process and 2 ranks).

Preemption during start-up is common on clusters (spot reclaim, node drains while the image starts).
No checkpoint is written at step 0: nothing has been learned, and a restart from the seed is the
same run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, REPO, cli_env, losses_by_step, pretrain, torchrun
from tests.test_resume import assert_same_run

STEPS = 6
# Slow enough to land a signal inside each phase: 200 eval batches, a save after every step.
COMMON = [
    *FAST,
    "--max-steps",
    str(STEPS),
    "--set",
    "model.d_model=128",
    "--set",
    "train.eval_every=3",
    "--set",
    "train.eval_batches=200",
    "--set",
    "checkpoint.every_steps=1",
]
EVAL_OFF = ["--set", "train.eval_every=0"]


def start(run: Path, ranks: int, extra: list[str]) -> tuple[subprocess.Popen, list[str]]:
    """The trainer in its own process group (SIGKILL takes the whole pod: launcher and workers), with
    its output collected line by line."""
    if ranks == 1:
        cmd = [sys.executable, "-m", "app.cli", "train"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "app.launch",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "app.train",
        ]
    proc = subprocess.Popen(
        [*cmd, "--out", str(run), *COMMON, *extra],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def wait_until(cond, proc: subprocess.Popen, lines: list[str], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited {proc.returncode} before {what}:\n{''.join(lines)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s:\n{''.join(lines)}")
        time.sleep(0.005)


def started(run: Path) -> bool:
    path = run / "metrics.jsonl"
    return path.exists() and '"event": "start"' in path.read_text()


def saving(run: Path) -> bool:
    try:
        return json.loads((run / "status.json").read_text()).get("state") == "saving"
    except (OSError, ValueError):
        return False


PHASES = {
    # phase: (extra args, the moment to send the signal)
    "before-model": ([], lambda run, lines: any(line.startswith("parallel:") for line in lines)),
    "step-0-eval": ([], lambda run, lines: started(run)),
    "first-step": (EVAL_OFF, lambda run, lines: started(run)),
    "first-save": (EVAL_OFF, lambda run, lines: saving(run)),
}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """Uninterrupted reference runs, made on first use per world size."""
    made: dict = {}
    base = tmp_path_factory.mktemp("straight")

    def get(ranks: int, eval_on: bool) -> Path:
        key = (ranks, eval_on)
        if key not in made:
            run = base / f"r{ranks}-{'eval' if eval_on else 'noeval'}"
            extra = [] if eval_on else EVAL_OFF
            proc = (
                pretrain("train", "--out", str(run), *COMMON, *extra)
                if ranks == 1
                else torchrun("--out", str(run), *COMMON, *extra, nproc=ranks)
            )
            assert proc.returncode == 0, proc.stdout + proc.stderr
            made[key] = run
        return made[key]

    return get


def interrupt_and_resume(tmp_path: Path, straight, phase: str, sig: signal.Signals, ranks: int) -> None:
    extra, moment = PHASES[phase]
    run = tmp_path / "run"
    proc, lines = start(run, ranks, extra)
    wait_until(lambda: moment(run, lines), proc, lines, phase)
    if sig == signal.SIGKILL:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    else:
        proc.send_signal(sig)
        code = proc.wait(120)
        out = "".join(lines)
        assert code in (0, 128 + sig), f"exit {code}:\n{out}"  # 0 only if the run ended first
        assert "Traceback" not in out, out
        if code == 128 + sig and started(run):
            stop = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines() if '"stop"' in r]
            assert stop and stop[-1]["step"] <= 3, f"the signal landed late ({phase}): {stop}"
    assert not (run / "checkpoints" / "step_000000").exists(), "a step-0 checkpoint was written"

    if ranks == 1:
        again = pretrain("train", "--out", str(run), *COMMON, *extra)
    else:
        again = torchrun("--out", str(run), *COMMON, *extra, nproc=ranks)
    assert again.returncode == 0, again.stdout + again.stderr
    ref = straight(ranks, not extra)
    assert_same_run(ref, run, STEPS)
    assert sorted(losses_by_step(run)) == list(range(1, STEPS + 1))


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigterm_during_startup_resumes_exactly(tmp_path, straight, phase):
    interrupt_and_resume(tmp_path, straight, phase, signal.SIGTERM, ranks=1)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["before-model", "first-step", "first-save"])
def test_sigkill_during_startup_resumes_exactly(tmp_path, straight, phase):
    interrupt_and_resume(tmp_path, straight, phase, signal.SIGKILL, ranks=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase, sig",
    [
        ("before-model", signal.SIGTERM),
        ("step-0-eval", signal.SIGTERM),
        ("first-step", signal.SIGTERM),
        ("first-save", signal.SIGTERM),
        ("first-save", signal.SIGKILL),
    ],
)
def test_two_ranks_stop_during_startup_resume_exactly(tmp_path, straight, phase, sig):
    interrupt_and_resume(tmp_path, straight, phase, sig, ranks=2)


def test_a_step_0_checkpoint_of_an_older_version_resumes_exactly(tmp_path, straight):
    """Older versions saved at step 0, through torch's state-dict API, which made AdamW's first real
    update its second (bias correction off by one step). Such a checkpoint is resumed as a fresh start."""
    import torch

    from app.config import load_config
    from app.trainer import checkpoint as ckpt
    from app.trainer.model import build_model
    from app.trainer.optim import build_optimizer
    from app.trainer.parallel import model_state_dict

    cfg = load_config(None, None, [a for a in COMMON[1::2] if "=" in a] + ["model.vocab_size=2048"])
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    stale = get_optimizer_state_dict(model, opt)  # what the old save did: a zero-lr step first
    assert all(float(s["step"]) == 1 for s in stale["state"].values())
    run = tmp_path / "run"
    writer = ckpt.CheckpointWriter(run, 0, 1, lambda: None)
    writer.save(0, model_state_dict(model), stale, {"step": 0}, {"config": cfg.to_dict(), "val_loss": None})
    again = pretrain("train", "--out", str(run), *COMMON, *EVAL_OFF)
    assert again.returncode == 0, again.stdout + again.stderr
    assert_same_run(straight(1, False), run, STEPS)
