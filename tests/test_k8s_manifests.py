"""k8s/: plain manifests for users without Helm, rendered from the chart, and the contract between
what the chart runs in its containers and the real `pretrain` CLIs."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import k8s_helpers as h
import pytest
import yaml

K8S = h.REPO / "k8s"
RENDER = [sys.executable, str(h.REPO / "scripts" / "render_k8s.py")]


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return h.helm_binary()


def manifests() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(K8S.glob("*.yaml"))}


def test_k8s_equals_a_fresh_render(helm_bin):
    proc = subprocess.run(
        [*RENDER, "--helm", helm_bin, "--check"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{len(manifests())} manifests equal a fresh render" in proc.stdout


def test_check_detects_drift(helm_bin, tmp_path):
    out = tmp_path / "k8s"
    shutil.copytree(K8S, out)
    job = out / "70-pytorchjob-pretrain.yaml"
    job.write_text(job.read_text().replace("replicas: 1", "replicas: 2", 1))
    (out / "40-persistentvolumeclaim-pretrain-data.yaml").unlink()
    (out / "99-old.yaml").write_text("kind: ConfigMap\n")
    proc = subprocess.run(
        [*RENDER, "--helm", helm_bin, "--check", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "70-pytorchjob-pretrain.yaml" in proc.stderr and "-      replicas: 2" in proc.stderr
    assert "40-persistentvolumeclaim-pretrain-data.yaml: missing" in proc.stderr
    assert "99-old.yaml: not produced by the chart" in proc.stderr
    # writing repairs it
    subprocess.run(
        [*RENDER, "--helm", helm_bin, "--out", str(out)], check=True, capture_output=True, timeout=120
    )
    assert sorted(p.name for p in out.glob("*.yaml")) == sorted(manifests())
    assert (out / "PREREQUISITES.md").exists(), "other files in k8s/ are left alone"


def test_manifests_are_valid():
    docs = list(manifests().values())
    h.validate_all(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ServiceAccount", "Role", "RoleBinding"] * 2  # the trainer's and the prepare's
        + ["ConfigMap"]
        + ["PersistentVolumeClaim"] * 2
        + ["NetworkPolicy"] * 2
        + ["Job", "Job", "PyTorchJob"]  # the prepare and its finalizer, which releases the job
    )
    for name, doc in manifests().items():
        assert name == f"{name[:2]}-{doc['kind'].lower()}-{doc['metadata']['name']}.yaml"
        assert "namespace" not in doc["metadata"], "plain manifests go in the namespace of `kubectl -n`"


def test_manifests_reference_each_other():
    docs = list(manifests().values())
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    job = h.one(docs, "PyTorchJob")
    prepare = h.prepare_job(docs)
    pods = [h.pod_spec(job, "Master"), prepare["spec"]["template"]["spec"]]
    for pod in pods:
        for vol in pod["volumes"]:
            if "persistentVolumeClaim" in vol:
                assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in names
            if "configMap" in vol:
                assert ("ConfigMap", vol["configMap"]["name"]) in names
    assert ("ServiceAccount", h.pod_spec(job, "Master")["serviceAccountName"]) in names
    binding = h.one(h.not_prepare(docs), "RoleBinding")
    assert ("Role", binding["roleRef"]["name"]) in names
    assert ("ServiceAccount", binding["subjects"][0]["name"]) in names
    rule = [r for r in h.one(h.not_prepare(docs), "Role")["rules"] if r["resources"] == ["pytorchjobs"]][0]
    assert rule["resourceNames"] == [job["metadata"]["name"]]


def test_prerequisites_documented():
    text = (K8S / "PREREQUISITES.md").read_text()
    for needle in (
        "training-operator",
        "kubeflow.org/v1",
        "nvidia.com/gpu",
        "ReadWriteMany",
        "kube-prometheus-stack",
        "Kueue",
        "OpenCost",
        "1.29",
        "kubectl apply",
    ):
        assert needle in text, needle


# ---------------------------------------------------------------- chart arguments vs the real CLIs


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """The default render with its in-pod paths moved to a temp dir."""
    tmp = tmp_path_factory.mktemp("pod")
    docs = h.render({"gpus": 16})
    cm = h.one(docs, "ConfigMap")
    (tmp / "config.yaml").write_text(cm["data"]["config.yaml"])

    def local(arg: str) -> str:
        return (
            arg.replace("/etc/pretrain", str(tmp))
            .replace("/ckpt", str(tmp / "ckpt"))
            .replace("/run/pretrain", str(tmp))
        )

    return docs, local, tmp


def test_trainer_accepts_the_chart_args(rendered):
    docs, local, _ = rendered
    args = h.container(h.pod_spec(h.one(docs, "PyTorchJob"), "Worker"), "pytorch")["args"]
    i = args.index("-m")
    assert args[i + 1] == "app.train"
    cmd = [sys.executable, "-m", "app.train", *map(local, args[i + 2 :]), "--print-config"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=h.REPO)
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout.split("\n# ", 1)[0])
    assert cfg["preset"] == "x1-50m"
    assert cfg["budget"]["in_process"] is False and cfg["budget"]["cap_usd"] == 1000
    assert cfg["budget"]["gpus"] == 16 and cfg["budget"]["gpu_type"] == "a100-80gb"
    assert cfg["data"]["dataset"] == "/data/fineweb-edu-10bt"
    assert cfg["metrics"]["port"] == 9400
    assert cfg["checkpoint"]["every_minutes"] == 30


def test_watcher_accepts_the_chart_args(rendered):
    docs, local, tmp = rendered
    watcher = h.container(h.pod_spec(h.one(docs, "PyTorchJob"), "Master"), "budget-watcher", init=True)
    assert watcher["command"] == ["pretrain"]
    cmd = [sys.executable, "-m", "app.cli", *map(local, watcher["args"]), "--dry-run-budget"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=h.REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cap $1000" in proc.stdout and "16 GPUs" in proc.stdout
    assert str(tmp / "ckpt" / "pretrain" / "budget" / "ledger.json") in proc.stdout


def test_prepare_accepts_the_chart_args(rendered):
    from app.data import cli as prepare_cli
    from app.data import prepare_job

    docs, _, _ = rendered
    own = argparse.ArgumentParser(exit_on_error=False)
    prepare_job.add_arguments(own)
    fin = h.prepare_job(docs, "finalizer")["spec"]["template"]["spec"]["containers"][0]
    release = own.parse_args(fin["args"][: fin["args"].index("--")])
    assert (release.step, release.job) == ("finalize", "PyTorchJob/pretrain")
    assert release.prepare_job == h.prepare_job(docs)["metadata"]["name"]
    c = h.prepare_job(docs)["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == fin["command"] == ["python", "-m", "app.data.prepare_job"]
    split = c["args"].index("--")
    assert c["args"][split:] == fin["args"][fin["args"].index("--") :]
    pod = own.parse_args(c["args"][:split])
    assert (pod.step, pod.job, pod.dir) == ("run", "", "/data/fineweb-edu-10bt")
    parser = argparse.ArgumentParser(exit_on_error=False)
    prepare_cli.add_arguments(parser)
    args = parser.parse_args(c["args"][split + 1 :])
    assert args.input == ["hf://datasets/HuggingFaceFW/fineweb-edu?include=sample/10BT/*.parquet"]
    assert args.out == "/data/fineweb-edu-10bt" and args.tokenizer == "hf://openai-community/gpt2"
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args([*c["args"][split + 1 :], "--no-such-flag"])
