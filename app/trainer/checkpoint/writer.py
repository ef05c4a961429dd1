"""Saving a checkpoint: every rank writes its own pieces in parallel and rank 0 commits, in the background
when `checkpoint.async_save` is on, so a save costs the loop only the copy to host memory.

The commit is atomic (temp dir, meta.json last, rename): a crash before the rename leaves the previous
checkpoint the latest. The writer agrees on its own gloo group because it agrees from its own thread, and
collectives on one group must not interleave. A save that fails for space raises OutOfSpace (exit 6).
Details: docs/parallel.md ("Checkpoints: sharded per rank, any world size, in the background").
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from app.config import CheckpointConfig
from app.errors import EXIT_OUT_OF_SPACE, UserError
from app.files import fsync_dir
from app.trainer.checkpoint.format import (
    MODEL_INDEX,
    OPTIMIZER_INDEX,
    FileEntry,
    chunk,
    dtype_name,
    merge_chunks,
    shard_file,
    write_bytes,
    write_json_file,
    write_safetensors,
)
from app.trainer.checkpoint.state import Piece, model_pieces, optimizer_pieces, rng_state
from app.trainer.checkpoint.store import (
    FORMAT_VERSION,
    META,
    apply_retention,
    checkpoints_root,
    list_checkpoints,
    step_dir_name,
    versions,
    warn_stderr,
)
from app.trainer.parallel.distributed import agree


class CheckpointError(RuntimeError):
    """A save failed on some rank; nothing was committed, the previous checkpoint stands."""


class OutOfSpace(UserError):
    """The checkpoint volume is full: permanent (space does not free itself), so not a retryable code."""

    exit_code = EXIT_OUT_OF_SPACE


class Cancelled(Exception):
    pass


def _snapshot(data):
    """A deep copy of JSON data: the loop goes on changing the original while the save is written."""
    return json.loads(json.dumps(data))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@dataclass
class SaveResult:
    path: Path
    step: int
    seconds: float  # blocking + write: how long a stop waits for a save
    blocking_seconds: float  # the loop was stopped for this long
    write_seconds: float  # in the background after that (0 for a synchronous save)
    bytes: int  # all ranks' files (rank 0); this rank's own files (other ranks)
    reason: str = ""


@dataclass
class _Job:
    step: int
    tmp: Path
    model: list[Piece]
    optimizer: list[Piece]  # [] without an optimizer
    aliases: dict[str, str]
    structure: dict | None
    trainer_state: dict
    meta: dict
    extra_files: list[Path]
    rng: dict
    reason: str
    started: float
    final: bool = False
    blocking: float | None = None  # how long the loop stood still, when staged for the background


class CheckpointWriter:
    """One per trainer; construct it on every rank at the same point (it creates a process group).
    The run dir must be on storage every rank sees (the checkpoint PVC is ReadWriteMany)."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        config: CheckpointConfig | None = None,
        async_save: bool | None = None,
        expect_bytes: int = 0,
        warn=warn_stderr,
        full_after_step: int = 0,
    ) -> None:
        """`config` (checkpoint.*): async_save, and retention after each commit (rank 0); without it,
        synchronous saves and no retention. `async_save` overrides the config. `expect_bytes`: the
        estimated size of one checkpoint (app/trainer/parallel/memory.py), checked against free space at once.
        `full_after_step` (drill.volume_full_after_step): saves of later steps fail as on a full volume."""
        self.run_dir = Path(run_dir)
        self.root = checkpoints_root(run_dir)
        self.rank = rank
        self.world = world_size
        self.config = config
        self.full_after_step = full_after_step
        self.async_save = async_save if async_save is not None else bool(config and config.async_save)
        self.group = None
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")  # CPU-side agreement, also beside NCCL
        self._staging: dict[str, torch.Tensor] = {}  # host copies, reused from save to save
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self.expect_bytes = expect_bytes
        self.warn = warn
        self.check_space()

    # ------------------------------------------------------------ the loop's side

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        trainer_state: dict,
        meta: dict,
        extra_files: list[Path] = (),
        reason: str = "",
        final: bool = False,
    ) -> SaveResult | None:
        """Collective. Returns the result of a synchronous save; None when it went to the background
        (`poll()` / `wait()` give its result). A `final` save (a stop) is always written in the
        foreground: there is nothing left to overlap with, and it needs no staging copy."""
        self.wait()
        background = self.async_save and not final
        started = time.monotonic()
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save of this step
            tmp.mkdir(parents=True)
        agree([0])  # every rank waits for the temp dir
        weights, aliases = model_pieces(model, self.rank, self.world)
        moments: list[Piece] = []
        structure = None
        if optimizer is not None:
            moments, structure = optimizer_pieces(model, optimizer, self.rank, self.world)
        job = _Job(
            step=step,
            tmp=tmp,
            model=weights,
            optimizer=moments,
            aliases=aliases,
            structure=_snapshot(structure),
            trainer_state=_snapshot(trainer_state),
            meta=_snapshot(meta),
            extra_files=[Path(p) for p in extra_files],
            rng=rng_state(),
            reason=reason,
            started=started,
            final=final,
        )
        if not self.expect_bytes:  # no estimate: this rank's share of the state times the ranks
            self.expect_bytes = self.world * sum(piece.tensor.nbytes for piece in weights + moments)
        self._cancel.clear()
        if not background:
            self._run(job)
            return self.wait()
        job.model = stage(job.model, self._staging)
        job.optimizer = stage(job.optimizer, self._staging)
        job.blocking = time.monotonic() - started
        self._thread = threading.Thread(target=self._run, args=(job,), name="checkpoint-writer", daemon=True)
        self._thread.start()
        return None

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> SaveResult | None:
        """The result of a finished background save, once; None while one runs or none finished."""
        return None if self.pending else self.wait()

    def wait(self) -> SaveResult | None:
        """Block until the pending save is committed; its result (once), or raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error = self._error
        self._error = None
        if isinstance(error, OutOfSpace):
            raise error
        if error is not None:
            raise CheckpointError(f"checkpoint save failed: {error}") from error
        result = self._result
        self._result = None
        if result is not None and self.rank == 0:
            self.expect_bytes = result.bytes
            self.check_space()
        return result

    def _space(self) -> tuple[int, int, list[Path], str]:
        """(free bytes, checkpoints the volume holds at once: keep_last + best + the one being written,
        the checkpoints there, the figures a message gives)."""
        config = self.config
        there = list_checkpoints(self.run_dir)
        kept = config.keep_last + int(config.keep_best) if config else 1
        slots = kept + 1
        free = shutil.disk_usage(self.root if self.root.is_dir() else self.run_dir).free
        figures = (
            f"a checkpoint needs about {_gb(self.expect_bytes)} in {self.root}, {_gb(free)} free; the volume "
            f"needs {_gb(self.expect_bytes * slots)} (checkpoint.keep_last + best + the one being written)"
        )
        return free, slots, there, figures

    def check_space(self) -> None:
        """Rank 0: warn while the free space cannot hold the saves still to come (until retention has
        its slots filled), so the user can act before a save fails."""
        if self.rank == 0 and self.expect_bytes:
            free, slots, there, figures = self._space()
            if free < self.expect_bytes * max(1, slots - len(there)):
                fits = free // self.expect_bytes
                when = f"save {fits + 1} from now" if fits else "the next save"
                self.warn(f"warning: {figures}: {when} will fail for space (exit 6); grow it or free space")

    def abandon(self) -> None:
        """Stop a pending background write without committing it (every rank does so at the same step)."""
        if self._thread is not None:
            self._cancel.set()
            self._thread.join()
            self._thread = None
        self._error = None
        self._result = None

    # ------------------------------------------------------------ the writing side

    def _run(self, job: _Job) -> None:
        write_started = time.monotonic()
        files: dict[str, FileEntry] = {}
        part: dict = {}
        error: BaseException | None = None
        try:
            part = self._write_own(job, files)
        except BaseException as e:  # noqa: BLE001 - reported to every rank, raised by wait()
            error = e
        ok, room = self._agree(error)
        path = self.root / step_dir_name(job.step)
        nbytes = sum(entry.bytes for entry in files.values())
        if ok and self.rank == 0:
            try:
                path, nbytes = self._commit(job, part)
            except BaseException as e:  # noqa: BLE001
                error = e
        if ok:  # the other ranks learn whether rank 0 committed
            ok, room = self._agree(error)
        try:
            if not ok:
                if self.rank == 0:
                    shutil.rmtree(job.tmp, ignore_errors=True)
                if not room:
                    _, _, there, figures = self._space()
                    kept = f"resumes from {there[0].name}, intact" if there else "starts afresh"
                    stop = f" (the save for the stop: {job.reason})" if job.final else ""
                    raise OutOfSpace(
                        f"out of space on the checkpoint volume at step {job.step}{stop}: {figures}. Grow "
                        f"the volume or free space there; the restart {kept}"
                    )
                raise error or CheckpointError("another rank failed to write its part")
            config = self.config
            if self.rank == 0 and config is not None:
                apply_retention(self.run_dir, config.keep_last, config.keep_best, config.drop_optimizer_older)
            now = time.monotonic()
            if job.blocking is None:  # synchronous: the loop stood still for all of it
                blocking = now - job.started
                write = 0.0
            else:
                blocking = job.blocking
                write = now - write_started
            self._result = SaveResult(path, job.step, blocking + write, blocking, write, nbytes, job.reason)
        except BaseException as e:  # noqa: BLE001
            self._error = e

    def _check(self) -> None:
        if self._cancel.is_set():
            raise Cancelled("abandoned")

    def _write_own(self, job: _Job, files: dict[str, FileEntry]) -> dict:
        """This rank's files; returns its part of the index."""
        part: dict = {"model": {}, "optimizer": {}}
        for kind, pieces in (("model", job.model), ("optimizer", job.optimizer)):
            if not pieces:
                continue
            name = shard_file(kind, self.rank)
            items = [(p.name, p.tensor) for p in pieces]
            files[name] = write_safetensors(job.tmp / name, items, cancel=self._check)
            if self.full_after_step and job.step > self.full_after_step:  # the drill, after a partial write
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(job.tmp / name))
            for p in pieces:
                part[kind][p.name] = {
                    "dtype": dtype_name(p.tensor.dtype),
                    "shape": list(p.shape),
                    "chunks": [chunk(name, p.name, p.offsets, p.tensor.shape)],
                }
        self._check()
        files[f"rng_rank{self.rank}.json"] = write_json_file(job.tmp / f"rng_rank{self.rank}.json", job.rng)
        if self.rank == 0:
            files["trainer_state.json"] = write_json_file(job.tmp / "trainer_state.json", job.trainer_state)
            for extra in job.extra_files:
                files[extra.name] = write_bytes(job.tmp / extra.name, extra.read_bytes())
        part["files"] = {k: asdict(v) for k, v in files.items()}
        write_json_file(job.tmp / f"part-rank{self.rank:05d}.json", part)
        return part

    def _agree(self, error: BaseException | None) -> tuple[bool, bool]:
        """Every rank learns whether every rank succeeded, and whether one ran out of space (a barrier that
        carries a verdict)."""
        full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        mine = [int(error is None), int(not full)]
        ok, room = mine if self.group is None else agree(mine, dist.ReduceOp.MIN, self.group)
        return bool(ok), bool(room)

    def _commit(self, job: _Job, own: dict) -> tuple[Path, int]:
        """Rank 0: merge every rank's part into the indexes, write meta.json last, rename into place."""
        parts = [own] + [
            json.loads((job.tmp / f"part-rank{r:05d}.json").read_text()) for r in range(1, self.world)
        ]
        files = {name: entry for part in parts for name, entry in part["files"].items()}
        model_index = {"tensors": merge_chunks([p["model"] for p in parts]), "tied": job.aliases}
        files[MODEL_INDEX] = asdict(write_json_file(job.tmp / MODEL_INDEX, model_index))
        if job.structure is not None:
            opt_index = {"tensors": merge_chunks([p["optimizer"] for p in parts]), **job.structure}
            files[OPTIMIZER_INDEX] = asdict(write_json_file(job.tmp / OPTIMIZER_INDEX, opt_index))
        for r in range(self.world):
            (job.tmp / f"part-rank{r:05d}.json").unlink(missing_ok=True)
        meta = {
            **job.meta,
            "format_version": FORMAT_VERSION,
            "step": job.step,
            "tied": job.aliases,
            "world_size": self.world,
            "versions": versions(),
            "saved_unix": time.time(),
            "files": dict(sorted(files.items())),
        }
        write_json_file(job.tmp / META, meta)
        fsync_dir(job.tmp)
        final = self.root / step_dir_name(job.step)
        old = self.root / f".old-{final.name}-{os.getpid()}"
        if final.exists():  # re-saving a step (e.g. a stop right after a resume): swap atomically
            os.replace(final, old)
        os.replace(job.tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(self.root)
        return final, sum(f["bytes"] for f in files.values())


def stage(pieces: list[Piece], buffers: dict[str, torch.Tensor]) -> list[Piece]:
    """Copies of the pieces in host memory, so the loop can change the live tensors while they are
    written. The buffers are reused by the next save: allocating (and on CUDA pinning) 1/world of the
    state every save would cost more than the copy, so an asynchronous writer holds that much between
    saves."""
    cuda = any(p.tensor.device.type == "cuda" for p in pieces)
    out = []
    for p in pieces:
        host = buffers.get(p.name)
        if host is None or host.shape != p.tensor.shape or host.dtype != p.tensor.dtype:
            host = buffers[p.name] = torch.empty(p.tensor.shape, dtype=p.tensor.dtype, pin_memory=cuda)
        host.copy_(p.tensor, non_blocking=cuda)
        out.append(Piece(p.name, host, p.shape, p.offsets))
    if cuda:
        torch.cuda.synchronize()
    return out
