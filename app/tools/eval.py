"""`pretrain eval`: benchmark a checkpoint with EleutherAI's lm-eval harness, or on a local CORE bundle.

The checkpoint is wrapped as lm-eval's `LM` (app/tools/scoring.py does the work), so any lm-eval task
runs, built-in or from --include-path; `--tasks core` runs the CORE-style bundle (app/tools/core_eval.py).
Results go to RUN_DIR/eval/ in lm-eval's own shape, ours under "pretrain" (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from app.errors import UserError
from app.files import atomic_write_json, check_writable_dir

KEEP = (
    "results",
    "groups",
    "group_subtasks",
    "configs",
    "versions",
    "n-shot",
    "higher_is_better",
    "n-samples",
)


def make_lm(scorer):
    """The checkpoint as an lm-eval LM (built here: lm_eval is an optional extra)."""
    from lm_eval.api.model import LM

    class PretrainLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return scorer.loglikelihood([r.args for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            return [scorer.rolling(r.args[0]) for r in requests]

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            args = [r.args for r in requests]  # (context, {"until": str or list, "max_gen_toks": n, ...})
            return [scorer.generate(c, kw.get("until"), int(kw.get("max_gen_toks", 256))) for c, kw in args]

    return PretrainLM()


def run_lm_eval(scorer, tasks: list[str], include_path: str | None, limit, num_fewshot, seed: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

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
        where = f" or in --include-path {include_path}" if include_path else "; add --include-path DIR"
        raise UserError(f"unknown lm-eval task(s): {', '.join(unknown)} (not built in{where})")
    try:
        seeds = {f"{kind}random_seed": seed for kind in ("", "numpy_", "torch_", "fewshot_")}
        res = lm_eval.simple_evaluate(
            model=make_lm(scorer),
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
            bootstrap_iters=0,  # no stderr resampling: exact, fast, deterministic
            **seeds,
        )
    except OSError as e:  # a task's dataset: not on the Hub's cache when offline, a missing data file, ...
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        offline = "offline, point HF_DATASETS_CACHE at a copy of it"
        raise UserError(f"lm-eval could not load the data of {', '.join(tasks)} ({why}); {offline}") from None
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(res))
    return json.loads(json.dumps({k: res[k] for k in KEEP if k in res}, default=handle_non_serializable))


def results_path(run_dir: Path, step: int, tasks: list[str]) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", "+".join(tasks))[:80]
    return run_dir / "eval" / f"step_{step:06d}-{name}.json"


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from app.tools.core_eval import evaluate_core, load_bundle
    from app.tools.sample import load_for_inference, pick_device, require_extra
    from app.tools.scoring import Scorer

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks is empty; name lm-eval tasks (e.g. hellaswag) or core")
    if "core" in tasks and not args.core_dir:
        bundle = "a local CORE bundle; layout in `pretrain eval --help`"
        raise UserError(f"--tasks core needs --core-dir DIR ({bundle})")
    if args.limit is not None and args.limit <= 0:
        raise UserError(f"--limit must be > 0, got {args.limit}")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    harness = [t for t in tasks if t != "core"]  # lm-eval's
    if harness:  # the extra is checked before the model loads
        require_extra("eval", "lm_eval.tasks")
    device = pick_device(args.device)
    if args.output:  # an unwritable --output fails now, not after the whole evaluation
        path = Path(args.output)
        if path.is_dir():
            raise UserError(f"--output {path} is a directory; give a file name, e.g. {path / 'results.json'}")
        check_writable_dir(path.parent, "--output")
    if args.core_dir:
        load_bundle(args.core_dir)  # a bad bundle fails before the model loads
    model, tok, info = load_for_inference(args.checkpoint, device, args.which)
    if not args.output:
        default = results_path(info.path.parent.parent, info.step, tasks).parent
        try:  # not created yet: a failed evaluation must not leave an empty dir behind
            check_writable_dir(default, "results dir", create=False)
        except UserError as e:
            raise UserError(f"{e}; or pass --output FILE to write the results elsewhere") from None
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
        ours["core"] = core = evaluate_core(scorer, args.core_dir, args.limit)
        for label, r in core["tasks"].items():
            print(f"core {label}: accuracy {r['accuracy']:.4f} (centered {r['centered']:.4f}, n={r['n']})")
        print(f"CORE: {core['core']:.4f}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from app.tools.sample import add_checkpoint_arguments

    add_checkpoint_arguments(p, "best")
    add = p.add_argument
    tasks = "comma-separated lm-eval task names (built in, or defined in --include-path), and/or `core`"
    add("--tasks", required=True, help=tasks)
    add("--include-path", default=None, metavar="DIR", help="a directory of your own lm-eval task YAMLs")
    bundle = "a CORE-style bundle: core.yaml (icl_tasks), eval_data/*.jsonl, eval_meta_data.csv"
    add("--core-dir", default=None, metavar="DIR", help=f"{bundle}; see docs/evaluation.md")
    add("--limit", type=int, default=None, metavar="N", help="at most N examples per task")
    add("--num-fewshot", type=int, default=None, metavar="K", help="override the tasks' few-shot count")
    add("--batch-size", type=int, default=16, metavar="N", help="sequences per forward pass (default 16)")
    device = "auto: CUDA when available (default); the weights stay in fp32 on either"
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help=device)
    add("--seed", type=int, default=1234, help="seed for few-shot sampling (default 1234)")
    output = "results JSON (default RUN_DIR/eval/step_NNNNNN-<tasks>.json); its dir is checked at the start"
    add("--output", default=None, metavar="FILE", help=output)


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
