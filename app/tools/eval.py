"""`pretrain eval`: benchmark a checkpoint with EleutherAI's lm-eval harness, or on a local CORE bundle.

The checkpoint is wrapped as lm-eval's `LM` (loglikelihood, loglikelihood_rolling, generate_until;
app/tools/scoring.py does the work), so any lm-eval task runs: the built-in ones (their datasets come from
the Hugging Face Hub: point HF_DATASETS_CACHE at a copy when offline) and your own task YAML files
(--include-path DIR). `--tasks core` runs the CORE-style bundle in --core-dir (app/tools/core_eval.py).

Results: RUN_DIR/eval/step_NNNNNN-<tasks>.json (the run dir of the checkpoint), which `pretrain export`
copies into its output and lists in manifest.json. lm-eval's keys ("results", "versions", ...) are at the
top, as its own tools read them (`lm_eval.utils.make_table`); ours (step, checkpoint, CORE) under "pretrain".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from app.errors import UserError
from app.files import atomic_write_json, check_writable_dir

EXTRA_HINT = "pip install 'pretrain[eval]' (make setup installs it)"
EVAL_DIR = "eval"
KEEP = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")  # fmt: skip


def make_lm(scorer):
    """The checkpoint as an lm-eval LM (built here: lm_eval is an optional extra)."""
    from lm_eval.api.model import LM

    class PretrainLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return scorer.loglikelihood([r.args for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            return [scorer.rolling(r.args[0]) for r in requests]

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            out = []
            for r in requests:
                context, kw = r.args
                until = kw.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                out.append(scorer.generate(context, until, int(kw.get("max_gen_toks", 256))))
            return out

    return PretrainLM()


def run_lm_eval(scorer, tasks: list[str], include_path: str | None, limit, num_fewshot, seed: int) -> dict:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise UserError(f"pretrain eval needs the eval extra ({e.name} is missing): {EXTRA_HINT}") from None
    manager = None
    if include_path:  # your own tasks alone load in a blink; the built-in index takes ~10 s to scan
        if not Path(include_path).is_dir():
            raise UserError(f"--include-path {include_path} is not a directory of task YAML files")
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if any(not manager.match_tasks([t]) for t in tasks):
            manager = None
    manager = manager or TaskManager(include_path=include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = (
            f" or in --include-path {include_path}"
            if include_path
            else "; add --include-path DIR for your own"
        )
        raise UserError(f"unknown lm-eval task(s): {', '.join(unknown)} (not built in{where})")
    try:
        res = lm_eval.simple_evaluate(
            model=make_lm(scorer),
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
            bootstrap_iters=0,  # no stderr resampling: exact, fast, deterministic
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except OSError as e:  # a task's dataset: not on the Hub's cache when offline, a missing data file, ...
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise UserError(
            f"lm-eval could not load the data of {', '.join(tasks)} ({why}); offline, point HF_DATASETS_CACHE "
            "at a copy of it"
        ) from None
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(res))
    return json.loads(json.dumps({k: res[k] for k in KEEP if k in res}, default=handle_non_serializable))


def results_path(run_dir: Path, step: int, tasks: list[str]) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", "+".join(tasks))[:80]
    return run_dir / EVAL_DIR / f"step_{step:06d}-{name}.json"


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from app.tools.sample import load_for_inference, pick_device
    from app.tools.scoring import Scorer

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks is empty; name lm-eval tasks (e.g. hellaswag) or core")
    if "core" in tasks and not args.core_dir:
        raise UserError(
            "--tasks core needs --core-dir DIR (a local CORE bundle; layout in `pretrain eval --help`)"
        )
    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit must be > 0, got {args.limit}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    harness = [t for t in tasks if t != "core"]  # lm-eval's
    if harness:
        import importlib.util

        if importlib.util.find_spec("lm_eval") is None:
            raise UserError(f"pretrain eval needs the eval extra for lm-eval tasks: {EXTRA_HINT}")
    device = pick_device(args.device)
    if args.output:  # an unwritable --output fails now, not after the whole evaluation
        path = Path(args.output)
        if path.is_dir():
            raise UserError(f"--output {path} is a directory; give a file name, e.g. {path / 'results.json'}")
        check_writable_dir(path.parent, "--output")
    if args.core_dir:
        from app.tools.core_eval import load_bundle

        load_bundle(args.core_dir)  # a bad bundle fails before the model loads
    model, tok, info = load_for_inference(args.checkpoint, device, args.which)
    if not args.output:
        default = results_path(info.path.parent.parent, info.step, tasks).parent
        made = not default.exists()
        try:
            check_writable_dir(default, "results dir")
        except UserError as e:
            raise UserError(f"{e}; or pass --output FILE to write the results elsewhere") from None
        if made:  # written at the end; a failed evaluation must not leave an empty dir behind
            default.rmdir()
    scorer = Scorer(model, tok, args.batch_size)
    ours: dict[str, Any] = {
        "checkpoint": str(info.path),
        "step": info.step,
        "val_loss": info.val_loss,
        "tasks": tasks,
        "limit": args.limit,
        "unix": time.time(),
    }
    out: dict[str, Any] = {"pretrain": ours}
    if harness:
        out |= run_lm_eval(scorer, harness, args.include_path, args.limit, args.num_fewshot, args.seed)
    if "core" in tasks:
        from tqdm import tqdm

        from app.tools.core_eval import evaluate_core

        bar = tqdm(unit="item", disable=not sys.stderr.isatty())

        def progress(label: str, done: int, total: int) -> None:
            bar.set_description(label)
            bar.total = total
            bar.n = done
            bar.refresh()

        ours["core"] = core = evaluate_core(scorer, args.core_dir, args.limit, progress)
        bar.close()
        for label, r in core["tasks"].items():
            print(f"core {label}: accuracy {r['accuracy']:.4f} (centered {r['centered']:.4f}, n={r['n']})")
        print(f"CORE: {core['core']:.4f}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.tools.sample import add_checkpoint_arguments

    add_checkpoint_arguments(p, "best", "for a run dir: lowest val loss or newest")
    p.add_argument(
        "--tasks",
        required=True,
        help="comma-separated lm-eval task names (built in, or defined in --include-path), and/or `core`",
    )
    p.add_argument(
        "--include-path", default=None, metavar="DIR", help="a directory of your own lm-eval task YAMLs"
    )
    p.add_argument(
        "--core-dir",
        default=None,
        metavar="DIR",
        help="a CORE-style bundle: core.yaml (icl_tasks), eval_data/*.jsonl, eval_meta_data.csv; "
        "see docs/evaluation.md",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N examples per task")
    p.add_argument(
        "--num-fewshot", type=int, default=None, metavar="K", help="override the tasks' few-shot count"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, metavar="N", help="sequences per forward pass (default 16)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA when available (default); the weights stay in fp32 on either",
    )
    p.add_argument("--seed", type=int, default=1234, help="seed for few-shot sampling (default 1234)")
    p.add_argument(
        "--output",
        default=None,
        metavar="FILE",
        help="results JSON (default RUN_DIR/eval/step_NNNNNN-<tasks>.json); its directory is checked for "
        "write access before the evaluation starts",
    )


def run(args: argparse.Namespace) -> int:
    out = evaluate(args)
    ours = out["pretrain"]
    run_dir = Path(ours["checkpoint"]).parent.parent
    path = Path(args.output) if args.output else results_path(run_dir, ours["step"], ours["tasks"])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, out)
    except OSError as e:
        raise UserError(f"cannot write results to {path}: {e.strerror}") from None
    print(f"results: {path}")
    return 0
