"""The three PNG plots of `pretrain export` (matplotlib, imported only here: the Agg backend, no display)."""

from __future__ import annotations

import math
from pathlib import Path


def _series(rows: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get("kind") == kind and isinstance(r.get(key), int | float)]
    return [x for x, _ in pts], [float(y) for _, y in pts]  # bool too, as in the CSV


def write_plots(out: Path, rows: list[dict], title: str, grad_clip: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    def save(fig, ax, name: str, what: str, ylabel: str, xs: list) -> None:
        if not xs:
            ax.text(0.5, 0.5, "no data logged", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{title}: {what}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    sx, sy = _series(rows, "train", "loss")
    vx, vy = _series(rows, "eval", "val_loss")
    ax.plot(sx, sy, lw=1, alpha=0.8, label="train loss")
    if vx:
        ax.plot(vx, vy, "o-", lw=1.5, ms=4, label="val loss")
    spiked = _series([r for r in rows if r.get("spike")], "train", "loss")
    spikes = [(x, y) for x, y in zip(*spiked, strict=True) if math.isfinite(y)]
    if spikes:
        ax.scatter(*zip(*spikes, strict=True), marker="x", color="red", zorder=3, label="loss spike")
    if sx or vx:
        ax.legend()
    save(fig, ax, "loss-curve.png", "loss", "loss (nats/token)", sx + vx)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    gx, gy = _series(rows, "train", "grad_norm")
    ax.plot(gx, gy, lw=1, label="grad norm (before clipping)")
    if grad_clip and gx:
        ax.axhline(grad_clip, color="gray", ls="--", lw=1, label=f"clip {grad_clip:g}")
    if gy and min(gy) > 0 and max(gy) / min(gy) > 100:
        ax.set_yscale("log")
    if gx:
        ax.legend()
    save(fig, ax, "gradnorm-curve.png", "gradient norm", "global grad norm", gx)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    tx, ty = _series(rows, "train", "tokens_per_second")
    ax.plot(tx, ty, lw=1, color="tab:blue", label="tokens/s")
    mx, my = _series(rows, "train", "mfu")
    if mx:
        ax2 = ax.twinx()
        ax2.plot(mx, [v * 100 for v in my], lw=1, color="tab:orange", label="MFU")
        ax2.set(ylabel="MFU (%)", ylim=(0, None))
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right")
    save(fig, ax, "throughput.png", "throughput", "tokens / second", tx)
