"""One optimizer step with no host sync, and the per-step numbers it leaves on the device.

A GPU runs ahead of the host only while nothing asks it for a number: every `.item()` drains its queue
and the next step's kernels start late. So the step never reads a value back. The loss, gradient norm,
finiteness and per-loop losses of each step stay on the device in a StepLog; the loop reads them in one
transfer when it needs them (train.log_every, evaluation, a save, the stop), and only then do the
divergence guard, the spike detector and the log see them, step by step and in order, exactly as if
each had been read at once. A non-finite step is skipped on the device (optim.step_unless).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from app.config import TrainConfig
from app.trainer.optim import step_unless
from app.trainer.parallel import DistEnv
from app.trainer.spikes import SpikeDetector
from app.trainer.stopping import BadSteps


@dataclass
class StepNumbers:
    """What one step left in the StepLog, read back on the host."""

    step: int  # the optimizer step this was (1 = the first)
    loss: float  # mean over micro-batches and ranks
    grad_norm: float  # global, before clipping
    finite: bool  # the update was applied (False: skipped on the device)
    loop_losses: list[float] = field(default_factory=list)  # looped models: per read-out, mean over ranks


class StepLog:
    """Per-step numbers kept on the device until `read()` (one all-reduce and one copy for all of them)."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self._steps: list[int] = []
        self._rows: list[torch.Tensor] = []  # [loss, loop losses..., grad norm, finite]

    def record(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, finite: torch.Tensor, loops: list
    ) -> None:
        self._steps.append(step)
        self._rows.append(torch.stack([loss, *loops, grad_norm, finite]).float())

    def __len__(self) -> int:
        return len(self._rows)

    def read(self) -> list[StepNumbers]:
        """Collective when distributed: every rank calls it at the same steps."""
        if not self._rows:
            return []
        rows = torch.stack(self._rows)
        per_rank = rows.shape[1] - 2  # the loss and loop losses are this rank's; the norm is global
        if self.env.distributed:
            mean = rows[:, :per_rank].contiguous()
            dist.all_reduce(mean, op=dist.ReduceOp.SUM)
            rows = torch.cat([mean / self.env.world_size, rows[:, per_rank:]], dim=1)
        out = [
            StepNumbers(step, r[0], r[-2], bool(r[-1]), r[1:per_rank])
            for step, r in zip(self._steps, rows.tolist(), strict=True)
        ]
        self._steps, self._rows = [], []
        return out


class StepReader:
    """Reads the step log when the loop asks (every train.log_every steps, before a save, at the stop) and
    hands each step, in order, to the divergence guard, the spike detector and the reporter: the host side
    of the guards whose device side (the skipped update) already happened."""

    def __init__(
        self, log: StepLog, bad_steps: BadSteps, spikes: SpikeDetector, report, cfg: TrainConfig
    ) -> None:
        self.log, self.bad_steps, self.spikes, self.report, self.cfg = log, bad_steps, spikes, report, cfg
        self.step_seconds = 0.0  # wall time per step, a moving average over reads (the device's pace)
        self._noted: dict[int, tuple[float, bool]] = {}  # step -> (LR, spike drill) until read
        self._data_wait = 0.0

    def note(self, step: int, lr: float, injected: bool) -> None:
        self._noted[step] = (lr, injected)

    def waited(self, seconds: float) -> None:
        self._data_wait += seconds

    def read(self, step: int, tokens: int, tokens_per_step: int, planned_end_in) -> tuple[bool, bool]:
        """Collective. (bad, spike) of the last step read; `step`/`tokens`: where the loop is now."""
        rows = self.log.read()
        if not rows:
            return False, False
        tps, seconds = self.report.window()
        self.step_seconds = seconds if self.step_seconds == 0 else 0.5 * (self.step_seconds + seconds)
        wait, self._data_wait = self._data_wait / len(rows), 0.0
        bad = spike = False
        for r in rows:
            bad, spike = self._account(r)
            if r.step % self.cfg.log_every == 0 or spike or bad:
                lr, injected = self._noted[r.step]
                m = {**r.__dict__, "lr": lr, "step_seconds": seconds, "data_wait_seconds": wait}
                m.update(spike=spike, bad=bad, injected=injected)
                self.report.train(r.step, tokens - (step - r.step) * tokens_per_step, m, tps, planned_end_in)
        self._noted.clear()
        return bad, spike

    def _account(self, r: StepNumbers) -> tuple[bool, bool]:
        bad = self.bad_steps.update(r.finite)  # the device skipped this update exactly when not finite
        if bad:
            self.report.warn(
                f"step {r.step}: loss {r.loss} / gradient norm {r.grad_norm} is not finite: update skipped "
                f"({self.bad_steps.in_a_row} in a row; the run stops at train.max_bad_steps={self.bad_steps.max_bad})"
            )
        spike = not bad and self.spikes.update(r.loss)
        if spike:
            skipped = " (update skipped)" if self.cfg.skip_spike_updates else ""
            self.report.log(
                f"loss spike at step {r.step}: {r.loss:.3f} vs moving average {self.spikes.avg:.3f}{skipped}"
            )
        return bad, spike


class PhaseTimer:
    """Wall time per phase of a step, for `pretrain bench`: synchronizes the device at every mark, so it
    is never used while training."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        self._sync()
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def global_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` (0 = no clipping) and return the global norm before clipping, on the device."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a replicated DTensor


class TrainStep:
    """Forward/backward over `accum` micro-batches, clip, then the update unless the gradient is not
    finite. Nothing here reads a device value on the host (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        batches,
        accum: int,
        autocast,
        env: DistEnv,
        grad_clip: float,
        log: StepLog,
    ) -> None:
        self.model, self.optimizer, self.batches, self.accum = model, optimizer, batches, accum
        self.autocast, self.env, self.grad_clip, self.log = autocast, env, grad_clip, log
        # DDP all-reduces in the last micro-batch's backward; FSDP2 reduce-scatters every micro-batch
        self.ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)

    def __call__(
        self,
        step: int,
        replace_batch: Callable | None = None,
        decide_skip: Callable[[], float] | None = None,
        timer: PhaseTimer | None = None,
    ) -> float:
        """Run optimizer step number `step` (1-based); returns the seconds the host waited for data.
        `replace_batch(x, y, micro)` swaps a batch (the spike drill); `decide_skip()` reads the log and
        decides the skip on the host instead (train.skip_spike_updates); `timer` splits the step into
        data, forward_backward, communication (DDP, then run unoverlapped) and optimizer."""
        loss_sum = loop_sums = None
        data_wait = 0.0
        separate_comm = timer is not None and self.ddp and self.env.distributed
        if timer:
            timer.start()
        for micro in range(self.accum):
            t = time.perf_counter()
            x, y = self.batches.next()
            if replace_batch is not None:
                x, y = replace_batch(x, y, micro)
            data_wait += time.perf_counter() - t
            if timer:
                timer.mark("data")
            last = micro == self.accum - 1 and not separate_comm
            sync = contextlib.nullcontext() if last or not self.ddp else self.model.no_sync()
            with sync, self.autocast:
                out = self.model(x, y)
            (out.loss / self.accum).backward()
            loss = out.loss.detach()
            loss_sum = loss if loss_sum is None else loss_sum + loss
            if out.loop_losses:
                loop_sums = (
                    list(out.loop_losses)
                    if loop_sums is None
                    else [a + b for a, b in zip(loop_sums, out.loop_losses, strict=True)]
                )
            if timer:
                timer.mark("forward_backward")
        if separate_comm:
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= self.env.world_size
            timer.mark("communication")
        norm = global_grad_norm(self.model, self.grad_clip)
        finite = torch.isfinite(norm)  # the norm is global, so every rank takes the same decision
        loops = [v / self.accum for v in loop_sums or []]
        self.log.record(step, loss_sum / self.accum, norm, finite, loops)
        skip = (~finite).float() if decide_skip is None else torch.tensor(decide_skip(), device=norm.device)
        step_unless(self.optimizer, skip)
        self.optimizer.zero_grad(set_to_none=True)
        if timer:
            timer.mark("optimizer")
        return data_wait
