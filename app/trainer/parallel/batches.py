"""The micro-batches a run trains on: the loader (its position goes into every checkpoint), the spike
drill (drill.spike_at_step substitutes batches here, so the step knows nothing of it) and the prefetch
thread that moves them to the device; and the micro-batch x accumulation layout they are cut to, which an
out-of-memory error in a process's first steps halves under train.micro_batch_size=auto (`fit`: the
loop runs each step through it and knows nothing of the retry; docs/architecture.md, "The training step").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from app.config import Config
from app.data.loader import Prefetcher, TrainLoader
from app.trainer.parallel import layout
from app.trainer.parallel.distributed import DistEnv
from app.trainer.parallel.parallelize import forget_compiled_graphs
from app.trainer.parallel.runtime import grad_accum_steps
from app.trainer.stopping.spikes import SpikeDrill

OOM_RETRY_STEPS = 10  # an out-of-memory error later than this is not the layout's: it is raised


class TrainBatches:
    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        data_dir: Path,
        device: torch.device,
        *,
        auto_micro_batch: bool,
        run_dir: Path,
        log: Callable[[str], None],
        warn: Callable[[str], None],
    ) -> None:
        """`auto_micro_batch`: the micro-batch was chosen by train.micro_batch_size=auto, so an early
        out-of-memory error may halve it (recorded in `run_dir` for the next start)."""
        self.cfg = cfg
        self.env = env
        self.data_dir = data_dir
        self.device = device
        self.auto_micro_batch = auto_micro_batch
        self.run_dir = run_dir
        self.log = log
        self.warn = warn
        self.accum = grad_accum_steps(cfg, env.world_size)
        self.loader = self._new_loader()
        self.drill: SpikeDrill | None = None
        self.prefetcher: Prefetcher | None = None
        self.first_step = 0

    @property
    def tokens_per_step(self) -> int:
        micro_batch = self.cfg.train.micro_batch_size
        return self.accum * micro_batch * self.cfg.model.seq_len * self.env.world_size

    def _new_loader(self) -> TrainLoader:
        cfg = self.cfg
        return TrainLoader(
            data_dir=self.data_dir,
            seq_len=cfg.model.seq_len,
            micro_batch_size=cfg.train.micro_batch_size,
            rank=self.env.rank,
            world_size=self.env.world_size,
            seed=cfg.train.seed,
            vocab_size=cfg.model.vocab_size,
            align_to_documents=cfg.data.align_to_documents,
        )

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def start(self, step: int) -> None:
        """Start reading ahead from the loader's position (after a resume set it); `step`: the optimizer
        step this process starts from."""
        self.first_step = step
        source = self.loader
        drill = self.cfg.drill
        self.drill = None
        if drill.spike_at_step:
            vocab_size = self.cfg.model.vocab_size
            self.drill = SpikeDrill(source, drill.spike_at_step, drill.spike_batches, self.accum, vocab_size)
            source = self.drill
        self.prefetcher = Prefetcher(source, self.device, self.cfg.train.prefetch)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prefetcher.next()

    @property
    def micro_steps(self) -> int:
        """Micro-batches taken from the loader so far (its position)."""
        return self.loader.state.micro_steps

    def injected(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based) trained on the spike drill's batches."""
        return self.drill is not None and self.drill.covers(step - 1)

    def take_wait_seconds(self) -> float:
        """Seconds the loop waited for a batch since the last call."""
        seconds = self.prefetcher.wait_seconds
        self.prefetcher.wait_seconds = 0.0
        return seconds

    def fit(self, run_step: Callable[[], None], step: int, undo: Callable[[], None]) -> None:
        """Optimizer step `step` (0-based): `run_step` takes its micro-batches from here. Under
        train.micro_batch_size=auto an out-of-memory error in this process's first steps halves the
        micro-batch and runs the step again on the same samples (`undo` first drops what the failed try
        left: its gradients, its step-log row); with several ranks the retry is a restart (RestartSmaller,
        exit 145). Any other out-of-memory error is raised."""
        first_micro = self.micro_steps
        while True:
            try:
                run_step()
                return
            except torch.OutOfMemoryError as error:
                self._halve(error, step, first_micro)  # raises unless it is the layout's
                undo()

    def _halve(self, error: torch.OutOfMemoryError, step: int, first_micro: int) -> None:
        """Out of memory in this process's first steps under train.micro_batch_size=auto: halve the
        micro-batch (recorded in the run dir for the next start), reading the same samples in the same order
        from micro-batch `first_micro` on. Raises `error` otherwise; with several ranks, whose collectives
        cannot be unwound, RestartSmaller (exit 145)."""
        train = self.cfg.train
        early = self.auto_micro_batch and step < self.first_step + OOM_RETRY_STEPS
        smaller = layout.halve_after_oom(self.cfg, self.env, self.run_dir, self.warn, step) if early else 0
        if not smaller:
            raise error
        forget_compiled_graphs()  # the old size's graphs never run again
        old = train.micro_batch_size
        self.prefetcher.close()
        train.micro_batch_size = smaller
        self.accum = old * self.accum // smaller
        self.loader = self._new_loader()
        self.loader.state.micro_steps = first_micro * old // smaller  # the same samples next
        self.start(self.first_step)
        self.log(
            f"out of memory at micro-batch {old} (step {step + 1}): retrying it at micro-batch {smaller} "
            f"x accumulation {self.accum}, same data"
        )

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
