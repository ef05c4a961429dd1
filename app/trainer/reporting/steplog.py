"""The numbers each step leaves on the device, read on the host only now and then.

A GPU runs ahead of the host only while nothing asks it for a number: every `.item()` drains its queue
and the next step's kernels start late. So a step never reads a value back: it appends one row of device
tensors here, and the loop reads all rows in one all-reduce and one copy when it needs them
(train.log_every, an eval, a save, the stop). A non-finite step is skipped on the device
(app/trainer/optimization/optimizer.py step_unless), so reading late changes nothing but when the log line appears.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.trainer.parallel.distributed import DistEnv, all_reduce_sum


@dataclass
class StepRow:
    """One optimizer step as read back on the host."""

    step: int  # 1 = the first
    lr: float
    loss: float  # mean over micro-batches and ranks
    grad_norm: float  # global, before clipping
    finite: bool  # the update was applied (False: skipped on the device)
    loop_losses: list[float] = field(default_factory=list)  # looped models: per read-out, mean over ranks


class StepLog:
    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.rows: list[torch.Tensor] = []  # [loss, loop losses..., grad norm, finite] per step
        self.steps: list[tuple[int, float]] = []  # (step, lr): host values, no sync needed

    def add(self, step: int, lr: float, losses: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """`losses`: [loss, loop losses...] of this rank, averaged over its micro-batches."""
        finite = torch.isfinite(grad_norm)
        self.rows.append(torch.cat([losses.float(), grad_norm.float().view(1), finite.float().view(1)]))
        self.steps.append((step, lr))

    def discard(self, step: int) -> None:
        """Forget `step`'s row (a step retried after an out-of-memory error)."""
        if self.steps and self.steps[-1][0] == step:
            self.rows.pop()
            self.steps.pop()

    def read(self) -> list[StepRow]:
        """Collective when distributed: every rank calls it at the same steps."""
        if not self.rows:
            return []
        rows = torch.stack(self.rows)
        mean = all_reduce_sum(rows[:, :-2].contiguous(), self.env) / self.env.world_size  # the norm is global
        values = torch.cat([mean, rows[:, -2:]], dim=1).tolist()
        out = []
        for (step, lr), row in zip(self.steps, values, strict=True):
            loss, *loop_losses, grad_norm, finite = row
            out.append(StepRow(step, lr, loss, grad_norm, bool(finite), loop_losses))
        self.rows = []
        self.steps = []
        return out
