"""TorchX: the repo's .torchxconfig and app/components.py, through the real `torchx` CLI.

`--dryrun -s kubernetes` renders the Volcano job without a cluster; `-s local_cwd` really runs the
trainer with torchrun and 2 processes.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TORCHX = [sys.executable, "-m", "torchx.cli.main"]


def torchx(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """The torchx CLI from the repo root (where .torchxconfig is read), with the venv's torchrun on PATH."""
    full_env = {k: v for k, v in os.environ.items() if k != "TORCHXCONFIG"}
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    full_env.update(env or {})
    return subprocess.run(
        [*TORCHX, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def scheduler_request(out: str) -> dict:
    assert "=== SCHEDULER REQUEST ===" in out, out
    return yaml.safe_load(out.split("=== SCHEDULER REQUEST ===", 1)[1])


def task_pods(job: dict) -> list[dict]:
    return [t["template"]["spec"] for t in job["spec"]["tasks"]]


def test_torchxconfig_sections():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / ".torchxconfig")
    assert cfg["cli:run"]["workspace"] == ""
    assert cfg["kubernetes"]["queue"]
    ddp = cfg["component:dist.ddp"]
    assert ddp["m"] == "app.train" and ddp["image"].startswith("pretrain:")
    assert "pretrain-data" in ddp["mounts"] and "pretrain-ckpt" in ddp["mounts"]


def test_dryrun_kubernetes_dist_ddp():
    """`torchx run --dryrun -s kubernetes dist.ddp` with only the repo's defaults: a Volcano job of our trainer."""
    proc = torchx("run", "--dryrun", "-s", "kubernetes", "dist.ddp")
    assert proc.returncode == 0, proc.stderr
    job = scheduler_request(proc.stdout)
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1" and job["kind"] == "Job"
    assert job["spec"]["schedulerName"] == "volcano"
    assert job["spec"]["queue"] == "default"
    (pod,) = task_pods(job)
    (c,) = pod["containers"]
    assert c["image"] == "pretrain:0.1.0"
    cmd = " ".join(c["command"])
    assert re.search(r"torchrun .*--nnodes 1 --nproc_per_node 8 .*-m app\.train", cmd), cmd
    for arg in ("--out /ckpt/torchx-pretrain", "--metrics-port 9400", "data.dataset=/data/fineweb-edu-10bt"):
        assert arg in cmd
    assert "--budget-cap-usd 1000" in cmd and "budget.in_process=false" not in cmd
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/data"]["name"]]["persistentVolumeClaim"]["claimName"] == "pretrain-data"
    assert mounts["/data"]["readOnly"] is True
    assert volumes[mounts["/ckpt"]["name"]]["persistentVolumeClaim"]["claimName"] == "pretrain-ckpt"
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert job["spec"]["maxRetry"] == 3


def test_dryrun_needs_the_queue(tmp_path):
    """Without the repo's .torchxconfig the kubernetes scheduler refuses to render: the config is what makes it work."""
    empty = tmp_path / ".torchxconfig"
    empty.write_text("[cli:run]\nworkspace =\n")
    proc = torchx(
        "run", "--dryrun", "-s", "kubernetes", "dist.ddp", "-m", "app.train", env={"TORCHXCONFIG": str(empty)}
    )
    assert proc.returncode != 0
    assert "queue" in proc.stderr


@pytest.mark.parametrize(("gpus", "nodes", "per_node"), [(16, 2, 8), (4, 1, 4), (64, 8, 8)])
def test_train_component_dryrun(gpus, nodes, per_node):
    proc = torchx(
        "run",
        "--dryrun",
        "-s",
        "kubernetes",
        "app/components.py:train",
        "--gpus",
        str(gpus),
        "--budget_cap_usd",
        "500",
        "--gpu_type",
        "h100-80gb",
    )
    assert proc.returncode == 0, proc.stderr
    job = scheduler_request(proc.stdout)
    pods = task_pods(job)
    assert len(pods) == nodes
    for pod in pods:
        (c,) = pod["containers"]
        cmd = " ".join(c["command"])
        assert f"--nnodes {nodes} --nproc_per_node {per_node}" in cmd
        assert "-m app.train --preset x1-50m" in cmd
        # no sidecar on this path: the guard runs in-process on rank 0
        assert "--budget-cap-usd 500.0 --set budget.in_process=true" in cmd
        assert f"--gpus {gpus}" in cmd and "budget.gpu_type=h100-80gb" in cmd
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(per_node)
        claims = {
            v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
        }
        assert claims == {"pretrain-data", "pretrain-ckpt"}


def test_train_component_refuses_uneven_gpus():
    proc = torchx("run", "--dryrun", "-s", "kubernetes", "app/components.py:train", "--gpus", "12")
    assert proc.returncode != 0
    assert "gpus=12 is not a multiple of gpus_per_node=8: use 8 or 16" in proc.stderr + proc.stdout


def test_prepare_component_dryrun():
    proc = torchx(
        "run",
        "--dryrun",
        "-s",
        "kubernetes",
        "app/components.py:prepare",
        "--input",
        "hf://datasets/karpathy/tinyshakespeare",
        "--tokenizer",
        "char",
        "--workers",
        "8",
    )
    assert proc.returncode == 0, proc.stderr
    (pod,) = task_pods(scheduler_request(proc.stdout))
    (c,) = pod["containers"]
    assert c["command"][:3] == ["pretrain", "prepare", "--input"]
    assert c["command"][3] == "hf://datasets/karpathy/tinyshakespeare"
    assert c["command"][c["command"].index("--tokenizer") + 1] == "char"
    assert "--vocab-size" not in c["command"] and "nvidia.com/gpu" not in json.dumps(c["resources"])
    (vol,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert vol["persistentVolumeClaim"]["claimName"] == "pretrain-data"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
    assert mount["mountPath"] == "/data" and not mount.get("readOnly")


def test_components_lint():
    """TorchX's own component linter (the CLI builds each component's flags from its signature)."""
    from torchx.specs.file_linter import validate

    for fn in ("train", "prepare"):
        assert validate(str(REPO / "app" / "components.py"), fn) == []


def test_components_python_api():
    from app import components

    app = components.train(
        gpus=0, nproc=2, data_pvc="", ckpt_pvc="", data="", out="runs/x", budget_cap_usd=2.5
    )
    (role,) = app.roles
    assert role.mounts == [] and role.resource.gpu == 0
    assert "--nnodes 1 --nproc_per_node 2" in role.args[1]
    assert "--budget-cap-usd 2.5" in role.args[1] and "--gpus" not in role.args[1]
    with pytest.raises(ValueError, match="gpus=-1"):
        components.train(gpus=-1)


@pytest.mark.slow
def test_local_cwd_runs_the_trainer(tmp_path):
    """`torchx run -s local_cwd dist.ddp` (repo defaults + overrides) trains 3 steps with 2 processes."""
    out = tmp_path / "run"
    proc = torchx(
        "run",
        "-s",
        "local_cwd",
        "-cfg",
        f"log_dir={tmp_path / 'logs'}",
        "dist.ddp",
        "-j",
        "1x2",
        "--gpu",
        "0",
        "--",
        "--preset",
        "tiny",
        "--max-steps",
        "3",
        "--out",
        str(out),
        "--set",
        "train.eval_every=2",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SUCCEEDED" in proc.stderr
    step3 = out / "checkpoints" / "step_000003"
    assert (step3 / "model-rank00000.safetensors").exists() and (
        step3 / "model-rank00001.safetensors"
    ).exists()
    # both ranks ran: each saved its shards and its RNG state
    assert {p.name for p in (out / "checkpoints" / "step_000003").glob("rng_rank*.json")} == {
        "rng_rank0.json",
        "rng_rank1.json",
    }
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(s.get("step", 0) for s in steps) == 3


@pytest.mark.slow
def test_local_cwd_train_component(tmp_path):
    """The `train` component on CPU: 2 processes, no volumes, the in-process budget guard on."""
    out = tmp_path / "run"
    proc = torchx(
        "run",
        "-s",
        "local_cwd",
        "-cfg",
        f"log_dir={tmp_path / 'logs'}",
        "app/components.py:train",
        "--gpus",
        "0",
        "--nproc",
        "2",
        "--data_pvc",
        "",
        "--ckpt_pvc",
        "",
        "--data",
        "",
        "--metrics_port",
        "0",
        "--out",
        str(out),
        "--budget_cap_usd",
        "5",
        "--price_per_gpu_hour",
        "1",
        "--",
        "--preset",
        "tiny",
        "--max-steps",
        "2",
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "checkpoints" / "step_000002" / "meta.json").exists()
    assert (out / "budget" / "ledger.json").exists(), "the in-process guard keeps the ledger"
