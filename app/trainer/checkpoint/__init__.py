"""Checkpoints: one directory per step, every rank writing its own shards in parallel (in the background
with checkpoint.async_save), committed atomically, verified when read, no pickle. Any world size and mode
(DDP, FSDP, one process) reads a checkpoint of any other.

The training loop uses `Checkpointer` and nothing else. Tools that read a run (sample, export, eval, serve)
use store.py (and state.load_into). Inside the package, one concern per file:

    checkpointer.py  the loop's facade: resume (find, load), save when due, the stop's save, wait
    store.py         the run dir's checkpoints on disk: layout, verify, latest/best, retention, reading meta
    writer.py        the save: per-rank writes, staging for the background, the atomic commit
    state.py         what a checkpoint holds of a live run (each rank's pieces, RNG, TrainerState), loading it
    format.py        sharded safetensors + JSON index: streaming writer, slice reader, consolidation
"""

from app.trainer.checkpoint.checkpointer import Checkpointer
from app.trainer.checkpoint.state import TrainerState

__all__ = ["Checkpointer", "TrainerState"]
