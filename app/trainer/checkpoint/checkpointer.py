"""The training loop's one door to checkpoints: which checkpoint a start resumes, loading it, saving when
a save is due (checkpoint.every_steps, checkpoint.every_minutes as the ranks agreed), the save for a stop,
and waiting for or abandoning a save that runs in the background. Every method is collective unless it
says otherwise: all ranks call it at the same steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from app.config import Config, config_from_dict
from app.errors import UserError
from app.trainer.checkpoint.state import TrainerState, load_into, set_rng_state
from app.trainer.checkpoint.store import (
    CheckpointInfo,
    Shared,
    all_unusable,
    check_compatible,
    describe,
    load_model_shapes,
    load_rng_state,
    load_trainer_state,
    resolve,
    resolve_latest,
    set_aside_newer,
    step_of,
    summary,
)
from app.trainer.checkpoint.writer import CheckpointWriter, SaveResult
from app.trainer.optimization.schedule import DecayPlan, resume_change
from app.trainer.parallel.distributed import DistEnv
from app.trainer.parallel.parallelize import unwrap

# Model keys under which the same weights compute another function, with or without another shape: the
# shape keys are here too, so that the refusal names the key (store.check_compatible still catches a
# changed vocabulary and checkpoints without a config). Not here: what only the init reads (zero_init,
# init_std), the context (seq_len, rope_base) and the looped model's training objective.
ARCHITECTURE_KEYS = (
    "mlp",
    "qk_norm",
    "attn_scale",
    "parameter_free_norms",
    "embed_norm",
    "logit_softcap",
    "value_embeds",
    "x0_skip",
    "unet_skips",
    "tie_embeddings",
    "n_layer",
    "d_model",
    "n_head",
    "n_kv_head",
    "d_ff",
)
# keys whose 0 means "derived from the others": compared as the value the model is built with
DERIVED = {"n_kv_head": "kv_heads", "d_ff": "ffn_dim"}

# What the loop gives a save besides the weights and the optimizer: the trainer's state and the
# meta.json fields that change during a run (tokens, val loss, spend).
Snapshot = Callable[[], tuple[TrainerState, dict]]


class Checkpointer:
    """One per run, built before the model (a start must know what it resumes to size its batches)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Config,
        env: DistEnv,
        *,
        resume: str,
        data: dict,
        files: list[Path],
        expect_bytes: int,
        log: Callable[[str], None],
        warn: Callable[[str], None],
        on_commit: Callable[[SaveResult], None],
        on_save: Callable[[str], None],
    ) -> None:
        """`resume`: --resume (auto | never | a path). `data`: what meta.json says of the data, `files`:
        copied into every checkpoint (the tokenizer: a checkpoint dir alone is enough to sample or export).
        `expect_bytes`: the estimated size of one checkpoint, checked against the free space by `load`.
        `on_commit(result)`: a save is committed. `on_save(state)`: "saving" while the loop stands still for
        a save, "running" after it (the heartbeat)."""
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.env = env
        self.resume = resume
        self.data = data
        self.files = files
        self.log = log
        self.warn = warn
        self.on_commit = on_commit
        self.on_save = on_save
        self.expect_bytes = expect_bytes
        self.writer: CheckpointWriter | None = None  # made by load(), when there is something to save
        self.resume_from: CheckpointInfo | None = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.start_step = 0  # the step this process started from
        self.last_saved_step = -1  # the last save asked for (-1: none in this run dir's history we know)
        self.last_save_time = time.monotonic()
        self.committed: SaveResult | None = None  # the last committed save of this process

    # ------------------------------------------------------------ start

    def find(self) -> CheckpointInfo | None:
        """The checkpoint this start resumes, or None. `--resume auto`: the newest of the run dir that
        verifies (rank 0 sets newer, unusable step dirs aside so they shadow nothing), refused when every
        one is unusable (`_latest`); `never`: None; else a run dir or a step dir. The ranks share the
        sha256 checks, each hashing 1/world of the files, and agree on the answer."""
        env = self.env
        if self.resume == "never":
            return None
        verify = self.cfg.checkpoint.verify
        shared = Shared(env.rank, env.world_size, env.all_true) if env.distributed else None
        if self.resume == "auto":
            info = self._latest(verify, shared)
            if env.is_rank0:
                set_aside_newer(self.run_dir, info.step if info else -1, warn=self.warn)
        else:
            info = resolve(self.resume, verify, self.warn, shared)
        if info is not None and info.step == 0:
            # older versions saved step 0: nothing learned, and an optimizer state that shifts AdamW's steps
            self.warn(f"ignoring {info.path}: a step-0 checkpoint holds nothing a fresh start does not")
            return None
        if info is not None:
            check_same_architecture(info, self.cfg)
        self.resume_from = info
        return info

    def _latest(self, verify: str, shared: Shared | None) -> CheckpointInfo | None:
        """`--resume auto`: the newest checkpoint of the run dir that verifies, falling back past damaged
        ones with a warning each. When none past step 0 does, yet some exist, the start is refused in one
        line (a fresh start would bury that run; step 0 holds nothing learned, so a run dir with no
        checkpoint, or only a step-0 one, still starts). Every rank decides from the same agreed checks."""
        warnings: list[str] = []
        skipped: list[tuple[Path, str]] = []
        try:
            info = resolve_latest(self.run_dir, verify, warnings.append, shared, skipped=skipped)
        except UserError:  # a checkpoint of another format, refused in its own line: say what came before
            for line in warnings:
                self.warn(line)
            raise
        lost = [(path, why) for path, why in skipped if step_of(path) > 0]
        if lost and (info is None or info.step == 0):
            raise all_unusable(self.run_dir, lost)
        for line in warnings:
            self.warn(line)
        return info

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainerState:
        """Restore `model` and `optimizer` in place from the checkpoint `find` chose and return its trainer
        state (a fresh one when there is none); later saves write these two objects. Collective: it builds
        the writer's process group; the weights are read without communication, every rank only the boxes
        it holds, whatever world size and mode wrote them."""
        self.model = model
        self.optimizer = optimizer
        info = self.resume_from
        state = TrainerState()
        if info is not None:
            self._restore_weights(info)
            state = TrainerState(**load_trainer_state(info))
            self.start_step = info.step
            if self.resume == "auto":  # the checkpoint is this run dir's own
                self.last_saved_step = info.step
            self.log(f"resumed from {describe(info)}")
            note = self._schedule_note(info, state.budget_decay)
            if note:
                self.log(note)
        # every rank at this point: the writer makes a process group of its own
        self.writer = CheckpointWriter(
            self.run_dir,
            self.env.rank,
            self.env.world_size,
            self.cfg.checkpoint,
            expect_bytes=self.expect_bytes,
            warn=self.warn,
            full_after_step=self.cfg.drill.volume_full_after_step,
        )
        return state

    def resumed(self) -> tuple[int, float] | None:
        """(step, save time) of this run dir's checkpoint that the run resumed from, for the gauges."""
        info = self.resume_from
        if info is None or self.resume != "auto":
            return None
        return info.step, float(info.meta.get("saved_unix", 0.0))

    def _restore_weights(self, info: CheckpointInfo) -> None:
        """An optimizer state of another mode (AdamW <-> Muon) is converted, with a line saying so; RNG
        states are restored when the world size is the checkpoint's."""
        env = self.env
        gpt = unwrap(self.model)
        check_compatible(gpt, load_model_shapes(info), info.path)  # every rank, index only
        for note in load_into(info, gpt, self.optimizer):
            if note.startswith("warning:"):
                self.warn(note)
            else:
                self.log(note)
        if not info.has_optimizer:
            self.warn(
                f"warning: {info.path} has no optimizer state; the optimizer restarts from zero moments"
            )
        saved_world = info.meta.get("world_size")
        if saved_world != env.world_size:
            self.log(
                f"resharding: checkpoint of world size {saved_world} on {env.world_size}: weights and "
                "optimizer restored exactly, data continues at the same global sample, RNG states start fresh"
            )
        rng = load_rng_state(info, env.rank)
        if rng is not None and saved_world == env.world_size:
            set_rng_state(rng)

    def _schedule_note(self, info: CheckpointInfo, budget_decay: dict | None) -> str | None:
        """A line when this run's LR at the resumed step differs from the checkpoint's schedule."""
        cfg = self.cfg
        old = config_from_dict(info.meta.get("config") or cfg.to_dict())
        return resume_change(
            (old.schedule, old.optim, old.train.max_steps),
            (cfg.schedule, cfg.optim, cfg.train.max_steps),
            info.step,
            DecayPlan(**budget_decay) if budget_decay else None,
        )

    # ------------------------------------------------------------ saving

    def time_due(self) -> bool:
        """Not collective: whether checkpoint.every_minutes have passed on this rank's clock. Ranks' clocks
        differ by a few ms, so the loop saves when the stop agreement says any rank asked."""
        minutes = self.cfg.checkpoint.every_minutes
        return bool(minutes) and time.monotonic() - self.last_save_time >= minutes * 60

    def maybe_save(self, step: int, snapshot: Snapshot, *, time_agreed: bool = False) -> None:
        """Save when a save is due: every checkpoint.every_steps steps this process trained, or when the
        ranks agreed that checkpoint.every_minutes have passed (`time_agreed`). In the background when
        checkpoint.async_save; a background save that has finished is reported here."""
        every = self.cfg.checkpoint.every_steps
        if time_agreed:
            self.save(step, snapshot, "every_minutes")
        elif every and step % every == 0 and step > self.start_step:
            self.save(step, snapshot, "every_steps")
        self._report(self.writer.poll())

    def final_save(self, step: int, snapshot: Snapshot, reason: str) -> None:
        """The save of a graceful stop: in the foreground, and it returns once every save is committed, so
        a stop ends on a complete checkpoint."""
        self.save(step, snapshot, reason, final=True)
        self.wait()

    def save(self, step: int, snapshot: Snapshot, reason: str, final: bool = False) -> None:
        """Save `step` now, unless it is step 0 (nothing has been learned, and a restart from the seed is
        the same run) or already saved. In the background with checkpoint.async_save, unless `final`."""
        if step == 0 or step == self.last_saved_step:
            return
        state, progress = snapshot()
        meta = {"config": self.cfg.to_dict(), **progress, "reason": reason, "data": self.data}
        self.wait()  # the previous background save, if one is still running
        self.on_save("saving")
        result = self.writer.save(
            step, self.model, self.optimizer, asdict(state), meta, self.files, reason, final
        )
        self.last_saved_step = step
        self.last_save_time = time.monotonic()
        self._report(result)
        self.on_save("running")

    def wait(self) -> None:
        """Block until a background save is committed (raises its error)."""
        self._report(self.writer.wait())

    def abandon(self) -> None:
        """Not collective in effect: drop a pending background write without committing it (an immediate
        stop, or a crash); its temp dir goes, the last committed checkpoint stands."""
        if self.writer is not None:
            self.writer.abandon()

    def _report(self, result: SaveResult | None) -> None:
        """A save is reported once committed (at once when synchronous, later from the background)."""
        if result is not None:
            self.committed = result
            self.on_commit(result)

    @property
    def committed_step(self) -> int:
        """The newest committed checkpoint's step (-1: none yet)."""
        if self.committed is not None:
            return self.committed.step
        resumed = self.resumed()
        return resumed[0] if resumed else -1

    def summary(self) -> list[str]:
        """Rank 0: the lines a finished run prints, its latest and best checkpoints ([] elsewhere)."""
        if not self.env.is_rank0:
            return []
        return summary(self.run_dir, self.cfg.checkpoint.verify, self.warn)


def check_same_architecture(info: CheckpointInfo, cfg: Config) -> None:
    """Refuse in one line to resume weights into another architecture (e.g. a preset whose recipe changed
    since the run started), naming the checkpoint's own config as the fix. Every rank reads the same
    meta.json, so every rank refuses alike, before the model is built."""
    saved = info.meta.get("config")
    if not saved:
        return
    old = config_from_dict(saved).model
    changed = [
        key
        for key in ARCHITECTURE_KEYS
        if getattr(old, DERIVED.get(key, key)) != getattr(cfg.model, DERIVED.get(key, key))
    ]
    if not changed:
        return
    key = changed[0]
    was = getattr(old, key)
    now = getattr(cfg.model, key)
    raise UserError(
        f"checkpoint {info.path} was trained with model.{key}={was}, this run has {now}: its weights would "
        f"run in another model; resume with the config it was trained with (--config {info.path}/meta.json), "
        f"or --set model.{key}={was}"
    )
