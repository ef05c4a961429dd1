"""Deep supervision of the looped model: how the per-loop losses become one objective, and the read-out
metrics. The same functions serve the model (tensors, in the graph) and the report (floats, for logging).

With R read-outs (one after every recurrence) whose cross-entropies are L_0 .. L_{R-1}:

    weights      w_i = b^i / (b^0 + ... + b^{R-1})        b = model.loop.supervision_weight_base
                 (b = 1: equal weights; b > 1: later loops count more), or
                 w_i = loss_weights[i] / sum(loss_weights)   when model.loop.loss_weights is set (override)
    supervision  S = sum_i w_i L_i
    improvement  I = 1/(R-1) * sum_{i=1..R-1} (1 - L_i / sg(L_{i-1}))
                 the mean relative gain of each read-out over the one before it; sg() = no gradient, so
                 the previous read-out is a fixed bar and the term never pays for making it worse
    objective    loss = S - s * I                          s = model.loop.improvement_reward_scale

The gradient of -s * I is s/(R-1) * sum_{i>=1} grad(L_i) / L_{i-1}: extra weight on every later read-out,
larger where the previous read-out is already good. Metrics: refinement = (L_0 - L_{R-1}) / L_0 and
monotone = L_0 > L_1 > ... > L_{R-1} (the order a refining model shows). docs/recipes.md has the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.config import LoopConfig


def loop_weights(loop: LoopConfig, n: int) -> list[float]:
    """Normalised weights of n read-outs: the explicit loss_weights, else geometric in the loop index."""
    raw = (
        list(loop.loss_weights) if loop.loss_weights else [loop.supervision_weight_base**i for i in range(n)]
    )
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
