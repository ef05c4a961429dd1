"""The speedrun presets: every choice visible in --print-config, and checkpoints of the AdamW recipe
still usable (sample, serve, eval, export, the refusal, resume with their own config)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import urllib.request
from pathlib import Path

import pytest
import yaml

from app.config import load_config
from app.config.presets import preset_layers
from benchmarks.bench_quality import TINY_BEFORE_33
from tests.conftest import FAST, cli_env, pretrain, train_rows
from tests.test_switches import ok


def test_gpt2_124m_speedrun_prints_every_choice():
    proc = pretrain("train", "--preset", "gpt2-124m-speedrun", "--print-config")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("#")))
    assert printed == load_config("gpt2-124m-speedrun").to_dict()  # every key, not only the preset's
    written: dict = {}  # what the preset file and its base (the speedrun recipe) say, the preset's winning
    for _, layer in preset_layers("gpt2-124m-speedrun"):
        for section, keys in layer.items():
            written.setdefault(section, {}).update(keys)
    assert written["model"]["qk_norm"] is True and written["model"]["value_embeds"] == 3
    for section, keys in written.items():
        for key, value in keys.items():
            assert printed[section][key] == value, f"{section}.{key}"
    # the record's optimizer split: Muon on the block matrices, AdamW with its own LR per group
    assert "#   matrix    Muon  lr 0.04" in proc.stdout
    assert "#   embedding AdamW lr 0.6" in proc.stdout and "#   head      AdamW lr 0.008" in proc.stdout


# ---------------------------------------------------------------- a run of the AdamW recipe


def write_before_33(path: Path) -> Path:
    """tiny on the AdamW recipe (FAST's shape) as a checkpoint's meta.json would hold it: `--config` with
    it builds exactly that recipe (config defaults + these keys), whatever today's tiny preset is."""
    config = copy.deepcopy(TINY_BEFORE_33)
    config["model"].update(n_layer=2, d_model=64, n_head=4, n_kv_head=2, seq_len=64)
    config["train"].update(micro_batch_size=8, eval_every=2, log_every=1)
    config["metrics"] = {"progress": False}
    config["checkpoint"] = {"every_minutes": 0, "every_steps": 2}
    path.write_text(json.dumps({"step": 0, "config": config}))
    return path


@pytest.mark.slow  # six CLI runs and a server, ~1 minute on 2 cores
def test_a_run_of_the_recipe_before_33_samples_serves_evaluates_exports_and_resumes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    before = write_before_33(tmp_path / "before.json")
    ok(pretrain("train", "--out", str(run), "--config", str(before), "--max-steps", "2"))
    meta = run / "checkpoints" / "step_000002" / "meta.json"
    saved = json.loads(meta.read_text())["config"]
    assert saved["optim"]["name"] == "adamw" and saved["schedule"]["name"] == "cosine"
    assert saved["model"]["mlp"] == "swiglu" and not saved["data"]["align_to_documents"]

    sampled = ok(pretrain("sample", "--checkpoint", str(run), "--prompt", "ROMEO", "--max-new-tokens", "8"))
    assert sampled.stdout.startswith("ROMEO")
    exported = ok(pretrain("export", str(run), "--output", str(tmp_path / "export")))
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["val_loss"]["predicted"]["recipe"].startswith("classic recipe")
    assert "predicted" in exported.stdout
    from tests.test_serve import start_server, stop_server  # the serve extra (make setup installs it)

    url, proc = start_server("--checkpoint", str(run))
    try:
        body = json.dumps({"prompt": "ROMEO", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert json.loads(resp.read())["choices"][0]["text"]
    finally:
        stop_server(proc)
    if importlib.util.find_spec("lm_eval"):  # the eval extra (make setup installs it)
        from tests.test_eval import ROLLING_YAML

        tasks = tmp_path / "tasks"
        tasks.mkdir()
        data = tmp_path / "docs.jsonl"
        data.write_text(json.dumps({"text": "ROMEO:\nWhat light through yonder window breaks?"}) + "\n")
        (tasks / "rolling_ppl.yaml").write_text(ROLLING_YAML.format(data=data))
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
        out = tmp_path / "eval.json"
        args = ["--checkpoint", str(run), "--tasks", "rolling_ppl", "--include-path", str(tasks)]
        ok(
            pretrain(
                "eval", *args, "--output", str(out), "--device", "cpu", env=cli_env(HF_HOME=str(tmp_path))
            )
        )
        assert json.loads(out.read_text())["results"]["rolling_ppl"]["bits_per_byte,none"] > 0

    # today's default recipe is another model: refused in one line that names the fix
    refused = pretrain("train", "--out", str(run), *FAST, "--max-steps", "4")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert f"--config {meta.parent}/meta.json" in refused.stderr.strip().splitlines()[-1]
    # the fix: its own config, from the checkpoint; the run goes on where it stopped, with its recipe
    resumed = ok(pretrain("train", "--out", str(run), "--config", str(meta), "--max-steps", "4"))
    assert "resumed from" in resumed.stdout
    assert [r["step"] for r in train_rows(run)][-2:] == [3, 4]
    assert json.loads((run / "checkpoints" / "step_000004" / "meta.json").read_text())["config"] == {
        **saved,
        "train": {**saved["train"], "max_steps": 4},
    }


def test_tiny_and_tiny_speedrun_are_one_recipe_at_two_lengths():
    """The README and the loss prediction's multiplier count on tiny being tiny-speedrun's recipe, longer:
    the presets are separate files, so a change to one recipe must be made to both."""
    lengths = ["train.max_steps=800", "train.eval_every=200", "checkpoint.every_steps=400"]
    tiny = load_config("tiny").to_dict()
    speedrun = load_config("tiny-speedrun", overrides=lengths).to_dict()
    tiny.pop("preset")
    speedrun.pop("preset")
    assert tiny == speedrun


def test_the_tests_pin_of_the_recipe_before_33_is_that_recipe():
    """tests/conftest.py CLASSIC, over the tiny preset, trains the model, data order, optimizer and
    schedule of tiny on the AdamW recipe (the benchmark's TINY_BEFORE_33): a switch added to tiny but not to CLASSIC
    would quietly change what the pinned tests check."""
    from app.config import config_from_dict
    from tests.conftest import CLASSIC

    before = config_from_dict(copy.deepcopy(TINY_BEFORE_33))
    pinned = load_config("tiny", overrides=CLASSIC[1::2])
    # the benchmark's dict reads as a config written before vocabulary padding (vocab_multiple 1); BPE 2048
    # is a multiple of 128, so both models have the same rows
    padding = {"vocab_size": 2048, "vocab_multiple": 1}
    assert dataclasses.replace(pinned.model, **padding) == dataclasses.replace(before.model, **padding)
    assert pinned.data == before.data
    assert pinned.schedule.name == before.schedule.name
    assert pinned.schedule.warmup_steps == before.schedule.warmup_steps
    for key in ("name", "lr", "min_lr", "matrix_lr", "embedding_lr", "head_lr", "scalar_lr"):
        assert getattr(pinned.optim, key) == getattr(before.optim, key), key


def test_a_resume_is_refused_only_into_another_model(tmp_path):
    """The architecture check compares the model the weights were built as: d_ff 0 (derived, 4 x d_model
    for ReLU²) and the same width written out are one model; another MLP is not."""
    from app.errors import UserError
    from app.trainer.checkpoint.checkpointer import check_same_architecture
    from app.trainer.checkpoint.store import CheckpointInfo

    tiny = load_config("tiny")
    info = CheckpointInfo(tmp_path / "step_000010", 10, {"config": tiny.to_dict()})
    explicit = load_config("tiny", overrides=[f"model.d_ff={4 * tiny.model.d_model}", "model.n_kv_head=2"])
    check_same_architecture(info, explicit)
    with pytest.raises(UserError, match=r"was trained with model\.mlp=relu2, this run has swiglu"):
        check_same_architecture(info, load_config("tiny", overrides=["model.mlp=swiglu"]))
