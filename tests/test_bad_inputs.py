"""Bad input, family by family: each case is the real CLI in a subprocess and must end with one line on
stderr naming the problem, exit 2 and no traceback (or, for the outputs and the dry run, leave the files
as they were). The cases run concurrently; almost all fail before any torch work."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, pretrain


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]  # {tmp} is replaced by the case's directory (see make_files)
    says: str  # in the one line on stderr


def case(says: str, *argv: str) -> Case:
    return Case(argv, says)


FAMILIES: dict[str, dict[str, Case]] = {
    # sizes that cannot fit: refused at start against the memory estimate and this machine's memory
    "absurd-size": {
        "seq-len": case("does not fit", "train", "--out", "{tmp}/run", "--set", "model.seq_len=100000000"),
        "micro-batch": case(
            "does not fit", "train", "--out", "{tmp}/run", "--set", "train.micro_batch_size=100000000"
        ),
        "layers": case("does not fit", "train", "--out", "{tmp}/run", "--set", "model.n_layer=1000000"),
        # bench measures the machine it runs on: its fix names no flag bench lacks
        "bench-layers": case(
            "or measure it on more or larger GPUs (torchrun -m app.tools.bench",
            *("bench", "--steps", "1", "--warmup", "0", "--set", "model.n_layer=1000000"),
        ),
        "bench-seq-len": case(
            "does not fit", "bench", "--steps", "1", "--warmup", "0", "--set", "model.seq_len=100000000"
        ),
        "int-beyond-2**53": case("below 2**53", "train", "--print-config", "--set", "train.max_steps=1e30"),
        "max-new-tokens": case(
            "--max-new-tokens", "sample", "--checkpoint", "{tmp}", "--max-new-tokens", "1000000000"
        ),
        "plan-budget-1e308": case("--budget-usd", "plan", "--budget-usd", "1e308", "--gpu", "h100-sxm"),
    },
    "non-finite": {
        "plan-budget-nan": case("--budget-usd", "plan", "--budget-usd", "nan", "--gpu", "h100-sxm"),
        "plan-budget-inf": case("--budget-usd", "plan", "--budget-usd", "inf", "--gpu", "h100-sxm"),
        "plan-price-nan": case(
            "--price-per-gpu-hour",
            "plan",
            "--budget-usd",
            "9",
            "--gpu",
            "h100-sxm",
            "--price-per-gpu-hour",
            "nan",
        ),
        "config-lr-nan": case("optim.lr", "train", "--print-config", "--set", "optim.lr=nan"),
        "config-hours-inf": case(
            "train.max_hours", "train", "--print-config", "--set", "train.max_hours=.inf"
        ),
        "sample-temperature-nan": case(
            "--temperature", "sample", "--checkpoint", "{tmp}", "--temperature", "nan"
        ),
        "wait-data-poll-nan": case(
            "--poll", "wait-data", "--dir", "{tmp}", "--fingerprint", "x", "--poll", "nan"
        ),
        "watch-cap-nan": case(
            "budget.cap_usd", "watch", "--dry-run-budget", "--run-dir", "{tmp}/run", "--budget-cap-usd", "nan"
        ),
    },
    "out-of-range": {
        "plan-budget-negative": case("--budget-usd", "plan", "--budget-usd", "-1", "--gpu", "h100-sxm"),
        "plan-gpus-0": case("--gpus", "plan", "--budget-usd", "9", "--gpu", "h100-sxm", "--gpus", "0"),
        "plan-preset-gpus-negative": case("--gpus", "plan", "--preset", "tiny", "--gpus", "-2"),
        "plan-mfu-2": case("--mfu", "plan", "--budget-usd", "9", "--gpu", "h100-sxm", "--mfu", "2"),
        "config-seed-negative": case("train.seed", "train", "--print-config", "--set", "train.seed=-1"),
        "config-log-every-0": case(
            "train.log_every", "train", "--print-config", "--set", "train.log_every=0"
        ),
        "config-eval-batches-0": case(
            "train.eval_batches", "train", "--print-config", "--set", "train.eval_batches=0"
        ),
        "config-timeout-huge": case(
            "collective_timeout_minutes",
            "train",
            "--print-config",
            "--set",
            "train.collective_timeout_minutes=1e12",
        ),
        "config-loop-negative": case(
            "model.loop.coda", "train", "--print-config", "--set", "model.loop.coda=-1"
        ),
        # values that were accepted and left the model nothing to learn (the loss stays at or near ln V)
        "config-softcap-1e-30": case(
            "model.logit_softcap",
            "train",
            "--out",
            "{tmp}/run",
            "--max-steps",
            "3",
            "--set",
            "model.logit_softcap=1e-30",
        ),
        "config-softcap-under-1": case(
            "use a cap >= 1", "train", "--print-config", "--set", "model.logit_softcap=0.5"
        ),
        "config-init-std-0": case("model.init_std", "train", "--print-config", "--set", "model.init_std=0"),
        "config-rope-base-1": case(
            "model.rope_base", "train", "--print-config", "--set", "model.rope_base=1"
        ),
        "config-norm-eps-huge": case(
            "model.norm_eps", "train", "--print-config", "--set", "model.norm_eps=1e6"
        ),
        "config-adam-eps-0": case("optim.eps", "train", "--print-config", "--set", "optim.eps=0"),
        "config-adam-eps-huge": case("optim.eps", "train", "--print-config", "--set", "optim.eps=1e6"),
        "config-grad-clip-tiny": case(
            "optim.grad_clip", "train", "--print-config", "--set", "optim.grad_clip=1e-12"
        ),
        "config-weight-decay-huge": case(
            "optim.weight_decay", "train", "--print-config", "--set", "optim.weight_decay=1000"
        ),
        "sample-top-p-2": case("--top-p", "sample", "--checkpoint", "{tmp}", "--top-p", "2"),
        "bench-steps-0": case("--steps", "bench", "--steps", "0"),
    },
    "not-what-it-should-be": {
        "config-not-utf8": case("not UTF-8", "train", "--print-config", "--config", "{tmp}/latin1.yaml"),
        "config-a-directory": case("{tmp}", "train", "--print-config", "--config", "{tmp}"),
        "wait-data-dir-a-file": case("is a file", "wait-data", "--dir", "{tmp}/a-file", "--fingerprint", "x"),
        "export-garbage-log": case(
            "no metrics records", "export", "{tmp}/garbage-run", "--output", "{tmp}/out"
        ),
        "sample-checkpoint-a-file": case("{tmp}/a-file", "sample", "--checkpoint", "{tmp}/a-file"),
        # a preset is its values, applied before --set: by --set its name only relabelled the default's
        "config-preset-by-set": case("--preset x1-50m", "train", "--print-config", "--set", "preset=x1-50m"),
        "config-unknown-preset-by-set": case(
            "--preset nope", "train", "--out", "{tmp}/run", "--max-steps", "3", "--set", "preset=nope"
        ),
        # a directory as the stop file was read as a stop at step 0 (exit 0) and renamed NAME.handled
        "stop-file-a-directory": case(
            "--stop-file {tmp}/stopdir is a directory",
            "train",
            "--out",
            "{tmp}/run",
            "--max-steps",
            "3",
            "--stop-file",
            "{tmp}/stopdir",
        ),
        "default-stop-file-a-directory": case(
            "the default stop file {tmp}/used/stop.json is a directory",
            "train",
            "--out",
            "{tmp}/used",
            "--max-steps",
            "3",
        ),
        "watch-stop-file-a-directory": case(
            "the stop file {tmp}/stopdir is a directory",
            "watch",
            "--dry-run-budget",
            "--run-dir",
            "{tmp}/run",
            "--budget-cap-usd",
            "10",
            "--gpu-type",
            "h100-sxm",
            "--gpus",
            "1",
            "--stop-file",
            "{tmp}/stopdir",
        ),
    },
    "output-exists": {
        "sample-consolidate": case(
            "--force", "sample", "--checkpoint", "{tmp}", "--consolidate", "{tmp}/exists.safetensors"
        ),
        "bench-out": case("--force", "bench", "--steps", "1", "--out", "{tmp}/exists.json"),
    },
}
CASES = {f"{family}:{name}": c for family, cases in FAMILIES.items() for name, c in cases.items()}


def make_files(tmp: Path) -> None:
    (tmp / "latin1.yaml").write_bytes("model:\n  n_layer: 2  # caf\xe9\n".encode("latin-1"))
    (tmp / "a-file").write_text("not a directory\n")
    (tmp / "garbage-run").mkdir()
    (tmp / "garbage-run" / "metrics.jsonl").write_bytes(b"\x00\xff garbage\nnot json either\n[1, 2]\n")
    (tmp / "exists.safetensors").write_bytes(b"precious")
    (tmp / "exists.json").write_text("precious")
    (tmp / "stopdir").mkdir()
    (tmp / "stopdir" / "mine").write_text("precious")
    (tmp / "used" / "stop.json").mkdir(parents=True)


def run_case(tmp: Path, c: Case) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True)
    make_files(tmp)
    return pretrain(*(a.replace("{tmp}", str(tmp)) for a in c.argv))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    root = tmp_path_factory.mktemp("bad-inputs")
    dirs = {cid: root / f"case{i}" for i, cid in enumerate(CASES)}
    with ThreadPoolExecutor(max_workers=4) as pool:
        procs = dict(zip(CASES, pool.map(lambda cid: run_case(dirs[cid], CASES[cid]), CASES), strict=True))
    return {cid: (dirs[cid], procs[cid]) for cid in CASES}


@pytest.mark.parametrize("cid", list(CASES))
def test_bad_input_is_one_line_and_exit_2(results, cid):
    tmp, proc = results[cid]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert CASES[cid].says.replace("{tmp}", str(tmp)) in lines[0], lines[0]
    assert (tmp / "exists.safetensors").read_bytes() == b"precious"  # an output that exists is never replaced
    assert (tmp / "exists.json").read_text() == "precious"
    assert (tmp / "stopdir" / "mine").read_text() == "precious"  # a directory given as a stop file stays
    assert sorted(p.name for p in (tmp / "used").iterdir()) == ["stop.json"]
    assert not (tmp / "run").exists() or cid.startswith("absurd-size:")  # nothing else is created


def test_budget_dry_run_creates_no_directories(tmp_path):
    run_dir = tmp_path / "not" / "yet" / "run"
    cmd = [sys.executable, "-m", "app.cli", "watch", "--dry-run-budget", "--run-dir", str(run_dir)]
    cmd += ["--budget-cap-usd", "10", "--gpu-type", "h100-sxm", "--gpus", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "writable" in proc.stdout and not (tmp_path / "not").exists()
