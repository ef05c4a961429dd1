"""A run's start: how each component of the Trainer (app/train.py) is built from the config, one function
per component, called by `Trainer.__init__` in the order their inputs exist. Nothing here runs the loop;
what each component does once built is its own module's (docs/architecture.md, "The training step").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from app.config import Config
from app.data.manifest import Manifest
from app.errors import UserError
from app.trainer.args import RunArgs
from app.trainer.checkpoint import Checkpointer, TrainerState
from app.trainer.model.evaluate import Evaluator, Sampler
from app.trainer.optimization.schedule import Schedule
from app.trainer.parallel.batches import TrainBatches
from app.trainer.parallel.distributed import DistEnv
from app.trainer.parallel.memory import ParallelChoice, checkpoint_bytes, plan_for_training
from app.trainer.parallel.parallelize import build_parallel_model
from app.trainer.reporting.metrics import device_peak
from app.trainer.reporting.report import Reporter
from app.trainer.stopping.agreement import BadSteps, EarlyStopping, MfuFloor, SignalFlag, StopAgreement
from app.trainer.stopping.planned_end import DecayPlan, PlannedEnd
from app.trainer.stopping.spikes import SpikeDetector


def reporter(cfg: Config, env: DistEnv, run_dir: Path, device: torch.device) -> Reporter:
    """The reporter, with the device's peak FLOP/s for MFU (none on a CPU without metrics.peak_tflops)."""
    _, peak = device_peak(cfg.metrics.gpu_type, cfg.metrics.peak_tflops, device)
    if cfg.train.mfu_floor and not peak:
        raise UserError(
            f"train.mfu_floor needs the device's peak to measure MFU, and {device.type} "
            "has none: set --gpu-type or metrics.peak_tflops, or drop train.mfu_floor"
        )
    return Reporter(cfg, env, run_dir, peak)


def checkpointer(
    cfg: Config,
    env: DistEnv,
    run: RunArgs,
    data_dir: Path,
    manifest: Manifest,
    report: Reporter,
    on_save: Callable[[str], None],
) -> Checkpointer:
    """The run dir's checkpoints: what this start resumes (`--resume`) and the saves to come, each
    reported when committed; `on_save`: the heartbeat while the loop stands still for a save."""
    return Checkpointer(
        Path(run.out),
        cfg,
        env,
        resume=run.resume,
        data={"dir": str(data_dir), "tokenizer_sha256": manifest.tokenizer.get("sha256")},
        files=[data_dir / "tokenizer.json"],  # a checkpoint dir alone is enough to sample or export
        expect_bytes=checkpoint_bytes(cfg),
        log=report.log,
        warn=report.warn,
        on_commit=report.checkpoint,
        on_save=on_save,
    )


def parallel_model(
    cfg: Config, env: DistEnv, device: torch.device, log
) -> tuple[torch.nn.Module, ParallelChoice]:
    """The model from the seed, in the parallel mode the memory estimate chooses (train.parallel=auto)."""
    torch.manual_seed(cfg.train.seed)
    parallel = plan_for_training(cfg, env.world_size, device)  # resolves train.parallel=auto
    estimate = parallel.fsdp if parallel.mode == "fsdp" else parallel.ddp
    log(f"parallel: {parallel.mode} ({parallel.reason}); estimate {estimate.describe()}")
    return build_parallel_model(cfg, env, device, parallel.mode, log), parallel


def resume_parts(
    state: TrainerState, data: TrainBatches, early: EarlyStopping, spikes: SpikeDetector, bad_steps: BadSteps
) -> None:
    """The data's position and the guards from the resumed trainer state, where it has them; then the data
    reads ahead from that position."""
    resumed = [
        (data, state.loader),
        (early, state.early_stopping),
        (spikes, state.spikes),
        (bad_steps, state.bad_steps),
    ]
    for part, saved in resumed:
        if saved:
            part.load_state_dict(saved)
    data.start(state.step)


def schedule(cfg: Config, state: TrainerState, tokens_per_step: int, log) -> Schedule:
    """The LR schedule and the planned end it follows, with the end plan of the resumed trainer state (a
    max_hours plan made for another train.max_hours is dropped, and the end is planned again)."""
    end = PlannedEnd.of(cfg, tokens_per_step, DecayPlan.from_dict(state.budget_decay))
    lr_schedule = Schedule(cfg.schedule, cfg.optim, end)
    dropped = lr_schedule.drop_outdated(state.step, state.tokens)
    if dropped:
        log(dropped)
    return lr_schedule


def stop_agreement(
    cfg: Config,
    env: DistEnv,
    stop_file: Path,
    planned: PlannedEnd,
    early: EarlyStopping,
    bad_steps: BadSteps,
    signals: SignalFlag,
    report: Reporter,
) -> StopAgreement:
    """The stop causes (the planned end, early stopping, divergence, the MFU floor, the stop file, signals)
    and the agreement of the ranks on them."""
    train = cfg.train
    return StopAgreement(
        stop_file=stop_file if env.is_rank0 else None,  # only the master pod's
        planned=planned,
        early=early,
        signals=signals,
        bad_steps=bad_steps,
        mfu_floor=MfuFloor(train.mfu_floor, train.mfu_floor_minutes),
        every=train.stop_check_every,
        say=report.log,
        warn=report.warn,
    )


def evaluation(
    cfg: Config,
    env: DistEnv,
    device: torch.device,
    model: torch.nn.Module,
    autocast,
    data_dir: Path,
    manifest: Manifest,
    early: EarlyStopping,
    report: Reporter,
    fsdp: bool,
) -> tuple[Evaluator, Sampler]:
    """The validation loss (it feeds early stopping) and the samples (under `fsdp` every rank draws them:
    FSDP gathers)."""
    evaluator = Evaluator(
        model,
        cfg,
        env,
        device,
        autocast,
        data_dir=data_dir,
        bytes_per_token=manifest.bytes_per_token("val"),
        early=early,
        report=report,
    )
    every = cfg.train.sample_every
    sampler = Sampler(model, data_dir, device, seed=cfg.train.seed, every=every, fsdp=fsdp, log=report.log)
    return evaluator, sampler
