"""nanoGPT benchmark: pretrain against Karpathy's nanoGPT (github.com/karpathy/nanoGPT) on CPU at shapes
matched to nanoGPT's train.py, given a checkout: `NANOGPT_DIR=/tmp/nanoGPT python -m benchmarks nanogpt`.
Nothing of nanoGPT is copied here: its model.py and train.py run from the checkout. Without one this
benchmark prints one line and skips.

Shapes: vocab 2048, 4 layers, d_model 192, 6 heads, seq 128, batch 32, fp32, no torch.compile, no dropout,
no biases, tied head, the model switches off. pretrain: RMSNorm, RoPE, SwiGLU of 512, AdamW as
build_optimizer makes it (fused); nanoGPT: LayerNorm, learned positions, GELU MLP of 768, AdamW as its
configure_optimizers makes it on a CPU (foreach). The matmuls are the same size per token (2.16M and 2.19M
parameters; nanoGPT's extra 24,576 are its position table).

Two ratios pretrain / nanoGPT, each the median (and range) of per-round ratios of tokens per CPU-second, one
intra-op thread per process (on a shared machine a second thread that loses its core spins at every
barrier; CPU time does not count the time other work holds the core):
  models:    both models in this process, each with its optimizer as it ships, in one loop (forward with
             the loss, backward, clip to 1.0, step, zero_grad) on the same random batches; ROUNDS rounds of
             STEPS timed steps each, the order alternating.
  trainers:  `pretrain train` and nanoGPT's train.py, each as it ships, fresh processes alternating,
             TRAINER_ROUNDS rounds; each process's CPU time (/proc/PID/stat) between its log lines at step
             TRAINER_FROM and TRAINER_FROM + TRAINER_STEPS, so start-up and the first steps are not
             counted. Both train on the same tokens: the embedded Shakespeare corpus's BPE-2048 split, which
             `pretrain train` reads, written as nanoGPT's data/<dataset>/train.bin (uint16) with the
             meta.pkl its train.py reads the vocabulary size from (nanoGPT's own format, in a temporary
             directory that only its train.py reads).
Goal: trainers >= 0.95x.

`python -m benchmarks.bench_nanogpt --profile` prints torch.profiler self-CPU ms per step by op category
and the top ops of both models (docs/performance.md, "CPU").
"""

from __future__ import annotations

import os
import pickle  # nanoGPT's meta.pkl only (the module docstring)
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_peer import (
    BATCH,
    D_MODEL,
    N_HEAD,
    N_LAYER,
    SEQ,
    VOCAB,
    Trainee,
    batches,
    n_params,
    ours_loss,
)

ROOT = Path(__file__).resolve().parent.parent
NANOGPT_DIR = os.environ.get("NANOGPT_DIR", "")
WARMUP = int(os.environ.get("NANOGPT_WARMUP", 3))  # steps of each model before the first round
STEPS = int(os.environ.get("NANOGPT_STEPS", 4))  # timed steps per model per round (+1 untimed each)
ROUNDS = int(os.environ.get("NANOGPT_ROUNDS", 7))
TRAINER_ROUNDS = int(os.environ.get("NANOGPT_TRAINER_ROUNDS", 5))  # process pairs (0: models only)
TRAINER_FROM, TRAINER_STEPS = 10, int(os.environ.get("NANOGPT_TRAINER_STEPS", 20))  # log lines every 10 steps
CHILD_TIMEOUT_S = 1800
DATASET = "pretrain_bench"  # nanoGPT's data/<dataset> directory name


def checkout() -> Path | None:
    """The nanoGPT checkout NANOGPT_DIR names, if it holds nanoGPT's model.py and train.py."""
    path = Path(NANOGPT_DIR).expanduser() if NANOGPT_DIR else None
    if path and all((path / name).is_file() for name in ("model.py", "train.py", "configurator.py")):
        return path
    return None


# ---------------------------------------------------------------- the two models in one process


def nanogpt_model(nanogpt: Path):
    """nanoGPT's GPT at the shapes above, from its own model.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanogpt_model", nanogpt / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_model"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    cfg = module.GPTConfig(
        block_size=SEQ,
        vocab_size=VOCAB,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_embd=D_MODEL,
        dropout=0.0,
        bias=False,
    )
    return module.GPT(cfg)


def pretrain_model():
    from app.config import ModelConfig
    from app.trainer.model.gpt import build_model

    # the config's defaults are the switches off; n_kv_head 0 is multi-head attention, as nanoGPT's
    cfg = ModelConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=N_LAYER, d_model=D_MODEL, n_head=N_HEAD)
    return build_model(cfg)


def nanogpt_loss(model, x, y):
    return model(x, y)[1]


def shipped_pair(nanogpt: Path, batch_list) -> tuple[Trainee, Trainee]:
    """(pretrain, nanoGPT), each with its optimizer as it ships on a CPU."""
    import contextlib
    import io

    from app.config import OptimConfig
    from app.trainer.optimization.optimizer import build_optimizer

    torch.manual_seed(1337)
    ours = pretrain_model().train()
    with contextlib.redirect_stdout(io.StringIO()):  # nanoGPT prints its parameter counts
        theirs = nanogpt_model(nanogpt).train()
        # train.py's call with its defaults: weight decay 0.1, betas (0.9, 0.95); learning rate 1e-3
        their_opt = theirs.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    ours_opt = build_optimizer(ours, OptimConfig(), torch.device("cpu"))
    return Trainee(ours, ours_opt, ours_loss, batch_list), Trainee(
        theirs, their_opt, nanogpt_loss, batch_list
    )


def models_ratio(nanogpt: Path) -> list[str]:
    torch.set_num_threads(1)
    a, b = shipped_pair(nanogpt, batches())
    x, y = a.batches[0]
    with torch.no_grad():
        first = (ours_loss(a.model, x, y).item(), nanogpt_loss(b.model, x, y).item())
    for _ in range(WARMUP):
        a.step()
        b.step()
    ratios = []
    for r in range(ROUNDS):
        if r % 2 == 0:
            ours, theirs = a.timed(STEPS)[1], b.timed(STEPS)[1]
        else:
            theirs, ours = b.timed(STEPS)[1], a.timed(STEPS)[1]
        ratios.append(ours / theirs)
    r = sorted(ratios)
    fused = a.opt.defaults.get("fused")
    return [
        f"shapes: vocab {VOCAB}, {N_LAYER} layers, d{D_MODEL}, {N_HEAD} heads, seq {SEQ}, batch {BATCH}, fp32, "
        f"eager, 1 thread; torch {torch.__version__}; parameters pretrain {n_params(a.model):,}, nanoGPT "
        f"{n_params(b.model):,}; first loss pretrain {first[0]:.4f}, nanoGPT {first[1]:.4f} (ln {VOCAB} = "
        f"{np.log(VOCAB):.4f})",
        f"models (each with its optimizer as it ships: pretrain AdamW fused={fused}, nanoGPT AdamW foreach): "
        f"pretrain / nanoGPT tokens per CPU-second = {statistics.median(r):.3f}x (range {r[0]:.3f}-{r[-1]:.3f}, "
        f"{len(r)} rounds of {STEPS} steps)",
    ]


# ---------------------------------------------------------------- the trainers as processes


def nanogpt_data(work: Path) -> Path:
    """nanoGPT's working directory: data/<DATASET>/ with train.bin, val.bin (uint16) and meta.pkl from the
    embedded corpus `pretrain train` reads, and its configurator.py (train.py reads it from the working
    directory)."""
    from app.config import DataConfig
    from app.data.loader import resolve_data_dir
    from app.data.manifest import Manifest
    from app.data.shards import open_shard

    source = resolve_data_dir(DataConfig(vocab_size=VOCAB), log=lambda _: None)
    manifest = Manifest.load(source)
    data = work / "data" / DATASET
    data.mkdir(parents=True)
    for split in ("train", "val"):
        tokens = np.concatenate([open_shard(source / shard.file) for shard in manifest.split(split)])
        tokens.astype(np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": manifest.vocab_size}))
    (work / "configurator.py").symlink_to(checkout() / "configurator.py")
    return work


def _cpu_seconds(pid: int) -> float:
    """user + system CPU time of a live process, all its threads (from /proc, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_process(cmd: list[str], cwd: Path, marks: tuple[str, str]) -> float:
    """Tokens per CPU-second of a training process between the output lines that start with marks[0] and
    marks[1] (its logs after TRAINER_FROM and TRAINER_FROM + TRAINER_STEPS steps)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    seen: list[float] = []
    tail: list[str] = []
    for line in proc.stdout:
        if line.startswith(marks[len(seen)]):
            seen.append(_cpu_seconds(proc.pid))
            if len(seen) == 2:
                break
        tail = [*tail[-20:], line]
        if time.monotonic() > deadline:
            break
    proc.kill()
    proc.wait()
    if len(seen) < 2:
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ended before its step {TRAINER_FROM + TRAINER_STEPS}:\n{''.join(tail)}"
        )
    return TRAINER_STEPS * BATCH * SEQ / (seen[1] - seen[0])


def pretrain_trainer(work: Path, round_: int) -> float:
    """`pretrain train` at the shapes above with the switches off (the AdamW recipe), as a user runs it."""
    settings = {
        "model.n_layer": N_LAYER,
        "model.d_model": D_MODEL,
        "model.n_head": N_HEAD,
        "model.n_kv_head": 0,
        "model.seq_len": SEQ,
        "model.tie_embeddings": "true",
        "model.mlp": "swiglu",
        "model.qk_norm": "false",
        "model.embed_norm": "false",
        "model.zero_init": "false",
        "model.logit_softcap": 0,
        "model.value_embeds": 0,
        "model.x0_skip": "false",
        "model.unet_skips": "false",
        "data.vocab_size": VOCAB,
        "data.align_to_documents": "false",
        "optim.name": "adamw",
        "optim.matrix_lr": 0,
        "optim.embedding_lr": 0,
        "optim.head_lr": 0,
        "schedule.name": "cosine",
        "train.micro_batch_size": BATCH,
        "train.batch_tokens": 0,
        "train.eval_every": 0,
        "train.log_every": 10,
        "train.device": "cpu",
        "checkpoint.every_steps": 0,
        "checkpoint.every_minutes": 0,
    }
    run = work / f"pretrain-run-{round_}"  # a new run dir each round: the killed run's lease stays behind
    cmd = [sys.executable, "-m", "app.cli", "train", "--preset", "tiny", "--out", str(run)]
    cmd += ["--max-steps", str(TRAINER_FROM + TRAINER_STEPS + 10)]
    cmd += [a for key, value in settings.items() for a in ("--set", f"{key}={value}")]
    marks = (f"step {TRAINER_FROM}/", f"step {TRAINER_FROM + TRAINER_STEPS}/")
    return timed_process(cmd, ROOT, marks)


def nanogpt_trainer(work: Path) -> float:
    """nanoGPT's train.py at the shapes above, as its README runs it on a CPU (its iteration i is step
    i + 1: the log after TRAINER_FROM steps is `iter TRAINER_FROM - 1`, so both windows hold the same steps
    after the same warm-up; log_interval 1 prints every step, its default)."""
    settings = {
        "dataset": DATASET,
        "device": "cpu",
        "dtype": "float32",
        "compile": False,
        "n_layer": N_LAYER,
        "n_head": N_HEAD,
        "n_embd": D_MODEL,
        "block_size": SEQ,
        "batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "dropout": 0.0,
        "bias": False,
        "learning_rate": 1e-3,
        "max_iters": TRAINER_FROM + TRAINER_STEPS + 10,
        "lr_decay_iters": TRAINER_FROM + TRAINER_STEPS + 10,
        "warmup_iters": 10,
        "eval_interval": 1_000_000,  # its one eval at iteration 0, before the window
        "eval_iters": 1,
        "always_save_checkpoint": False,
        "out_dir": str(work / "nanogpt-out"),
    }
    cmd = [sys.executable, str(checkout() / "train.py")]
    cmd += [f"--{key}={value}" for key, value in settings.items()]
    marks = (f"iter {TRAINER_FROM - 1}:", f"iter {TRAINER_FROM + TRAINER_STEPS - 1}:")
    return timed_process(cmd, work, marks)


def trainers_ratio() -> list[str]:
    if TRAINER_ROUNDS <= 0:
        return []
    ratios, ours, theirs = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = nanogpt_data(Path(tmp))
        for r in range(TRAINER_ROUNDS):
            if r % 2 == 0:
                a = pretrain_trainer(work, r)
                b = nanogpt_trainer(work)
            else:
                b = nanogpt_trainer(work)
                a = pretrain_trainer(work, r)
            ours.append(a)
            theirs.append(b)
            ratios.append(a / b)
    r = sorted(ratios)
    median = statistics.median(r)
    return [
        f"trainers (pretrain train / nanoGPT train.py, as each ships, fresh processes, OMP_NUM_THREADS=1): "
        f"{median:.3f}x tokens per CPU-second (range {r[0]:.3f}-{r[-1]:.3f}, {len(r)} rounds of steps "
        f"{TRAINER_FROM + 1}-{TRAINER_FROM + TRAINER_STEPS}); pretrain {statistics.median(ours):,.0f}, nanoGPT "
        f"{statistics.median(theirs):,.0f} tokens per CPU-second; goal >= 0.95: "
        f"{'meets' if median >= 0.95 else 'BELOW'}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
    ]


# ---------------------------------------------------------------- the benchmark


def profile() -> list[str]:
    from benchmarks.bench_peer import profile_pair

    torch.set_num_threads(1)
    a, b = shipped_pair(checkout(), batches())
    return profile_pair(a, b, ("pretrain", "nanoGPT"), "each model with its optimizer as it ships")


def run() -> list[str]:
    nanogpt = checkout()
    if nanogpt is None:
        where = (
            f"{NANOGPT_DIR} has no nanoGPT model.py, train.py and configurator.py" if NANOGPT_DIR else "unset"
        )
        return [
            f"skipped: NANOGPT_DIR is {where}; give it a checkout (git clone "
            "https://github.com/karpathy/nanoGPT /tmp/nanoGPT; NANOGPT_DIR=/tmp/nanoGPT python -m benchmarks nanogpt)"
        ]
    return models_ratio(nanogpt) + trainers_ratio()


if __name__ == "__main__":
    for line in profile() if "--profile" in sys.argv[1:] else run():
        print(line, flush=True)
