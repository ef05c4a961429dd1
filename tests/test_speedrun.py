"""The speedrun presets (issue #33): every choice visible in --print-config, the quality benchmark's
measurement machinery on a real (short) run, and checkpoints of the recipe before #33 still usable."""

from __future__ import annotations

import copy
import importlib.util
import json
import urllib.request
from pathlib import Path

import pytest
import yaml

from app.config import PRESET_DIR, load_config
from benchmarks.bench_quality import TINY_BEFORE_33
from tests.conftest import FAST, cli_env, pretrain, train_rows
from tests.test_switches import ok


def test_gpt2_124m_speedrun_prints_every_choice():
    proc = pretrain("train", "--preset", "gpt2-124m-speedrun", "--print-config")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("#")))
    assert printed == load_config("gpt2-124m-speedrun").to_dict()  # every key, not only the preset's
    for section, keys in yaml.safe_load((PRESET_DIR / "gpt2-124m-speedrun.yaml").read_text()).items():
        for key, value in keys.items():
            assert printed[section][key] == value, f"{section}.{key}"
    # the record's optimizer split: Muon on the block matrices, AdamW with its own LR per group
    assert "#   matrix    Muon  lr 0.04" in proc.stdout
    assert "#   embedding AdamW lr 0.6" in proc.stdout and "#   head      AdamW lr 0.008" in proc.stdout


# ---------------------------------------------------------------- a run of the recipe before #33


def write_before_33(path: Path) -> Path:
    """The tiny recipe before #33 (FAST's shape) as a checkpoint's meta.json would hold it: `--config` with
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
