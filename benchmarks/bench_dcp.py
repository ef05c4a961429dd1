"""torch.distributed.checkpoint (DCP) against our checkpoint format, in one process on the same model and
AdamW state (the experiment behind the decision in docs/architecture.md, "Checkpoints: our format or DCP").

For each: save and load seconds (best of REPEATS), bytes on disk, and whether anything written is a
pickle (our rule: nothing a user loads is). Ours includes what DCP does not do: a sha256 of every file
while writing, the fsyncs and the atomic rename of the whole step dir; DCP's figures are its plain
FileSystemWriter. Ratios are DCP / ours, measured in the same run.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

REPEATS = 3
PICKLE_PROTOCOL_2_PLUS = b"\x80"  # a pickle of protocol >= 2 starts with PROTO


def _model_and_optimizer():
    from app.config import ModelConfig, OptimConfig
    from app.trainer.model.gpt import build_model
    from app.trainer.optimization.optimizer import build_optimizer

    torch.manual_seed(0)
    model = build_model(
        ModelConfig(vocab_size=8192, seq_len=256, n_layer=6, d_model=512, n_head=8, n_kv_head=4)
    )
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    optimizer.step()  # creates the moments
    return model, optimizer


def _ours(root: Path, model, optimizer) -> tuple[float, float, Path]:
    from app.trainer.checkpoint import store as ckpt
    from app.trainer.checkpoint.state import load_into
    from app.trainer.checkpoint.writer import CheckpointWriter

    t0 = time.perf_counter()
    CheckpointWriter(root, 0, 1).save(1, model, optimizer, {"step": 1}, {})
    saved = time.perf_counter() - t0
    info = ckpt.resolve(root, "size")
    t0 = time.perf_counter()
    load_into(info, model, optimizer)
    return saved, time.perf_counter() - t0, info.path


def _dcp(root: Path, model, optimizer) -> tuple[float, float, Path]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t0 = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root), no_dist=True)
    saved = time.perf_counter() - t0
    t0 = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(root), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return saved, time.perf_counter() - t0, root


def _pickles(path: Path) -> list[str]:
    return sorted(
        p.name for p in path.rglob("*") if p.is_file() and p.read_bytes()[:1] == PICKLE_PROTOCOL_2_PLUS
    )


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run() -> list[str]:
    model, optimizer = _model_and_optimizer()
    figures: dict[str, tuple[float, float, int, list[str]]] = {}
    for name, fn in (("ours", _ours), ("dcp", _dcp)):
        best_save = best_load = float("inf")
        for i in range(REPEATS):
            with tempfile.TemporaryDirectory() as tmp:
                save, load, path = fn(Path(tmp) / f"{name}-{i}", model, optimizer)
                best_save, best_load = min(best_save, save), min(best_load, load)
                size, pickles = _bytes(path), _pickles(path)
        figures[name] = (best_save, best_load, size, pickles)
    (os_, ol, ob, op), (ds, dl, db, dp) = figures["ours"], figures["dcp"]
    params = sum(p.numel() for p in model.parameters())
    return [
        f"model {params / 1e6:.1f}M parameters + AdamW state, one process, best of {REPEATS}",
        f"save: ours {os_:.2f} s (sha256 + fsync + atomic rename), DCP {ds:.2f} s: DCP/ours {ds / os_:.2f}x",
        f"load: ours {ol:.2f} s, DCP {dl:.2f} s: DCP/ours {dl / ol:.2f}x",
        f"bytes: ours {ob / 1e6:.1f} MB, DCP {db / 1e6:.1f} MB",
        f"pickled files: ours {op or 'none'}, DCP {dp or 'none'}",
    ]


if __name__ == "__main__":
    for line in run():
        print(line)
