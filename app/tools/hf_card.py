"""The model card (README.md) of a Hugging Face export: what the Hub reads and what a user reads first.

YAML front matter by the Hub's metadata rules (written by huggingface_hub's ModelCardData): the license
only when `--license` names one (never guessed), `library_name: transformers`, `pipeline_tag:
text-generation`, tags, the Hub datasets the run trained on when its data dir says so, and the run's
`pretrain eval` results of the exported step as `model-index`. Then how to load, score and serve the
folder, the model's config, and the run's val loss, bits per byte, tokens and spend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from app import __version__
from app.budget.files import read_json_object
from app.config import Config
from app.trainer.checkpoint import store as ckpt

HUB_DATASET = "hf://datasets/"


def hub_datasets(config: Config, meta: dict) -> list[str]:
    """The Hub datasets (OWNER/NAME) the run's data dir was prepared from, when that dir is readable here."""
    data_dir = (meta.get("data") or {}).get("dir") or config.data.dataset
    if config.data.dataset == "embedded" or not data_dir:
        return []
    manifest = read_json_object(Path(data_dir) / "manifest.json") or {}
    repos = []
    for source in manifest.get("sources") or []:
        if isinstance(source, str) and source.startswith(HUB_DATASET):
            owner, name = (source[len(HUB_DATASET) :].split("/") + [""])[:2]
            repo = f"{owner}/{name.partition('@')[0]}"
            if repo not in repos:
                repos.append(repo)
    return repos


def eval_results(run_dir: Path, step: int) -> list[tuple[str, Any]]:
    """(source file, huggingface_hub EvalResult) for every metric `pretrain eval` wrote for this step: each
    lm-eval task's metrics (not their standard errors), and the CORE score with each CORE task's accuracy."""
    from huggingface_hub import EvalResult

    found = []
    for path in sorted((run_dir / "eval").glob("*.json")):
        data = read_json_object(path) or {}
        ours = data.get("pretrain") or {}
        if ours.get("step") != step:
            continue  # another checkpoint's results (`pretrain eval` scores the best by default)
        shots = data.get("n-shot") or {}
        for task, metrics in (data.get("results") or {}).items():
            for key, value in metrics.items():
                metric, _, filtered = key.partition(",")
                if "stderr" in metric or not isinstance(value, int | float) or isinstance(value, bool):
                    continue
                label = metric if filtered in ("", "none") else f"{metric} ({filtered})"
                name = f"{label}, {shots[task]}-shot" if task in shots else label
                result = EvalResult("text-generation", task, task, metric, value, metric_name=name)
                found.append((path.name, result))
        core = ours.get("core") or {}
        if isinstance(core.get("core"), int | float):
            found.append((path.name, EvalResult("text-generation", "core", "CORE", "core", core["core"])))
            for label, r in (core.get("tasks") or {}).items():
                result = EvalResult(
                    "text-generation", f"core-{label}", f"CORE {label}", "accuracy", r.get("accuracy")
                )
                found.append((path.name, result))
    return found


def front_matter(
    name: str, custom_code: bool, looped: bool, license: str | None, datasets: list[str], results: list
) -> str:
    from huggingface_hub import ModelCardData

    tags = ["pretrain", "custom_code" if custom_code else "llama", *(["looped"] if looped else [])]
    data = ModelCardData(
        license=license,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        datasets=datasets or None,
        model_name=name,
        eval_results=[r for _, r in results] or None,
    )
    return f"---\n{data.to_yaml()}\n---\n"


def _number(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, int | float) and not isinstance(value, bool) else "-"


def _eval(loss: Any, bpb: Any, step: Any) -> str:
    """A val loss with its bits per byte and step, as far as they are known."""
    if loss is None:
        return "-"
    bits = f", {_number(bpb, '.4f')} bits per byte" if bpb is not None else ""
    return f"{_number(loss, '.4f')}{bits}" + (f" (step {step:,})" if isinstance(step, int) else "")


def _dollars(value: Any) -> str:
    return "-" if value is None else f"${_number(value, ',.2f')}"


def usage(custom_code: bool, looped: bool) -> str:
    """How to load, score and serve the folder."""
    remote = ", trust_remote_code=True" if custom_code else ""
    lines = [
        "## Use it",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'path = "."  # this folder, or its Hub repo id',
        "tokenizer = AutoTokenizer.from_pretrained(path)",
        f"model = AutoModelForCausalLM.from_pretrained(path{remote})",
        'ids = tokenizer("ROMEO:", return_tensors="pt").input_ids',
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=64)[0]))",
        "```",
        "",
    ]
    if custom_code:
        lines += [
            "This model has its own modeling code beside the weights (`modeling_pretrain_gpt.py`, "
            "`configuration_pretrain_gpt.py`; torch and transformers only): `trust_remote_code=True` runs "
            "it, so read it first.",
            "",
        ]
    arg = ",trust_remote_code=True" if custom_code else ""
    lines += [
        "Score it with lm-eval's Hugging Face model:",
        "",
        "```",
        f"lm_eval --model hf --model_args pretrained=PATH{arg} --tasks hellaswag",
        "```",
        "",
    ]
    if looped:
        lines += [
            "A looped model runs its shared blocks several times per token: vLLM cannot serve it, transformers can.",
            "",
        ]
    else:
        flag = " --trust-remote-code" if custom_code else ""
        lines += ["Serve it with vLLM:", "", "```", f"vllm serve PATH{flag}", "```", ""]
    return "\n".join(lines)


def model_card(
    run_dir: Path,
    info: ckpt.CheckpointInfo,
    config: Config,
    custom_code: bool,
    parameters: int,
    dtype: str,
    license: str | None,
    facts: dict,
) -> str:
    """The README.md of the export of `run_dir`'s checkpoint `info` (its `parameters` in `dtype`; custom_code:
    not a Llama); `facts`: the run's `val_loss` (latest and best, with bits per byte and steps) and `spend`
    (app/tools/export.py summarises both)."""
    name = run_dir.resolve().name
    meta = info.meta
    datasets = hub_datasets(config, meta)
    results = eval_results(run_dir, info.step)
    val, spend = facts["val_loss"], facts["spend"]
    tokens = meta.get("tokens")
    model = config.model
    loop = model.loop
    kind = "A GPT with its own modeling code" if custom_code else "A Llama (LlamaForCausalLM)"
    looped = (
        f", looped: {loop.prelude} + {loop.recurrent} x {loop.recurrence} + {loop.coda} blocks"
        if model.looped
        else ""
    )
    data = (
        "the embedded Shakespeare corpus" if config.data.dataset == "embedded" else f"`{config.data.dataset}`"
    )
    parts = [
        front_matter(name, custom_code, model.looped, license, datasets, results),
        f"# {name}",
        "",
        f"{kind}, {parameters:,} parameters{looped}, pretrained with `pretrain` on {data} and exported "
        f"from its checkpoint at step {info.step} (`pretrain export --format hf`, weights in {dtype}).",
        "",
        usage(custom_code, model.looped),
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| preset | {config.preset or '-'} |",
        f"| step | {info.step:,} |",
        f"| tokens seen | {_number(tokens, ',')} |",
        f"| val loss, latest eval | {_eval(val['latest'], val['latest_bpb'], val['latest_step'])} |",
        f"| val loss, best eval | {_eval(val['best'], val['best_bpb'], val['best_step'])} |",
        f"| spend | {_dollars(spend['total_usd'])} |",
        f"| Hub datasets | {', '.join(datasets) or '-'} |",
        "",
        "## Model config",
        "",
        "```yaml",
        yaml.safe_dump({"model": config.to_dict()["model"]}, sort_keys=False).strip(),
        "```",
        "",
    ]
    if results:
        parts += [
            "## Evaluation",
            "",
            "`pretrain eval` on this checkpoint:",
            "",
            "| file | task | metric | value |",
            "|---|---|---|---|",
        ]
        for file, r in results:
            parts.append(
                f"| {file} | {r.dataset_name} | {r.metric_name or r.metric_type} | {_number(r.metric_value, '.4f')} |"
            )
        parts.append("")
    parts += ["## License", ""]
    if license:
        parts.append(f"`{license}`, as chosen at export.")
    else:
        parts.append(
            "No license was chosen at export, so none is declared here. Whoever owns the run sets one: "
            "`pretrain export --format hf --license ID` (a Hub license identifier such as apache-2.0)."
        )
    trained = (meta.get("versions") or {}).get("pretrain")
    parts += [
        "",
        f"Trained with pretrain {trained or '(version unknown)'}, exported with pretrain {__version__}.",
        "",
    ]
    return "\n".join(parts)
