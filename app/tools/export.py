"""`pretrain export RUN_DIR --output DIR`: a self-contained report of one run.

Why: a run dir is sharded, resumable working state; the export is what a reader keeps and shares:
manifest.json (config, versions, spend, results), metrics.csv and plots of the trajectory that led to
the final weights, final.safetensors consolidated from the shards of any world size, the tokenizer and
the run's `pretrain eval` results.

`--format hf` writes the model instead as a folder Hugging Face transformers loads (app/tools/hf_export.py);
the run-dir checks and the summaries of the run (val losses, spend) below serve both formats.

Detail: docs/observability.md, "Run export" (every file and field, and how to reload the weights), and
docs/serving.md for the transformers folder.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import hashlib
import json
import os
import platform
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from app.budget.files import read_json_object
from app.command import count
from app.errors import UserError
from app.files import check_writable_dir, sha256_file
from app.tools.export_plots import write_plots
from app.trainer.checkpoint import store as ckpt

MANIFEST_VERSION = 1
CSV_COLUMNS = ("step", "name", "value")
PLOTS = ("loss-curve.png", "gradnorm-curve.png", "throughput.png")
FORMATS = ("report", "hf")
HF_DTYPES = ("float32", "bfloat16")  # --dtype of --format hf
DEFAULT_SHARD_BYTES = 5 * 10**9  # --max-shard-size: transformers' default, "5GB"

# Environment variables that describe where a run was exported (a whitelist: never dump the environment).
_ENV_EXACT = {
    *("KUBERNETES_SERVICE_HOST", "POD_NAME", "POD_NAMESPACE", "POD_IP", "NODE_NAME", "PRETRAIN_JOB_NAME"),
    *("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
    *("ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
    *("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"),
    *("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS"),
}
_ENV_PREFIXES = ("PET_",)  # the Kubeflow training operator's torchrun settings (PET_NNODES, ...)


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    run_dir = "a run directory (checkpoints/, metrics.jsonl, budget/) written by `pretrain train`"
    p.add_argument("run_dir", metavar="RUN_DIR", help=run_dir)
    output = "where to write the export: the report's manifest.json, metrics.csv, plots, final.safetensors "
    output += "and the run's eval/*.json (from `pretrain eval`), or the hf folder; it must be empty or new "
    output += "unless --force"
    p.add_argument("--output", "-o", required=True, metavar="DIR", help=output)
    p.add_argument("--force", action="store_true", help="write into a non-empty --output, replacing files")
    formats = "report (default): the files above; hf: a folder Hugging Face transformers, lm-eval and vLLM "
    formats += "load (config.json, model.safetensors, tokenizer, model card README.md; docs/serving.md)"
    p.add_argument("--format", choices=FORMATS, default="report", help=formats)
    dtype = "--format hf: the weights' dtype, float32 (default: as trained) or bfloat16 (half the size)"
    p.add_argument("--dtype", choices=HF_DTYPES, default=None, help=dtype)
    license = "--format hf: the model card's license, a Hub license identifier such as apache-2.0 or mit "
    license += "(never guessed: without it the card says that none was chosen)"
    p.add_argument("--license", metavar="ID", default=None, help=license)
    shard = "--format hf: weights larger than this are split into several files with an index "
    shard += "(default 5GB, as transformers; suffixes k, M, G: 500MB)"
    p.add_argument("--max-shard-size", type=count, metavar="BYTES", default=None, help=shard)


def run(args: argparse.Namespace) -> int:
    hf_only = {"--dtype": args.dtype, "--license": args.license, "--max-shard-size": args.max_shard_size}
    if args.format == "hf":
        from app.tools.hf_export import report

        done = export_hf(
            Path(args.run_dir),
            Path(args.output),
            force=args.force,
            dtype=args.dtype or "float32",
            license=args.license,
            max_shard_size=DEFAULT_SHARD_BYTES if args.max_shard_size is None else args.max_shard_size,
        )
        print(report(Path(args.run_dir), done))
        return 0
    if given := [flag for flag, value in hf_only.items() if value is not None]:
        raise UserError(f"{', '.join(given)} apply to --format hf only; add --format hf, or drop them")
    out = export(Path(args.run_dir), Path(args.output), force=args.force)
    m = json.loads((out / "manifest.json").read_text())
    spend = m["spend"]["total_usd"]
    val, at = m["val_loss"]["latest"], m["val_loss"]["latest_step"]  # evals up to the exported step only
    predicted = m["val_loss"]["predicted"]  # pretrain plan's prediction for this recipe and these tokens
    tokens = f", {m['tokens']:,} tokens" if isinstance(m["tokens"], int) else ""
    print(
        f"exported {args.run_dir} -> {out}: checkpoint step {m['step']}{tokens}"
        + (f", val loss {val:.4f} (eval at step {at})" if val is not None else ", no eval logged")
        + (f", predicted {predicted['val_loss']:.4f}" if predicted else "")
        + (f", ${spend:.4f} spent" if spend is not None else "")
    )
    for name in m["files"]:
        print(f"  {out / name}")
    return 0


# ---------------------------------------------------------------- metrics.jsonl -> rows


def read_rows(path: Path) -> list[dict]:
    """The JSONL log as dicts; lines cut by a kill (or not objects) are skipped."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def effective_rows(rows: list[dict]) -> list[dict]:
    """The rows of the trajectory that led to the final weights.

    A (re)start logs a `start` event at the step it resumed from: rows logged earlier beyond that step
    belong to an abandoned attempt and are dropped. A (kind, step) logged twice keeps the last row.
    """
    kept: dict[tuple[str, int], dict] = {}
    for i, row in enumerate(rows):
        kind, step = row.get("kind", ""), row["step"]
        if kind == "event" and row.get("event") == "start":
            kept = {k: r for k, r in kept.items() if k[1] <= step}
        key = (kind, step) if kind != "event" else (f"event:{i}", step)  # events are never duplicates
        kept.pop(key, None)  # re-insert at the end: the last occurrence wins, in log order
        kept[key] = row
    return sorted(kept.values(), key=lambda r: r["step"])  # stable: log order within a step


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None  # bool is an int: 1.0 / 0.0


def metric_values(rows: list[dict]) -> list[tuple[int, str, float]]:
    """(step, name, value) for every numeric field of train, eval and checkpoint rows."""
    out = []
    for row in rows:
        kind, step = row.get("kind"), row["step"]
        if kind not in ("train", "eval", "checkpoint"):
            continue
        for key, value in row.items():
            if key in ("kind", "step", "time", "path", "reason"):
                continue
            if kind == "train" and key == "loop_losses" and isinstance(value, list):
                nums = [_number(v) for v in value]
                out += [(step, f"loop_loss_{i}", v) for i, v in enumerate(nums) if v is not None]
            elif (num := _number(value)) is not None:
                out.append((step, f"checkpoint_{key}" if kind == "checkpoint" else key, num))
    return out


def write_csv(path: Path, values: list[tuple[int, str, float]]) -> None:
    with open(path, "w", newline="") as f:
        rows = [(step, name, repr(value)) for step, name, value in values]  # repr: float() reads nan, inf
        csv.writer(f).writerows([CSV_COLUMNS, *rows])


# ---------------------------------------------------------------- weights


def write_final(path: Path, info: ckpt.CheckpointInfo) -> dict[str, Any]:
    """The checkpoint's weights in one file, from the shards of any world size (one tensor at a time),
    tensor bytes unchanged; tied aliases and the model config in the header."""
    from app.trainer.checkpoint.format import write_consolidated

    model_cfg = (info.meta.get("config") or {}).get("model", {})
    with ckpt.open_reader(info) as reader:
        tied = dict(reader.tied)
        metadata = {
            "tied": json.dumps(tied, sort_keys=True),
            "model_config": json.dumps(model_cfg, sort_keys=True),
            **{k: str(v) for k, v in vocab_rows(model_cfg).items()},
            "step": str(info.step),
            "source": str(info.path),
        }
        entry, params = write_consolidated(path, reader, metadata)
        tensors = len(reader.names())
    os.chmod(path, 0o644)  # the other exports are world-readable too
    return {"tensors": tensors, "parameters": params, "tied": tied, "sha256": entry.sha256}


def vocab_rows(model_cfg: dict) -> dict[str, int]:
    """The true vocabulary and the padded row count of embedding and head (older runs: unpadded)."""
    vocab, multiple = model_cfg.get("vocab_size", 0), model_cfg.get("vocab_multiple", 1)
    return {"vocab_size": vocab, "padded_vocab": -(-vocab // multiple) * multiple}


def load_final(path: str | Path) -> tuple[dict, dict[str, str]]:
    """(state dict with tied aliases restored, header metadata) of an exported final.safetensors, for
    `load_state_dict` on the model of manifest.json's config (docs/observability.md shows how)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    state = load_file(str(path))
    for alias, target in json.loads(meta.get("tied", "{}")).items():
        state[alias] = state[target]
    return state, meta


# ---------------------------------------------------------------- manifest


def config_hash(config: dict) -> str:
    """sha256 of the config as canonical JSON (sorted keys, no whitespace): equal configs, equal hashes."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def cluster_spec(meta: dict, start: dict) -> dict[str, Any]:
    """Where the run trained (from the checkpoint and the log's last `start` event) and where it is
    exported (this environment)."""
    gpus: list[str] = []
    with contextlib.suppress(Exception):  # a broken CUDA setup must not break an export
        import torch

        if torch.cuda.is_available():
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    config = meta.get("config") or {}
    return {
        "training": {
            "world_size": meta.get("world_size") or start.get("world_size"),
            "tokens_per_step": start.get("tokens_per_step"),
            "device": (config.get("train") or {}).get("device"),
            "gpu_type": (config.get("metrics") or {}).get("gpu_type") or None,
        },
        "environment": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "kubernetes": "KUBERNETES_SERVICE_HOST" in os.environ,
            "gpus": gpus,
            "env": {k: v for k, v in os.environ.items() if k in _ENV_EXACT or k.startswith(_ENV_PREFIXES)},
        },
    }


def spend_summary(run_dir: Path, meta: dict) -> dict[str, Any]:
    """Total spend: the ledger (durable), else the watcher's state.json, else the checkpoint's figure."""
    ledger = read_json_object(run_dir / "budget" / "ledger.json") or {}
    if (spent := _number(ledger.get("spent_usd"))) is not None:
        if ledger.get("open_session"):
            spent += float(ledger.get("reserved_usd") or 0.0)
        return {
            "total_usd": spent,
            "cap_usd": ledger.get("cap_usd"),
            "source": ledger.get("source") or None,
            "from": "budget/ledger.json",
            "sessions": len(ledger.get("sessions") or []),
            "crashes": ledger.get("crashes", 0),
            "running_hours": (ledger.get("running_seconds") or 0) / 3600,
            "stop": ledger.get("stop"),
        }
    state = read_json_object(run_dir / "budget" / "state.json") or {}
    if (spent := _number(state.get("spent_usd"))) is not None:
        src = {"cap_usd": state.get("cap_usd"), "source": state.get("source"), "from": "budget/state.json"}
        return {"total_usd": spent, **src}
    spent = _number(meta.get("spent_usd"))
    src = "checkpoint meta.json" if spent is not None else None
    return {"total_usd": spent, "cap_usd": None, "source": None, "from": src}


def predicted_loss(config: dict, tokens: int | None) -> dict[str, Any] | None:
    """What `pretrain plan` predicts for this run's recipe after the tokens it trained, to read beside the
    achieved val loss (docs/recipes.md, "Predicting the final loss"); None without a config or tokens."""
    from app.config import config_from_dict
    from app.errors import ConfigError
    from app.tools.plan import predict_final_loss

    if not config or not isinstance(tokens, int) or tokens <= 0:
        return None
    try:
        p = predict_final_loss(config_from_dict(config), tokens)
    except (ConfigError, ValueError):  # a config this version cannot read: no prediction, the rest exports
        return None
    return {
        "val_loss": p.loss,
        "fit": p.fit.name,
        "parameters": p.params,
        "tokens": p.tokens,
        "multiplier": p.multiplier,
        "recipe": p.recipe,
        "error": p.fit.error,
    }


def copy_evals(run_dir: Path, out: Path) -> dict[str, dict]:
    """Copy RUN_DIR/eval/*.json (written by `pretrain eval`); return a summary per file."""
    summary: dict[str, dict] = {}
    for src in sorted((run_dir / "eval").glob("*.json")):
        if (data := read_json_object(src)) is None:
            continue
        (out / "eval").mkdir(exist_ok=True)
        shutil.copyfile(src, out / "eval" / src.name)
        harness, ours = data.get("results") or {}, data.get("pretrain") or {}
        summary[f"eval/{src.name}"] = {
            "step": ours.get("step"),
            "tasks": ours.get("tasks"),
            "lm_eval": {task: {k: v for k, v in m.items() if k != "alias"} for task, m in harness.items()},
            "core": (ours.get("core") or {}).get("core"),
        }
    return summary


def check_run(run_dir: Path, out: Path, force: bool, warn) -> tuple[ckpt.CheckpointInfo, list[dict]]:
    """The latest checkpoint that verifies (sha256) and the log rows of the trajectory that led to it (all
    steps, also those past the checkpoint), once `out` is known to be writable; UserError (one line) on bad
    input: no run dir, a step dir, no metrics.jsonl, no usable checkpoint, a non-empty --output. `warn`
    reports each checkpoint skipped as damaged."""
    if not run_dir.is_dir():
        msg = f"{run_dir} is not a directory; pass a run dir written by `pretrain train --out RUN_DIR`"
        raise UserError(msg)
    if (run_dir / ckpt.META).exists():
        raise UserError(f"{run_dir} is a checkpoint dir; pass its run dir ({run_dir.parent.parent})")
    log_path = run_dir / "metrics.jsonl"
    if not log_path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl; is it a run dir written by `pretrain train --out`?")
    logged = effective_rows(read_rows(log_path))
    if not logged and log_path.stat().st_size:
        msg = f"{log_path} holds no metrics records (JSON lines with a step); is it the log of a run?"
        raise UserError(msg)
    info = ckpt.resolve_latest(run_dir, "sha256", warn)
    if info is None:
        raise UserError(f"no usable checkpoint under {run_dir / ckpt.CKPT_DIR}; nothing to export")
    if out.resolve() == run_dir.resolve():
        raise UserError("--output must differ from RUN_DIR")
    if out.is_dir() and any(out.iterdir()) and not force:
        msg = f"--output {out} is not empty; choose a new directory, or add --force to replace its files"
        raise UserError(msg)
    check_writable_dir(out, "--output")  # also: a file in the way, one line
    return info, logged


def val_losses(rows: list[dict], meta: dict) -> dict[str, Any]:
    """The latest and the best val loss (and bits per byte) among the eval rows, with their steps."""
    evals = [r for r in rows if r.get("kind") == "eval" and _number(r.get("val_loss")) is not None]
    last_eval, best_eval = (evals[-1], min(evals, key=lambda r: r["val_loss"])) if evals else ({}, {})
    return {
        "latest": last_eval.get("val_loss"),
        "latest_step": last_eval.get("step"),
        "latest_bpb": last_eval.get("val_bpb"),
        "best": best_eval.get("val_loss", meta.get("best_val_loss")),
        "best_step": best_eval.get("step"),
        "best_bpb": best_eval.get("val_bpb"),
    }


def export_hf(
    run_dir: Path,
    out: Path,
    force: bool = False,
    dtype: str = "float32",
    license: str | None = None,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
):
    """`--format hf`: the run's latest checkpoint as a folder Hugging Face transformers loads
    (app/tools/hf_export.py writes it), after the same checks as the report; UserError (one line) on bad
    input. Returns what was written (hf_export.HFExport)."""
    from app.tools.hf_export import check_options, write_folder

    check_options(dtype, license, max_shard_size)
    info, logged = check_run(run_dir, out, force, ckpt.warn_stderr)
    rows = [r for r in logged if r["step"] <= info.step]  # the exported model's history
    facts = {"val_loss": val_losses(rows, info.meta), "spend": spend_summary(run_dir, info.meta)}
    return write_folder(run_dir, info, out, facts, dtype, license, max_shard_size)


def export(run_dir: Path, out: Path, force: bool = False) -> Path:
    """Write the export of `run_dir` into `out`; UserError (one line) on bad input."""
    warn = functools.cache(ckpt.warn_stderr)  # once per message: latest and best may skip the same checkpoint
    info, logged = check_run(run_dir, out, force, warn)

    # Rows past the exported step (after the last checkpoint, or of checkpoints that failed verification)
    # are not the exported model's history: the CSV, plots and val losses stop at its step.
    rows = [r for r in logged if r["step"] <= info.step]
    meta = info.meta
    config = meta.get("config") or {}
    trainer_state = read_json_object(info.path / "trainer_state.json") or {}

    write_csv(out / "metrics.csv", metric_values(rows))
    write_plots(out, rows, run_dir.resolve().name, ((config.get("optim") or {}).get("grad_clip")))
    weights = write_final(out / "final.safetensors", info)
    files = ["manifest.json", "metrics.csv", *PLOTS, "final.safetensors"]
    tok = info.path / "tokenizer.json"
    if tok.is_file():
        shutil.copyfile(tok, out / "tokenizer.json")
        files.append("tokenizer.json")

    benchmarks = copy_evals(run_dir, out)  # `pretrain eval` results
    files += list(benchmarks)

    start, stop = (  # the last `start` and `stop` events
        next((r for r in reversed(rows) if r.get("kind") == "event" and r.get("event") == e), {})
        for e in ("start", "stop")
    )
    # verified like the latest (sha256): a damaged checkpoint with a lower val loss is never reported as best
    best_ckpt = ckpt.resolve_best(run_dir, "sha256", warn, known=info)
    versions = dict(meta.get("versions") or {})
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "run": {"name": run_dir.resolve().name, "dir": str(run_dir.resolve()), "exported_unix": time.time()},
        "seed": (config.get("train") or {}).get("seed"),
        "versions": {"trained_with": versions, "exported_with": ckpt.versions()},
        **{k: versions.get(k) for k in ("torch", "python", "cuda")},
        "preset": config.get("preset"),
        "config_hash": config_hash(config),
        "config": config,
        "cluster": cluster_spec(meta, start),
        "spend": spend_summary(run_dir, meta),
        "step": info.step,
        "tokens": meta.get("tokens", trainer_state.get("tokens")),
        "elapsed_hours": (trainer_state.get("elapsed_seconds") or 0.0) / 3600,
        "last_logged_step": next((r["step"] for r in reversed(logged) if r.get("kind") == "train"), None),
        "parameters": start.get("parameters") or weights["parameters"],
        "val_loss": {
            **val_losses(rows, meta),
            "predicted": predicted_loss(config, meta.get("tokens", trainer_state.get("tokens"))),
        },
        "stop": {k: stop.get(k) for k in ("cause", "reason", "exit_code")} if stop else None,
        "checkpoint": {
            "latest": str(info.path),
            "latest_step": info.step,
            "best": str(best_ckpt.path) if best_ckpt else None,
            "best_step": best_ckpt.step if best_ckpt else None,
            "model_sha256": weights["sha256"],  # of final.safetensors: the same weights, the same hash
        },
        "weights": {
            "file": "final.safetensors",
            "tensors": weights["tensors"],
            "tied": weights["tied"],
            **vocab_rows(config.get("model") or {}),
        },
        "evals": benchmarks,
        "files": files,
        "sha256": {name: sha256_file(out / name) for name in files if name != "manifest.json"},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return out
