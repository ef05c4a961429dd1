"""CORE-style evaluation from a local bundle (`pretrain eval --tasks core --core-dir DIR`): the mean over
in-context-learning tasks of the centered accuracy (acc - random) / (1 - random) (the DCLM paper's CORE).
The bundle's layout and the scoring rules are in docs/evaluation.md (CORE)."""

from __future__ import annotations

import csv
import json
import random
import sys
from pathlib import Path
from typing import Any

import yaml

from app.errors import UserError
from app.tools.scoring import Scorer

TYPES = ("multiple_choice", "schema", "language_modeling")


def load_bundle(directory: str | Path) -> tuple[list[dict], dict[str, float]]:
    root = Path(directory)
    spec = root / "core.yaml"
    if not spec.is_file():
        raise UserError(f"--core-dir {root}: no core.yaml; see `pretrain eval --help` for the bundle layout")
    try:
        data = yaml.safe_load(spec.read_text()) or {}
    except yaml.YAMLError:
        raise UserError(f"{spec} is not valid YAML") from None
    tasks = data.get("icl_tasks") if isinstance(data, dict) else None
    if not isinstance(tasks, list) or not tasks:
        raise UserError(f"{spec}: expected `icl_tasks:` with a list of tasks")
    for t in tasks:
        if not isinstance(t, dict) or not {"label", "dataset_uri", "icl_task_type"} <= set(t):
            raise UserError(f"{spec}: every task needs label, dataset_uri and icl_task_type; got {t!r}"[:300])
        if t["icl_task_type"] not in TYPES:
            kind = f"task {t['label']}: icl_task_type '{t['icl_task_type']}'"
            raise UserError(f"{spec}: {kind} is not one of {', '.join(TYPES)}")
    baselines: dict[str, float] = {}
    meta = root / "eval_meta_data.csv"
    if meta.is_file():
        with meta.open(newline="") as f:
            for row in csv.DictReader(f):
                try:
                    baselines[row["Eval Task"]] = float(row["Random baseline"])
                except (KeyError, TypeError, ValueError):
                    msg = f"{meta}: needs columns 'Eval Task' and 'Random baseline' (a number)"
                    raise UserError(msg) from None
    return tasks, baselines


def read_items(root: Path, task: dict) -> list[dict]:
    path = root / "eval_data" / task["dataset_uri"]
    try:
        lines = path.read_text().splitlines()
    except OSError:
        raise UserError(f"CORE task {task['label']}: cannot read {path}") from None
    try:
        return [json.loads(line) for line in lines if line.strip()]
    except ValueError:
        raise UserError(f"CORE task {task['label']}: {path} is not JSON lines") from None


def _shots(items: list[dict], i: int, k: int) -> list[dict]:
    if k <= 0:
        return []
    others = [j for j in range(len(items)) if j != i]
    return [items[j] for j in random.Random(1234 + i).sample(others, min(k, len(others)))]


def _demo(kind: str, item: dict, delim: str) -> str:
    if kind == "multiple_choice":
        return f"{item['query']}{delim}{item['choices'][item['gold']]}"
    if kind == "schema":
        return f"{item['context_options'][item['gold']]}{delim}{item['continuation']}"
    return f"{item['context'].strip()}{delim}{item['continuation']}"


def item_correct(scorer: Scorer, kind: str, item: dict, shots: list[dict], delim: str) -> bool:
    prefix = "".join(_demo(kind, s, delim) + "\n\n" for s in shots)
    if kind == "language_modeling":  # right when greedy decoding gives the continuation
        context = prefix + item["context"].strip() + delim
        ((_, greedy),) = scorer.loglikelihood([(context, item["continuation"])])
        return greedy
    if kind == "multiple_choice":
        pairs = [(prefix + item["query"] + delim, c) for c in item["choices"]]
    else:
        pairs = [(prefix + o + delim, item["continuation"]) for o in item["context_options"]]
    encoded = [scorer.encode_pair(c, x) for c, x in pairs]
    scores = zip(scorer.score(encoded), encoded, strict=True)
    means = [lp / max(len(cont), 1) for (lp, _), (_, cont) in scores]  # per token of the option
    return max(range(len(means)), key=means.__getitem__) == int(item["gold"])


def evaluate_core(scorer: Scorer, directory: str | Path, limit: int | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    root = Path(directory)
    tasks, baselines = load_bundle(root)
    results: dict[str, Any] = {}
    for task in tasks:
        kind, label = task["icl_task_type"], task["label"]
        delim = task.get("continuation_delimiter", " ")
        shots = task.get("num_fewshot", 0)
        k = int(shots[0] if isinstance(shots, list) else shots)
        items = read_items(root, task)[: limit or None]
        try:
            right = 0
            for i, item in enumerate(tqdm(items, label, unit="item", disable=not sys.stderr.isatty())):
                right += item_correct(scorer, kind, item, _shots(items, i, k), delim)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            msg = f"CORE task {label}: an item does not fit {kind} ({type(e).__name__}: {e})"
            raise UserError(msg) from None
        acc = right / max(len(items), 1)
        if label in baselines:
            random_acc = baselines[label] / 100
        else:  # multiple choice: guessing among the choices
            random_acc = 1 / len(items[0]["choices"]) if kind == "multiple_choice" and items else 0.0
        centered = (acc - random_acc) / (1 - random_acc) if random_acc < 1 else 0.0
        results[label] = dict(accuracy=acc, centered=centered, random=random_acc, n=len(items), shots=k)
    core = sum(r["centered"] for r in results.values()) / max(len(results), 1)
    return {"core": core, "tasks": results}
