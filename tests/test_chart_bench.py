"""bench.enabled: the chart renders a short benchmark PyTorchJob (`python -m app.launch <torchrun args>
-m app.tools.bench ...`) instead of the training job, the prepare Job, the watcher and the volumes.
Rendered by the real helm binary, validated against the PyTorchJob v1.9 CRD and kubernetes-validate
(strict); the rendered launcher command is run for real with a stand-in for the bench module."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import chart_pods as pods
import k8s_helpers as h
import pytest

ON = {"bench.enabled": True}


def bench_job(docs: list) -> dict:
    (job,) = h.by_kind(docs, "PyTorchJob")
    assert job["metadata"]["name"].endswith("-bench"), job["metadata"]["name"]
    return job


def pytorch(job: dict, rtype: str = "Master") -> dict:
    return h.container(h.pod_spec(job, rtype), "pytorch")


def bench_args(c: dict) -> list[str]:
    """The arguments after `-m app.tools.bench`."""
    args = c["args"]
    i = args.index("-m")
    assert args[i + 1] == "app.tools.bench", args
    return args[i + 2 :]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def sets(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def test_the_bench_job_replaces_training():
    """Only the benchmark renders: no training job, prepare Job, watcher, volumes, Role or helm test pod;
    a failing benchmark is not retried, and the operator ends a hang after bench.activeDeadlineSeconds."""
    docs = h.render({**ON, "gpus": 16})
    h.validate_all(docs)
    assert {d["kind"] for d in docs} == {"ServiceAccount", "ConfigMap", "PyTorchJob", "NetworkPolicy"}
    job = bench_job(docs)
    assert job["metadata"]["name"] == "pretrain-bench"
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "bench"
    assert job["spec"]["runPolicy"] == {
        "backoffLimit": 0,
        "cleanPodPolicy": "None",
        "activeDeadlineSeconds": 1800,
    }
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Worker"]["replicas"] == 1
    for rtype, spec in specs.items():
        assert spec["restartPolicy"] == "Never", rtype
        pod = spec["template"]["spec"]
        assert "initContainers" not in pod, "no watcher, no wait for data, no volume step"
        assert [c["name"] for c in pod["containers"]] == ["pytorch"]
        assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v or "projected" in v]
        assert spec["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "bench"
        env = h.env_map(pytorch(job, rtype))
        assert not {k for k in env if k.startswith("PRETRAIN_")}, "no retry budget, no verdicts"
    # monitors, PDB and metrics Services of a training run select nothing here: not rendered
    extras = {
        "metrics.podMonitor.enabled": True,
        "trainer.podDisruptionBudget.enabled": True,
        "metrics.service.enabled": True,
        "storage.data.accessModes": ["ReadWriteOnce"],  # several nodes on RWO is fine: no volumes
    }
    assert {d["kind"] for d in h.render({**ON, **extras, "gpus": 16})} == {
        "ServiceAccount",
        "ConfigMap",
        "PyTorchJob",
        "NetworkPolicy",
    }
    deadline = bench_job(h.render({**ON, "bench.activeDeadlineSeconds": 600}))
    assert deadline["spec"]["runPolicy"]["activeDeadlineSeconds"] == 600


def test_the_bench_command_measures_the_training_run():
    """The trainer's launcher running app.tools.bench with the run's config (the ConfigMap, extraTrainArgs'
    --set pairs), bench.preset / bench.set on top, --out on an emptyDir; the JSON also goes to the log."""
    docs = h.render({**ON, "gpus": 16})
    c = pytorch(bench_job(docs))
    assert c["command"] == ["python", "-m", "app.launch"]
    assert c["args"][:5] == ["--nnodes=2", "--nproc-per-node=8", "--max-restarts=0", "-m", "app.tools.bench"]
    args = bench_args(c)
    assert flag(args, "--config") == "/etc/pretrain/config.yaml"
    assert "--preset" not in args, "the config file's preset (config.preset) applies"
    assert (flag(args, "--steps"), flag(args, "--warmup")) == ("30", "5")
    out = flag(args, "--out")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in h.pod_spec(bench_job(docs), "Master")["volumes"]}
    assert Path(out).parent.as_posix() in mounts and "emptyDir" in volumes[mounts[str(Path(out).parent)]]
    assert (
        volumes[mounts["/etc/pretrain"]]["configMap"]["name"] == h.one(docs, "ConfigMap")["metadata"]["name"]
    )
    assert flag(args, "--gpu-type") == "a100-80gb" and sets(args) == []  # the peak for MFU
    assert not {"--out", "--stop-file", "--budget-cap-usd", "--metrics-port"} & set(
        args[: args.index("--steps")]
    )
    tuned = bench_args(
        pytorch(
            bench_job(
                h.render(
                    {
                        **ON,
                        "extraTrainArgs": ["--set", "train.parallel=fsdp", "--max-steps", "100"],
                        "bench.preset": "gpt2-124m",
                        "bench.set": ["train.micro_batch_size=4", "train.parallel=ddp"],
                        "bench.steps": 50,
                        "bench.warmup": 0,
                    }
                )
            )
        )
    )
    assert flag(tuned, "--preset") == "gpt2-124m"
    assert sets(tuned) == [
        "train.parallel=fsdp",
        "train.micro_batch_size=4",
        "train.parallel=ddp",  # bench.set comes last: it wins
    ]
    assert (flag(tuned, "--steps"), flag(tuned, "--warmup")) == ("50", "0")
    assert "--max-steps" not in tuned, "only extraTrainArgs' --set pairs apply to the benchmark"
    preset = bench_args(pytorch(bench_job(h.render({**ON, "extraTrainArgs": ["--preset", "tiny"]}))))
    assert flag(preset, "--preset") == "tiny"


@pytest.mark.parametrize("gpus", [1, 8, 16])
def test_the_bench_pods_are_the_trainer_pods(gpus):
    """GPUs, resources, node selection, tolerations, /dev/shm and NCCL settings equal the trainer's."""
    values = {
        "gpus": gpus,
        "trainer.nodeSelector": {"pool": "h100"},
        "trainer.affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"x": "y"}}}
                ]
            }
        },
        "trainer.network.fabric": "efa",
        "trainer.network.fabricResources": {"vpc.amazonaws.com/efa": 32},
        "trainer.network.socketIfname": "eth0",
        "trainer.env": [{"name": "NCCL_NVLS_ENABLE", "value": "0"}],
        "trainer.shmSizeLimit": "128Gi",
        "trainer.qos": "Guaranteed",
        "job.priorityClassName": "training-high",
        "image.repository": "registry.example.com/pretrain",
    }
    train = h.one(h.render(values), "PyTorchJob")
    docs = h.render({**values, **ON})
    h.validate_all(docs)
    bench = bench_job(docs)
    assert bench["spec"]["nprocPerNode"] == train["spec"]["nprocPerNode"]
    assert set(bench["spec"]["pytorchReplicaSpecs"]) == set(train["spec"]["pytorchReplicaSpecs"])
    assert bench["spec"]["runPolicy"]["schedulingPolicy"] == train["spec"]["runPolicy"]["schedulingPolicy"]
    for rtype, spec in train["spec"]["pytorchReplicaSpecs"].items():
        assert bench["spec"]["pytorchReplicaSpecs"][rtype]["replicas"] == spec["replicas"]
        t_pod, b_pod = h.pod_spec(train, rtype), h.pod_spec(bench, rtype)
        for key in (
            "nodeSelector",
            "tolerations",
            "affinity",
            "securityContext",
            "priorityClassName",
            "terminationGracePeriodSeconds",
            "serviceAccountName",
        ):
            assert b_pod.get(key) == t_pod.get(key), key
        t, b = pytorch(train, rtype), pytorch(bench, rtype)
        assert b["resources"] == t["resources"] and b["resources"]["limits"]["nvidia.com/gpu"] == min(gpus, 8)
        assert b["image"] == t["image"] and b["securityContext"] == t["securityContext"]
        assert b["args"][:4] == t["args"][:4]  # --nnodes, --nproc-per-node, --max-restarts, -m
        t_env = {k: v for k, v in h.env_map(t).items() if not k.startswith("PRETRAIN_")}
        assert h.env_map(b) == t_env
        assert {"NCCL_SOCKET_IFNAME", "FI_PROVIDER", "NCCL_NVLS_ENABLE"} <= set(t_env)
        shm = {v["name"]: v for v in b_pod["volumes"]}["dshm"]
        assert shm == {v["name"]: v for v in t_pod["volumes"]}["dshm"]
        assert shm["emptyDir"]["sizeLimit"] == "128Gi"
        assert h.qos_class(b_pod) == "Guaranteed"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"bench.set": ["train.parallel"]}, r"/bench/set/0"),
        ({"bench.steps": 0}, r"/bench/steps"),
        ({"bench.warmup": -1}, r"/bench/warmup"),
        ({"bench.activeDeadlineSeconds": 0}, r"/bench/activeDeadlineSeconds"),
        ({"bench.nope": 1}, r"nope"),
        ({"serve.enabled": True}, r"bench\.enabled and serve\.enabled"),
        ({"gpus": 24, "gpusPerNode": 8}, r"the x1-50m preset's global batch .* the benchmark would exit 2"),
        ({"gpus": 4, "bench.set": ["train.batch_tokens=3000"]}, r"train\.batch_tokens=3000"),
    ],
    ids=["set-without-value", "steps", "warmup", "deadline", "unknown", "serve", "batch", "batch-override"],
)
def test_bad_bench_values_are_refused(values, message):
    err = h.render_error({**ON, **values})
    assert re.search(message, err, re.S), err


def test_the_notes_say_how_to_read_the_result(tmp_path):
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    cmd = [
        h.helm_binary(),
        "install",
        "bench",
        str(h.CHART),
        "--dry-run=client",
        "--set",
        "gpus=8",
        "--set",
        "bench.enabled=true",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "PyTorchJob bench-pretrain-bench: 1 node(s) x 8 GPU(s)" in notes and "preset x1-50m" in notes
    assert "kubectl -n default logs bench-pretrain-bench-master-0 -c pytorch" in notes
    assert "helm -n default uninstall bench" in notes and "1800 s (bench.activeDeadlineSeconds)" in notes
    assert "budget-watcher" not in notes and "logs -f job/" not in notes
    assert "storageClass is empty" not in notes, "no volumes to warn about"


def test_bench_over_a_running_training_job_is_refused(tmp_path):
    """`helm upgrade <training release> --set bench.enabled=true` would delete the running PyTorchJob."""
    cluster = h.FakeCluster(tmp_path)
    try:
        path = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/pretrain"
        cluster.objects[path] = {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {
                "name": "pretrain",
                "namespace": "default",
                "annotations": {"pretrain/topology": "1x8"},
            },
            "status": {"conditions": [{"type": "Running", "status": "True"}]},
        }
        proc = cluster.render(ON)
        assert proc.returncode == 1 and "whose training PyTorchJob pretrain still runs" in proc.stderr
        assert "helm install bench ./helm --set gpus=8 --set bench.enabled=true" in proc.stderr
        cluster.objects[path]["status"]["conditions"].append({"type": "Succeeded", "status": "True"})
        assert cluster.render(ON).returncode == 0, "a finished job: nothing is lost"
    finally:
        cluster.close()


STANDIN = """
import json, os, sys
argv = sys.argv[1:]
out = argv[argv.index("--out") + 1]
result = {"tokens_per_second": 1234.5, "mfu": 0.41, "rank": int(os.environ["RANK"])}
with open(out, "w") as f:
    json.dump(result, f)
print(json.dumps(result), flush=True)
with open(os.environ["ARGV_FILE"], "w") as f:
    json.dump(argv, f)
sys.exit(int(os.environ["CODE"]))
"""


@pytest.mark.slow  # ~5 s: torchrun and a worker process, twice
def test_the_launcher_runs_the_bench_module(tmp_path):
    """The rendered command for real on one process: `python -m app.launch ... -m <module> <args>` runs a
    module other than app.train with the chart's arguments intact, and ends with the module's exit code
    (a failing benchmark is not turned into a retryable one). The bench module is a stand-in here."""
    c = pytorch(bench_job(h.render(ON)))
    args = [h.local_path(a, tmp_path) for a in c["args"]]
    i = args.index("-m")
    args[:i] = ["--nnodes=1", "--nproc-per-node=1", "--max-restarts=0"]
    args[i + 1] = "benchstandin"
    (tmp_path / "benchstandin.py").write_text(STANDIN)
    (tmp_path / "run").mkdir()
    for code in (0, 3):
        env = pods.clean_env(CODE=str(code), ARGV_FILE=str(tmp_path / "argv.json"), OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{h.REPO}"
        proc = subprocess.run(
            [sys.executable, "-m", "app.launch", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == code, proc.stdout + proc.stderr
        assert json.loads((tmp_path / "argv.json").read_text()) == args[i + 2 :]
        result = json.loads((tmp_path / "run" / "bench.json").read_text())
        assert json.dumps(result) in proc.stdout, "the JSON is in the pod's log"


@pytest.mark.skipif(
    importlib.util.find_spec("app.tools.bench") is None, reason="app.tools.bench not built yet"
)
def test_the_bench_accepts_the_chart_arguments():
    """The real `pretrain bench` parser takes what the chart renders (bench.preset and bench.set too)."""
    from app.tools import bench

    values = {**ON, "bench.preset": "tiny", "bench.set": ["train.micro_batch_size=4"], "bench.steps": 7}
    args = bench_args(pytorch(bench_job(h.render(values))))
    parser = argparse.ArgumentParser(exit_on_error=False)
    bench.add_arguments(parser)
    parsed = parser.parse_args(args)
    assert parsed.steps == 7 and parsed.warmup == 5 and parsed.preset == "tiny"
    assert parsed.out == "/run/pretrain/bench.json" and parsed.config == "/etc/pretrain/config.yaml"
