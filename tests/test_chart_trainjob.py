"""The chart's Kubeflow Trainer v2 path (TrainJob + our TrainingRuntime, run by JobSet), rendered by a real
helm binary and validated against the v2.3.0 CRD schemas in tests/fixtures/k8s-schemas/; and the label
and runName bounds of values.schema.json (both operators)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import k8s_helpers as h
import pytest
import yaml

from tests.procs import Proc

GPU = "nvidia.com/gpu"
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TJ = {"scheduler": "trainjob"}


def node_job(docs: list) -> dict:
    (rjob,) = h.one(docs, "TrainingRuntime")["spec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node"
    return rjob


def node_pod(docs: list) -> dict:
    return node_job(docs)["template"]["spec"]["template"]


@pytest.mark.parametrize(
    ("gpus", "nodes", "nproc", "extra"),
    [
        (1, 1, 1, {}),
        (8, 1, 8, {}),
        (16, 2, 8, {}),
        (64, 8, 8, {"config.preset": "looped-546m"}),  # x1-50m's batch does not split over 64
    ],
)
def test_trainjob_and_runtime_match_the_v2_3_crds(gpus, nodes, nproc, extra):
    docs = h.render({**TJ, "gpus": gpus, **extra})
    h.validate_all(docs)  # TrainJob and TrainingRuntime against the v2.3.0 CRDs, pod templates as Pods
    assert not h.by_kind(docs, "PyTorchJob")

    job = h.one(docs, "TrainJob")
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": "pretrain",
    }
    # spec.trainer present: the torch plugin injects PET_* only then
    assert job["spec"]["trainer"] == {"numNodes": nodes, "numProcPerNode": nproc}
    assert job["metadata"]["annotations"]["pretrain/topology"] == f"{nodes}x{nproc}"

    runtime = h.one(docs, "TrainingRuntime")
    assert runtime["metadata"]["name"] == "pretrain"
    assert runtime["spec"]["mlPolicy"] == {"numNodes": nodes, "torch": {}}
    # created before the TrainJob: the Trainer's webhook refuses a TrainJob whose runtime is missing
    assert runtime["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    rjob = node_job(docs)
    assert rjob["replicas"] == 1  # the Trainer's runtime webhook: always 1
    assert rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert rjob["template"]["spec"]["completionMode"] == "Indexed"

    pod = node_pod(docs)["spec"]
    assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy
    trainer = h.container(pod, "node")  # the container the torch plugin injects PET_* into
    assert [c["name"] for c in pod["containers"]] == ["node"]
    assert trainer["command"] == ["python", "-m", "app.launch"]
    assert f"--nnodes={nodes}" in trainer["args"] and f"--nproc-per-node={nproc}" in trainer["args"]
    assert trainer["resources"]["limits"][GPU] == nproc == trainer["resources"]["requests"][GPU]
    # the torch plugin adds the rendezvous port 29400 itself; the v1 operator's 23456 is not ours to set
    assert [p["containerPort"] for p in trainer["ports"]] == [9400]
    env = h.env_map(trainer)
    assert env["PRETRAIN_RUN_DIR"] == "/ckpt/pretrain" and env["PRETRAIN_MAX_RESTARTS"] == "5"
    assert not any(k.startswith("PET_") for k in env), "PET_* are the torch plugin's"
    init = [c["name"] for c in pod["initContainers"]]
    assert init == ["volume-permissions", "budget-watcher", "wait-for-data"]
    mounts = {m["mountPath"] for m in trainer["volumeMounts"]}
    assert mounts >= {"/etc/pretrain", "/data", "/ckpt", "/run/pretrain", "/dev/shm"}
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert h.psa_violations(pod, "baseline") == []
    meta = node_pod(docs)["metadata"]
    assert meta["annotations"]["kubectl.kubernetes.io/default-container"] == "node"
    assert meta["labels"]["app.kubernetes.io/component"] == "trainer"


def test_auto_picks_the_operator_the_cluster_serves():
    plain = h.render()
    assert h.one(plain, "PyTorchJob") and not h.by_kind(plain, "TrainJob")
    v2 = h.render(api_versions=(TRAINER_API,))
    h.validate_all(v2)
    assert h.one(v2, "TrainJob") and h.one(v2, "TrainingRuntime") and not h.by_kind(v2, "PyTorchJob")
    # both served: auto still prefers Trainer v2; naming one wins over what the cluster serves
    both = h.render(api_versions=(TRAINER_API, "kubeflow.org/v1"))
    assert h.by_kind(both, "TrainJob") and not h.by_kind(both, "PyTorchJob")
    forced = h.render({"scheduler": "pytorchjob"}, api_versions=(TRAINER_API,))
    assert h.one(forced, "PyTorchJob") and not h.by_kind(forced, "TrainJob")
    # the PyTorchJob path is the same objects whatever the cluster serves besides
    assert forced == plain
    # job.enabled=false (volumes and prepare only, e.g. for TorchX): neither job, whatever the operator
    off = h.render({"job.enabled": False}, api_versions=(TRAINER_API,))
    assert not {"TrainJob", "TrainingRuntime", "PyTorchJob"} & {d["kind"] for d in off}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gpus": 12}, r"gpus=12 is not a multiple of gpusPerNode=8"),
        ({"gpus": 24}, r"gpus=24: the x1-50m preset's global batch .* splits over 1, 2, 4, .*, 512 GPUs"),
        (
            {"gpus": 16, "storage.data.accessModes": ["ReadWriteOnce"]},
            r"cannot be mounted by more than one node",
        ),
        ({"fullnameOverride": "1st-run"}, r"must start with a letter"),
        ({"scheduler": "volcano"}, r"/scheduler"),
    ],
    ids=["indivisible", "preset-batch", "rwo-multinode", "bad-name", "bad-scheduler"],
)
def test_trainjob_refusals(values, message):
    err = h.render_error({**TJ, **values})
    assert re.search(message, err, re.S), err


def test_bad_release_name_refused():
    err = h.render_error(TJ, release="1st")
    assert re.search(r"the object name \"1st-pretrain\" must start with a letter", err), err


# ------------------------------------------------------------- failure semantics, as rendered


def _pod_rule(rules: list, exit_code: int, conditions: set[str]) -> str:
    """The action of the first podFailurePolicy rule that matches (Kubernetes' order), or Count."""
    for rule in rules:
        codes = rule.get("onExitCodes")
        if codes:
            assert codes["containerName"] == "node" and codes["operator"] == "In"
            assert codes["values"] == sorted(set(codes["values"])) and 0 not in codes["values"]
            if exit_code in codes["values"]:
                return rule["action"]
        for cond in rule.get("onPodConditions", []):
            if cond["type"] in conditions and cond.get("status", "True") == "True":
                return rule["action"]
    return "Count"


def outcome(docs: list, exit_code: int, conditions: set[str] = frozenset()) -> str:
    """What the Job and then the JobSet do with one node pod that failed so."""
    spec = node_job(docs)["template"]["spec"]
    action = _pod_rule(spec.get("podFailurePolicy", {}).get("rules", []), exit_code, conditions)
    if action == "Ignore":
        return "recreate the pod, not counted"
    if action == "FailJob":
        reason = "PodFailurePolicy"
    else:
        assert action == "Count" and spec["backoffLimit"] == 0
        reason = "BackoffLimitExceeded"  # one counted failure > backoffLimit 0
    policy = h.one(docs, "TrainingRuntime")["spec"]["template"]["spec"]["failurePolicy"]
    for rule in policy["rules"]:
        if reason in (rule.get("onJobFailureReasons") or [reason]):  # none or empty: any reason
            return {"FailJobSet": "fail the job", "RestartJobSet": "restart all nodes, counted"}[
                rule["action"]
            ]
    return "restart all nodes, counted"  # JobSet's default action


@pytest.mark.parametrize(
    ("exit_code", "conditions", "expected"),
    [
        (2, set(), "fail the job"),  # bad config or data
        (3, set(), "fail the job"),  # diverged
        (4, set(), "fail the job"),  # no training data
        (5, set(), "fail the job"),  # the launcher's retry budget spent
        (6, set(), "fail the job"),  # checkpoint volume full
        (7, set(), "fail the job"),  # MFU under train.mfu_floor
        (1, set(), "restart all nodes, counted"),  # a crash
        (137, set(), "restart all nodes, counted"),  # OOM kill
        (139, set(), "restart all nodes, counted"),  # segfault
        (130, set(), "recreate the pod, not counted"),  # SIGINT after a checkpoint
        (142, set(), "recreate the pod, not counted"),  # lease held by another trainer
        (143, set(), "recreate the pod, not counted"),  # SIGTERM after a checkpoint
        (144, set(), "recreate the pod, not counted"),  # a peer rank or node lost
        (145, set(), "recreate the pod, not counted"),  # out of memory, a smaller micro-batch recorded
        (143, {"DisruptionTarget"}, "recreate the pod, not counted"),  # preemption, drain
        (137, {"DisruptionTarget"}, "recreate the pod, not counted"),  # evicted, killed at the grace period
        (2, {"DisruptionTarget"}, "recreate the pod, not counted"),  # a disruption is never the run's fault
    ],
)
def test_failure_policy_per_exit_code(exit_code, conditions, expected):
    docs = h.render(TJ)
    assert outcome(docs, exit_code, conditions) == expected


def test_failure_policy_objects():
    docs = h.render({**TJ, "trainer.maxRestarts": 2})
    policy = h.one(docs, "TrainingRuntime")["spec"]["template"]["spec"]["failurePolicy"]
    assert policy == {
        "maxRestarts": 2,
        "restartStrategy": "Recreate",
        "rules": [
            {
                "name": "PermanentExitCode",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
            },
            {"name": "Crash", "action": "RestartJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]},
        ],
    }
    for rule in policy["rules"]:  # JobSet's rule-name rule
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
    spec = node_job(docs)["template"]["spec"]
    assert spec["backoffLimit"] == 0 and spec["podReplacementPolicy"] == "Failed"
    # the job's hard wall-clock limit is the TrainJob's own
    docs = h.render({**TJ, "trainer.maxRestarts": 2, "job.activeDeadlineSeconds": 86400})
    h.validate_all(docs)
    assert h.one(docs, "TrainJob")["spec"]["activeDeadlineSeconds"] == 86400
    # the launcher's own retry budget (progress-aware) still runs inside each pod
    env = h.env_map(h.container(node_pod(docs)["spec"], "node"))
    assert env["PRETRAIN_MAX_RESTARTS"] == "2"


# ------------------------------------------------------------- the budget watcher on node 0 only


def _watcher(docs: list) -> dict:
    return h.container(node_pod(docs)["spec"], "budget-watcher", init=True)


def test_watcher_watches_on_node_0_and_idles_elsewhere(tmp_path):
    docs = h.render(TJ)
    c = _watcher(docs)
    assert c["restartPolicy"] == "Always" and c["command"][:2] == ["sh", "-c"]
    env = h.env_map(c)
    assert env["JOB_COMPLETION_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    # Events and the last-resort suspend on the TrainJob (spec.suspend), told the kind by PRETRAIN_JOB_KIND
    assert c["args"][c["args"].index("--kube") + 1] == "auto" and env["PRETRAIN_JOB_KIND"] == "TrainJob"
    rules = {r["resources"][0]: r for r in h.one(h.not_prepare(docs), "Role")["rules"]}
    assert rules["trainjobs"]["apiGroups"] == ["trainer.kubeflow.org"]
    assert rules["trainjobs"]["verbs"] == ["get", "patch"] and rules["events"]["verbs"] == ["create", "patch"]
    assert set(rules) == {"events", "trainjobs", "jobs"}  # jobs: the wait step reads the prepare Job

    fake = tmp_path / "pretrain"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\n')
    fake.chmod(0o755)
    base = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    cmd = ["sh", "-c", c["command"][2], *c["command"][3:], *c["args"]]
    ran = subprocess.run(
        cmd, env={**base, "JOB_COMPLETION_INDEX": "0"}, capture_output=True, text=True, timeout=30
    )
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "args").read_text().split() == [str(a) for a in c["args"]]

    (tmp_path / "args").unlink()
    idle = Proc(cmd, env={**base, "JOB_COMPLETION_INDEX": "1"}, separate_stderr=True)
    idle.wait_for_line("runs in node 0's pod only")
    assert idle.poll() is None  # stays up, as a native sidecar must
    idle.send_signal(signal.SIGTERM)  # the kubelet stops it with the trainer
    assert idle.wait(timeout=10) == 0
    assert not (tmp_path / "args").exists()


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"pretrain_budget_spent_usd 0\n")

    def log_message(self, *a):
        pass


def test_watcher_startup_probe_per_node():
    probe = _watcher(h.render(TJ))["startupProbe"]
    script = probe["exec"]["command"][2]
    assert "9401" in script and probe["timeoutSeconds"] >= 2

    def run(index: str, port: int) -> int:
        env = {**os.environ, "JOB_COMPLETION_INDEX": index}
        code = script.replace("9401", str(port))
        return subprocess.run(["python", "-c", code], env=env, capture_output=True, timeout=30).returncode

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens here while the socket is bound but not listening
        assert run("1", closed) == 0  # nodes > 0: no watcher to wait for
        assert run("0", closed) != 0  # node 0: waits until the watcher serves /metrics
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert run("0", server.server_port) == 0
    finally:
        server.shutdown()
        server.server_close()


def test_node_0_services_prepare_affinity_and_notes(tmp_path):
    docs = h.render(
        {
            **TJ,
            "gpus": 4,
            "metrics.serviceMonitor.enabled": True,
            "storage.data.accessModes": ["ReadWriteOnce"],
        }
    )
    h.validate_all(docs)
    pod_labels = node_pod(docs)["metadata"]["labels"]
    budget = [s for s in h.by_kind(docs, "Service") if s["metadata"]["name"] == "pretrain-budget"][0]
    sel = budget["spec"]["selector"]
    assert sel.pop("batch.kubernetes.io/job-completion-index") == "0"  # the Job controller's pod label
    assert sel.items() <= pod_labels.items()
    # a ReadWriteOnce data volume: the prepare pod and its finalizer on one node (the TrainJob has no pod
    # until the data is ready)
    for role in ("prepare", "finalizer"):
        assert "podAffinity" in h.prepare_job(docs, role)["spec"]["template"]["spec"]["affinity"]
    assert h.one(docs, "TrainJob")["spec"]["suspend"] is True

    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run(
        [
            h.helm_binary(),
            "install",
            "pretrain",
            str(h.CHART),
            "--dry-run=client",
            "--set",
            "gpus=16",
            "--set",
            "scheduler=trainjob",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "TrainJob pretrain (Kubeflow Trainer v2, TrainingRuntime pretrain): 2 node(s) x 8 GPU(s)" in notes
    assert "kubectl api-resources | grep -E 'trainjobs|pytorchjobs'" in notes
    pod0 = "jobset.sigs.k8s.io/jobset-name=pretrain,batch.kubernetes.io/job-completion-index=0"
    assert f"{pod0}) -c node" in notes and "get trainjob pretrain -w" in notes


def test_lint_strict_trainjob():
    proc = h.helm(
        "lint", "--strict", str(h.CHART), "--set", "scheduler=trainjob", "--set", "gpus=16", check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------- label values and runName (issue 26)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"commonLabels": {"team": "ML Research"}}, "/commonLabels/team"),
        ({"commonLabels": {"team": "x" * 64}}, "/commonLabels/team"),
        ({"commonLabels": {"team": "-ml"}}, "/commonLabels/team"),
        ({"commonLabels": {"bad key": "ml"}}, "invalid propertyName 'bad key'"),
        ({"trainer.podLabels": {"owner": "a@b.c"}}, "/trainer/podLabels/owner"),
        ({"prepare.podLabels": {"owner": "a b"}}, "/prepare/podLabels/owner"),
        ({"serve.podLabels": {"owner": "a b"}}, "/serve/podLabels/owner"),
        ({"trainer.nodeSelector": {"pool": "gpu pool"}}, "/trainer/nodeSelector/pool"),
        ({"metrics.podMonitor.labels": {"release": "kube prometheus"}}, "/metrics/podMonitor/labels/release"),
        ({"job.kueueQueueName": "GPU Queue"}, "/job/kueueQueueName"),  # becomes a label value too
    ],
)
def test_label_values_refused_at_template_time(values, where):
    """What the API server would refuse in every object that carries the label fails `helm template`
    with the value's path (for a bad key helm names the key, not always its path)."""
    err = h.render_error(values)
    assert where in err, err


def test_label_values_accepted():
    good = {"team": "ml-research", "cost.center": "A1_b.2", "empty": "", "x": "a" * 63}
    docs = h.render({"commonLabels": good, "trainer.podLabels": {"example.com/owner": "ml"}})
    h.validate_all(docs)  # every object's labels pass the API server's rules (check_metadata)
    assert h.one(docs, "PyTorchJob")["metadata"]["labels"].items() >= good.items()


def test_run_name_bounded():
    err = h.render_error({"runName": "r" * 278})
    assert "/runName" in err and "100" in err, err
    docs = h.render({"runName": "r" * 100})
    trainer = h.container(h.pod_spec(h.one(docs, "PyTorchJob"), "Master"), "pytorch")
    run_dir = h.env_map(trainer)["PRETRAIN_RUN_DIR"]
    assert max(len(part.encode()) for part in run_dir.split("/")) <= 255
    schema = json.loads((h.CHART / "values.schema.json").read_text())
    assert schema["properties"]["runName"]["maxLength"] == 100


# ------------------------------------------------------------- plain manifests for kubectl


def test_k8s_trainjob_manifests():
    """k8s/trainjob/: the chart with scheduler=trainjob, valid, the runtime applied before the TrainJob."""
    out = h.REPO / "k8s" / "trainjob"
    files = sorted(p.name for p in out.glob("*.yaml"))
    docs = [yaml.safe_load((out / name).read_text()) for name in files]
    h.validate_all(docs)
    kinds = [d["kind"] for d in docs]
    assert "PyTorchJob" not in kinds
    assert kinds.index("TrainingRuntime") < kinds.index("TrainJob")  # `kubectl apply -f` goes by file name
    assert {d["kind"] for d in docs} == {d["kind"] for d in h.render(TJ)} - {"Pod"}  # no `helm test` pod
    proc = subprocess.run(
        [sys.executable, str(h.REPO / "scripts" / "render_k8s.py"), "--helm", h.helm_binary(), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{out}: {len(files)} manifests equal a fresh render" in proc.stdout


# ------------------------------------------------------------- the benchmark under Trainer v2


def test_bench_renders_a_trainjob_that_is_never_retried(tmp_path):
    docs = h.render({**TJ, "bench.enabled": True, "gpus": 16})
    h.validate_all(docs)
    assert {d["kind"] for d in docs} == {
        "ServiceAccount",
        "ConfigMap",
        "TrainJob",
        "TrainingRuntime",
        "NetworkPolicy",
    }
    job = h.one(docs, "TrainJob")
    assert job["metadata"]["name"] == "pretrain-bench" and job["spec"]["activeDeadlineSeconds"] == 1800
    assert job["spec"]["runtimeRef"]["name"] == "pretrain-bench"
    runtime = h.one(docs, "TrainingRuntime")
    assert runtime["spec"]["template"]["spec"]["failurePolicy"] == {
        "maxRestarts": 0,
        "rules": [{"name": "NoRetry", "action": "FailJobSet"}],
    }
    assert outcome(docs, 143) == "fail the job" and outcome(docs, 137, {"DisruptionTarget"}) == "fail the job"
    pod = node_pod(docs)["spec"]
    assert "initContainers" not in pod and [c["name"] for c in pod["containers"]] == ["node"]
    args = h.container(pod, "node")["args"]
    assert args[args.index("-m") + 1] == "app.tools.bench" and "--nnodes=2" in args
    assert "ports" not in h.container(pod, "node")

    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    cmd = [
        h.helm_binary(),
        "install",
        "bench",
        str(h.CHART),
        "--dry-run=client",
        "--set",
        "bench.enabled=true",
    ]
    proc = subprocess.run(
        [*cmd, "--set", "scheduler=trainjob"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "TrainJob bench-pretrain-bench: 1 node(s) x 8 GPU(s)" in notes
    assert "jobset-name=bench-pretrain-bench,batch.kubernetes.io/job-completion-index=0) -c node" in notes
    assert "delete trainingruntime bench-pretrain-bench" in notes


@pytest.mark.parametrize("values_file", sorted((h.CHART / "ci").glob("*-values.yaml")), ids=lambda p: p.stem)
def test_ci_value_sets_as_trainjob(values_file):
    """Every chart-testing value set also renders valid Trainer v2 objects (PSA `restricted` where asked)."""
    out = h.helm("template", "pretrain", str(h.CHART), "-f", str(values_file), "--set", "scheduler=trainjob")
    docs = h.objects(out.stdout)
    h.validate_all(docs)
    assert not h.by_kind(docs, "PyTorchJob") and h.by_kind(docs, "TrainJob")
    if values_file.stem == "psa-restricted-values":
        for where, spec in h.pod_specs(docs):
            assert h.psa_violations(spec, "restricted") == [], where
    if values_file.stem == "guaranteed-efa-values":
        for where, spec in h.pod_specs(docs):
            if where.startswith("TrainingRuntime"):
                assert h.qos_class(spec) == "Guaranteed", where


def test_runtime_shaped_like_the_upstream_torch_runtime():
    """Our TrainingRuntime has what the torch plugin looks for in Trainer's own default runtime
    (torch-distributed, v2.3.0): the replicated Job `node`, its ancestor label, the container `node`."""
    text = (h.SCHEMAS / "torch-distributed-runtime.v2.3.0.yaml").read_text()
    upstream = yaml.safe_load("\n".join(line for line in text.splitlines() if "{{" not in line))
    ours = h.one(h.render(TJ), "TrainingRuntime")
    assert set(upstream["spec"]["mlPolicy"]) <= set(ours["spec"]["mlPolicy"])
    (up_job,) = upstream["spec"]["template"]["spec"]["replicatedJobs"]
    (our_job,) = ours["spec"]["template"]["spec"]["replicatedJobs"]
    assert our_job["name"] == up_job["name"] == "node"
    assert (
        up_job["template"]["metadata"]["labels"].items() <= our_job["template"]["metadata"]["labels"].items()
    )
    up_names = [c["name"] for c in up_job["template"]["spec"]["template"]["spec"]["containers"]]
    our_names = [c["name"] for c in our_job["template"]["spec"]["template"]["spec"]["containers"]]
    assert our_names == up_names == ["node"]
    assert ours["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
