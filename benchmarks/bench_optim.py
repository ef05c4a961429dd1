"""Muon vs AdamW on the embedded Shakespeare (character level), CPU: the same model, seed, data order,
schedule and token budget. Reports the tokens each run needs to reach the best AdamW run's final
validation loss and the final validation loss at equal tokens, as ratios to it, over a small LR sweep
of each: optim.lr for AdamW, optim.matrix_lr for Muon (torch's match_rms_adamw scaling, so the values
read like AdamW LRs). About 7 x 300 steps: a few minutes per run on 2 busy cores.

The model is small so the sweep fits a few minutes on 2 cores: d128, 4 layers, seq 128, 16 sequences
per step (2048 tokens), cosine schedule with 25 warmup steps, 300 steps. Muon acts on the block matrices,
which hold almost all the parameters at a character vocabulary.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from app.data.loader import TrainLoader, resolve_data_dir, val_batches
from app.data.manifest import Manifest
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer, set_lr
from app.trainer.optimization.schedule import lr_at
from benchmarks.bench_quality import tiny_before_33

STEPS = 300
EVAL_EVERY = 25
EVAL_BATCHES = 8
SEED = 1337
MODEL = [
    "data.tokenizer=char",
    "model.d_model=128",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.n_layer=4",
    "model.seq_len=128",
    "train.micro_batch_size=16",
    "optim.lr=0.002",
    "optim.min_lr=0.0002",
    "schedule.warmup_steps=25",
    f"train.max_steps={STEPS}",
]
ADAMW_LRS = (0.002, 0.004, 0.008)  # the tiny preset uses 0.002
MATRIX_LRS = (0.002, 0.004, 0.008, 0.016)  # the other groups stay at optim.lr = 0.002


def _config(extra: list[str]):
    cfg = tiny_before_33([*MODEL, *extra])  # AdamW and Muon on the AdamW recipe's model and data
    data_dir = resolve_data_dir(cfg.data, log=lambda m: None)
    cfg.model.vocab_size = Manifest.load(data_dir).vocab_size
    return cfg, data_dir


@torch.no_grad()
def _val_loss(model, cfg, data_dir) -> float:
    model.eval()
    total, n = 0.0, 0
    for x, y in val_batches(data_dir, cfg.model.seq_len, cfg.train.micro_batch_size, EVAL_BATCHES, 0, 1):
        total += float(model(x, y).loss) * x.size(0)
        n += x.size(0)
    model.train()
    return total / n


def curve(extra: list[str]) -> tuple[list[tuple[int, float]], float]:
    """[(tokens, val loss)] every EVAL_EVERY steps, and seconds per step."""
    cfg, data_dir = _config(extra)
    torch.manual_seed(SEED)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    loader = TrainLoader(data_dir, cfg.model.seq_len, cfg.train.micro_batch_size, 0, 1, SEED)
    tokens_per_step = cfg.train.micro_batch_size * cfg.model.seq_len
    points = [(0, _val_loss(model, cfg, data_dir))]
    start = time.perf_counter()
    for step in range(STEPS):
        set_lr(opt, lr_at(step, cfg.schedule, cfg.optim, STEPS))
        x, y = loader.next()
        model(x, y).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % EVAL_EVERY == 0:
            points.append(((step + 1) * tokens_per_step, _val_loss(model, cfg, data_dir)))
    secs = (time.perf_counter() - start) / STEPS
    print(
        f"   ({' '.join(extra)}: val loss {points[-1][1]:.4f}, {secs:.2f} s/step)",
        file=sys.stderr,
        flush=True,
    )
    return points, secs


def tokens_to_reach(points: list[tuple[int, float]], target: float) -> float:
    """Tokens at which the val-loss curve first reaches `target` (linear between evals), inf if never."""
    for (t0, l0), (t1, l1) in zip(points, points[1:], strict=False):
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1) if l0 > target else t0
    return math.inf


def run() -> list[str]:
    adamw = {lr: curve(["optim.name=adamw", f"optim.lr={lr}", f"optim.min_lr={lr / 10}"]) for lr in ADAMW_LRS}
    best_lr = min(adamw, key=lambda lr: adamw[lr][0][-1][1])
    base = adamw[best_lr][0]
    target, budget = base[-1][1], base[-1][0]
    lines = [
        f"model d128 x 4 layers, char vocab, {budget:,} tokens ({STEPS} steps), seed {SEED}; target = the best "
        f"AdamW's final val loss {target:.4f} (lr {best_lr:g})",
        f"{'run':<28} {'final val':>9} {'ratio':>6} {'tokens to target':>17} {'ratio':>6} {'s/step':>7}",
    ]
    runs = [(f"adamw lr {lr:g}", *adamw[lr]) for lr in ADAMW_LRS]
    runs += [
        (f"muon matrix_lr {m:g}", *curve(["optim.name=muon", f"optim.matrix_lr={m}"])) for m in MATRIX_LRS
    ]
    for name, pts, secs in runs:
        need, final = tokens_to_reach(pts, target), pts[-1][1]
        reach = f"{need:>17,.0f}" if math.isfinite(need) else f"{'not reached':>17}"
        lines.append(
            f"{name:<28} {final:>9.4f} {final / target:>6.3f} {reach} {need / budget:>6.3f} {secs:>7.3f}"
        )
    name, pts, _ = min((r for r in runs if r[0].startswith("muon")), key=lambda r: r[1][-1][1])
    final, need = pts[-1][1], tokens_to_reach(pts, target)
    verdict = "Muon wins" if final < target else "Muon does not win at this scale"
    lines.append(
        f"best Muon ({name}): final val loss {final / target:.3f}x the best AdamW's at equal tokens, "
        f"{need / budget:.3f}x the tokens to reach it: {verdict}"
    )
    return lines
