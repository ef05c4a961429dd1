"""Deep supervision of the looped model: how the per-loop losses L_0 .. L_{R-1} of R read-outs become one
objective, and the read-out metrics. The same functions serve the model (tensors, in the graph) and the
report (floats, for logging). docs/recipes.md ("Deep supervision") derives the terms and their gradient:

    loss = S - s * I     S = sum_i w_i L_i     I = 1/(R-1) * sum_{i=1..R-1} (1 - L_i / sg(L_{i-1}))

w = loop_weights, s = model.loop.improvement_reward_scale, sg() = no gradient: the previous read-out is a
fixed bar, so I never pays for making it worse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.config import LoopConfig, ModelConfig


def readouts_and_blocks_run(m: ModelConfig) -> tuple[int, int]:
    """Per training forward: the read-outs (one after every recurrence under deep supervision, else one)
    and the blocks run (each extra read-out passes through the coda again)."""
    readouts = m.loop.recurrence if m.looped and m.loop.deep_supervision else 1
    return readouts, m.effective_depth + (readouts - 1) * m.loop.coda


def loop_weights(loop: LoopConfig, n: int) -> list[float]:
    """Normalised weights of n read-outs: the explicit loss_weights, else geometric in the loop index."""
    raw = list(loop.loss_weights) or [loop.supervision_weight_base**i for i in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def _sg(x: Any) -> Any:
    return x.detach() if hasattr(x, "detach") else x


@dataclass
class Terms:
    total: Any  # the objective (tensor in the model, float in the report)
    supervision: Any
    improvement: Any


def objective(losses: list, weights: list[float], scale: float) -> Terms:
    """S - s * I for per-loop losses (tensors or floats), as in the module docstring."""
    supervision = sum(w * li for w, li in zip(weights, losses, strict=True))
    n = len(losses)
    if n < 2:
        return Terms(supervision, supervision, 0.0)
    improvement = sum(1 - losses[i] / _sg(losses[i - 1]) for i in range(1, n)) / (n - 1)
    return Terms(supervision - scale * improvement if scale else supervision, supervision, improvement)


def refinement(losses: list[float]) -> float:
    """(L_0 - L_last) / L_0: the share of the first read-out's loss the later loops remove."""
    return (losses[0] - losses[-1]) / losses[0]


def monotone(losses: list[float]) -> bool:
    """True when every loop lowers the loss: L_0 > L_1 > ... > L_last."""
    return all(a > b for a, b in zip(losses, losses[1:], strict=False))
