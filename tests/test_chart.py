"""The Helm chart, rendered by a real helm binary and validated against real schemas.

No cluster runs here: objects are checked with kubernetes-validate (core kinds, strict) and the
training-operator v1.9 PyTorchJob CRD schema; the shell scripts and the torchrun launcher that the
chart ships are executed locally.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import chart_pods as pods
import k8s_helpers as h
import pytest
import yaml

GPU = "nvidia.com/gpu"
STOP_FILE = "/run/pretrain/stop.json"

VARIANTS = {
    "defaults": {},
    "monitors": {
        "metrics.podMonitor.enabled": True,
        "metrics.podMonitor.labels": {"release": "kube-prometheus-stack"},
        "metrics.prometheusRule.enabled": True,
        "metrics.grafanaDashboards.enabled": True,
    },
    "service-monitor": {
        "metrics.serviceMonitor.enabled": True,
        "metrics.serviceMonitor.labels": {"release": "kube-prometheus-stack"},
    },
    "existing-claims": {
        "storage.data.existingClaim": "team-data",
        "storage.checkpoints.existingClaim": "team-ckpt",
    },
    "kueue": {
        "job.kueueQueueName": "gpu-queue",
        "prepare.kueueQueueName": "cpu-queue",
        "job.priorityClassName": "training-high",
    },
    "secret": {"hfToken.existingSecret": "hf-token", "hfToken.key": "hf"},
}


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return h.helm_binary()


def topology(gpus: int, per_node: int = 8) -> tuple[int, int]:
    return (1, gpus) if gpus < per_node else (gpus // per_node, per_node)


def test_helm_binary_is_real(helm_bin):
    out = subprocess.run([helm_bin, "version", "--short"], capture_output=True, text=True, check=True)
    assert re.match(r"v\d+\.\d+\.\d+", out.stdout.strip())


@pytest.mark.parametrize(
    "values",
    [[], ["--set", "gpus=32"], ["--set", "metrics.podMonitor.enabled=true", "--set", "budget.capUSD=0"]],
    ids=["defaults", "gpus32", "monitor-nocap"],
)
def test_helm_lint_strict(helm_bin, values):
    proc = h.helm("lint", "--strict", str(h.CHART), *values, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("gpus", [1, 8, 16, 32])
def test_render_matrix(helm_bin, gpus, variant):
    values = {"gpus": gpus, **VARIANTS[variant]}
    docs = h.render(values)
    h.validate_all(docs)
    nodes, nproc = topology(gpus)

    job = h.one(docs, "PyTorchJob")
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    if nodes == 1:
        assert "Worker" not in specs
    else:
        assert specs["Worker"]["replicas"] == nodes - 1
    assert job["spec"]["nprocPerNode"] == str(nproc)
    run_policy = job["spec"]["runPolicy"]
    assert run_policy["backoffLimit"] >= 1 and run_policy["cleanPodPolicy"] == "Running"
    assert run_policy["ttlSecondsAfterFinished"] == 604800
    assert run_policy["suspend"] is True  # no trainer pod (no GPU) until the prepare releases it

    checksums = set()
    for rtype, spec in specs.items():
        assert spec["restartPolicy"] == "ExitCode"
        pod = spec["template"]["spec"]
        checksums.add(spec["template"]["metadata"]["annotations"]["checksum/config"])
        trainer = h.container(pod, "pytorch")
        assert trainer["resources"]["limits"][GPU] == nproc
        assert trainer["resources"]["requests"][GPU] == nproc
        args = trainer["args"]
        assert trainer["command"] == ["python", "-m", "app.launch"]
        assert f"--nnodes={nodes}" in args and f"--nproc-per-node={nproc}" in args
        i = args.index("-m")
        assert args[i + 1] == "app.train"
        flags = dict(zip(args[i + 2 :: 1], args[i + 3 :: 1], strict=False))
        assert flags["--config"] == "/etc/pretrain/config.yaml"
        assert flags["--out"] == "/ckpt/pretrain"
        assert flags["--stop-file"] == STOP_FILE
        assert flags["--metrics-port"] == "9400"
        assert flags["--budget-cap-usd"] == "1000"
        assert args[args.index("budget.in_process=false") - 1 :][:2] == ["--set", "budget.in_process=false"]
        assert "data.dataset=/data/fineweb-edu-10bt" in args
        mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
        assert set(mounts) >= {"/etc/pretrain", "/data", "/ckpt", "/run/pretrain", "/dev/shm"}
        assert mounts["/data"]["readOnly"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert volumes[mounts["/run/pretrain"]["name"]]["emptyDir"] is not None
        claims = {
            volumes[mounts[p]["name"]]["persistentVolumeClaim"]["claimName"] for p in ("/data", "/ckpt")
        }
        if variant == "existing-claims":
            assert claims == {"team-data", "team-ckpt"}
        else:
            assert claims == {"pretrain-data", "pretrain-ckpt"}
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["terminationGracePeriodSeconds"] >= 60
        env = h.env_map(trainer)
        if variant == "secret":
            assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "hf"}}
        else:
            assert "HF_TOKEN" not in env
        init = {c["name"]: c for c in pod.get("initContainers", [])}
        assert "wait-for-data" in init
        # volumes handed to uid 1000 first (RWX default), then the guard, then the data wait
        order = ["volume-permissions", "budget-watcher", "wait-for-data"]
        assert list(init) == [n for n in order if n in init] and list(init)[0] == "volume-permissions"
        if rtype == "Master":
            watcher = init["budget-watcher"]
            assert watcher["restartPolicy"] == "Always"  # native sidecar: the pod ends with the trainer
            wargs = watcher["args"]
            assert wargs[0] == "watch" and watcher["command"] == ["pretrain"]
            assert wargs[wargs.index("--stop-file") + 1] == STOP_FILE
            assert wargs[wargs.index("--gpus") + 1] == str(gpus)
            assert wargs[wargs.index("--metrics-port") + 1] == "9401"
            assert wargs[wargs.index("--run-dir") + 1] == "/ckpt/pretrain"
            wmounts = {m["mountPath"]: m["name"] for m in watcher["volumeMounts"]}
            assert wmounts["/run/pretrain"] == mounts["/run/pretrain"]["name"]  # shared stop-file emptyDir
            # the API token goes to the watcher only (Events, suspend), not to the trainer
            token = wmounts["/var/run/secrets/kubernetes.io/serviceaccount"]
            assert "serviceAccountToken" in json.dumps(volumes[token]["projected"])
        else:
            assert "budget-watcher" not in init, "the budget watcher runs in the Master pod only"
        assert pod["automountServiceAccountToken"] is False
        assert not any(m["mountPath"].startswith("/var/run/secrets") for m in trainer["volumeMounts"])
        all_containers = pod["containers"] + pod.get("initContainers", [])
        assert not [c for c in all_containers if c["name"] == "budget-watcher" and rtype != "Master"]
        assert sum(c["name"] == "budget-watcher" for c in all_containers) == (rtype == "Master")
        if variant == "kueue":
            assert pod["priorityClassName"] == "training-high"
    assert len(checksums) == 1

    labels = job["metadata"]["labels"]
    if variant == "kueue":
        # out of the queue until its data is ready: the prepare then adds the label, and Kueue admits it
        assert "kueue.x-k8s.io/queue-name" not in labels
        release_args = h.prepare_job(docs, "finalizer")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert release_args[release_args.index("--queue") + 1] == "gpu-queue"
        for role in ("prepare", "finalizer"):
            assert h.prepare_job(docs, role)["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "cpu-queue"
        assert run_policy["schedulingPolicy"] == {"minAvailable": nodes, "priorityClass": "training-high"}
    else:
        assert "kueue.x-k8s.io/queue-name" not in labels
    pvcs = h.by_kind(docs, "PersistentVolumeClaim")
    assert len(pvcs) == (0 if variant == "existing-claims" else 2)
    if variant in ("monitors", "service-monitor"):
        kind = "PodMonitor" if variant == "monitors" else "ServiceMonitor"
        mon = h.one(docs, kind)
        assert not h.by_kind(docs, "ServiceMonitor" if kind == "PodMonitor" else "PodMonitor")
        assert mon["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        # one job label for the trainer and the watcher series: the alert rules join on (namespace, job)
        assert mon["spec"]["jobLabel"] == "app.kubernetes.io/instance"
    if variant == "monitors":
        pm = h.one(docs, "PodMonitor")
        assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics", "budget-metrics"]
        assert not h.by_kind(docs, "Service")
    elif variant == "service-monitor":
        sm = h.one(docs, "ServiceMonitor")
        services = {s["metadata"]["name"]: s for s in h.by_kind(docs, "Service")}
        assert services["pretrain-metrics"]["spec"]["ports"][0]["port"] == 9400
        assert services["pretrain-budget"]["spec"]["ports"][0]["port"] == 9401
        assert services["pretrain-budget"]["spec"]["selector"]["pretrain/replica-type"] == "master"
        for svc in services.values():
            assert svc["metadata"]["labels"].items() >= sm["spec"]["selector"]["matchLabels"].items()
    else:
        assert not h.by_kind(docs, "PodMonitor") and not h.by_kind(docs, "ServiceMonitor")
        assert not h.by_kind(docs, "Service")


def test_hf_token_never_plain(helm_bin):
    docs = h.render({"hfToken.existingSecret": "hf-token"})
    text = yaml.safe_dump_all(docs)
    assert "secretKeyRef" in text
    prepare = h.prepare_job(docs)["spec"]["template"]["spec"]["containers"][0]
    assert h.env_map(prepare)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    schema = json.loads((h.CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["hfToken"]["properties"]) == {"existingSecret", "key"}
    assert "not allowed" in h.render_error({"hfToken.token": "hf_abc"})


@pytest.mark.parametrize(
    ("values", "nodes", "nproc"),
    [
        ({"gpus": 4}, 1, 4),
        ({"gpus": 12, "gpusPerNode": 4, "config": {"preset": "tiny"}}, 3, 4),  # tiny: no global batch
        ({"gpus": 2, "gpusPerNode": 1}, 2, 1),
    ],
)
def test_topology(helm_bin, values, nodes, nproc):
    docs = h.render(values)
    h.validate_all(docs)
    job = h.one(docs, "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs.get("Worker", {"replicas": 0})["replicas"] == nodes - 1
    for spec in specs.values():
        c = h.container(spec["template"]["spec"], "pytorch")
        assert c["resources"]["limits"][GPU] == nproc
        assert f"--nnodes={nodes}" in c["args"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gpus": 0}, r"/gpus.*minimum"),
        ({"gpus": 12}, r"gpus=12 is not a multiple of gpusPerNode=8.*gpus=8 or gpus=16"),
        ({"gpus": 24}, r"gpus=24: the x1-50m preset's global batch .* splits over 1, 2, 4, .*, 512 GPUs"),
        ({"gpus": 20, "gpusPerNode": 8}, r"gpus=20 is not a multiple of gpusPerNode=8"),
        ({"budget.capUSD": -1}, r"/budget/capUSD.*minimum"),
        ({"gpusPerNode": 0}, r"/gpusPerNode.*minimum"),
        ({"budget.pricePerGpuHour": -2.5}, r"/budget/pricePerGpuHour.*minimum"),
        ({"job.restartPolicy": "Sometimes"}, r"/job/restartPolicy"),
        ({"storage.data.accessModes": ["ReadWriteSometimes"]}, r"/storage/data/accessModes"),
        ({"gpu": 8}, r"additional properties 'gpu' not allowed"),
        ({"budget.cap": 10}, r"additional properties 'cap' not allowed"),
        ({"prepare.valFraction": 1.5}, r"prepare.valFraction=1.5 must be between 0 and 1"),
        ({"prepare.valFraction": "1.5"}, r"prepare.valFraction=1.5 must be between 0 and 1"),
        ({"budget.capUSD": "lots"}, r"/budget/capUSD"),
        ({"budget.pricePerGpuHour": "-2.49"}, r"/budget/pricePerGpuHour"),
        (
            {"metrics.podMonitor.enabled": True, "metrics.serviceMonitor.enabled": True},
            r"both true: Prometheus would scrape every pod twice",
        ),
        (
            {"gpus": 16, "storage.data.accessModes": ["ReadWriteOnce"]},
            r"cannot be mounted by more than one node",
        ),
        (
            {"storage.data.accessModes": ["ReadWriteOnce"], "prepare.parallelism": 4},
            r"prepare.parallelism=4 runs that many prepare pods, on different nodes, but storage.data",
        ),
        ({"prepare.parallelism": 0}, r"/prepare/parallelism"),
        (
            {"serviceAccount.create": False},
            r"Roles would be bound to the namespace's `default` ServiceAccount",
        ),
        ({"fullnameOverride": "1st-run"}, r"must start with a letter .*DNS-1035"),
        ({"trainer.qos": "BestEffort"}, r"/trainer/qos"),
        ({"volumePermissions.enabled": "sometimes"}, r"/volumePermissions/enabled"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else "msg",
)
def test_bad_values_refused(helm_bin, values, message):
    err = h.render_error(values)
    assert re.search(message, err, re.S), err


def test_watcher_off_without_cap(helm_bin):
    docs = h.render({"budget.capUSD": 0, "metrics.serviceMonitor.enabled": True})
    h.validate_all(docs)
    job = h.one(docs, "PyTorchJob")
    pod = h.pod_spec(job, "Master")
    assert [c["name"] for c in pod["initContainers"]] == ["volume-permissions", "wait-for-data"]
    assert pod["automountServiceAccountToken"] is False
    # the wait step alone still reads the prepare Job and posts Events: no patch of the PyTorchJob
    rules = {r["resources"][0]: r["verbs"] for r in h.one(h.not_prepare(docs), "Role")["rules"]}
    assert rules == {"events": ["create", "patch"], "pytorchjobs": ["get"], "jobs": ["get"]}
    assert [s["metadata"]["name"] for s in h.by_kind(docs, "Service")] == ["pretrain-metrics"]
    off = h.render({"budget.capUSD": 0, "prepare.wait.useKubernetesApi": False})
    assert not h.by_kind(h.not_prepare(off), "Role") and not h.by_kind(h.not_prepare(off), "RoleBinding")
    assert "kube-api-access" not in json.dumps(h.one(off, "PyTorchJob"))


def test_rbac_least_privilege(helm_bin):
    docs = h.render({"gpus": 16})
    role = h.one(h.not_prepare(docs), "Role")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): r for r in role["rules"]}
    assert rules[("",), ("events",)]["verbs"] == ["create", "patch"]
    job_rule = rules[("kubeflow.org",), ("pytorchjobs",)]
    assert job_rule["verbs"] == ["get", "patch"]
    assert job_rule["resourceNames"] == ["pretrain"]
    prepare = h.prepare_job(docs)["metadata"]["name"]
    assert rules[("batch",), ("jobs",)] == {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "resourceNames": [prepare],
        "verbs": ["get"],
    }
    assert ("kueue.x-k8s.io",) not in {k[0] for k in rules}
    for r in role["rules"]:
        assert "*" not in r["verbs"] + r["resources"] + r["apiGroups"]
        assert set(r["verbs"]) <= {"get", "create", "patch"}
    # under Kueue the watcher's last resort deactivates the Workload, whose name only Kueue knows
    kueue = {
        tuple(r["apiGroups"]): r
        for r in h.one(h.not_prepare(h.render({"job.kueueQueueName": "q"})), "Role")["rules"]
    }
    assert kueue[("kueue.x-k8s.io",)] == {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["workloads"],
        "verbs": ["list", "patch"],
    }
    binding = h.one(h.not_prepare(docs), "RoleBinding")
    sa = h.one(h.not_prepare(docs), "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "default"}
    ]
    assert h.pod_spec(h.one(docs, "PyTorchJob"), "Master")["serviceAccountName"] == sa["metadata"]["name"]
    assert sa["automountServiceAccountToken"] is False  # the watcher gets a projected token itself


def test_config_map_and_checksum(helm_bin):
    base = h.render()
    cm = h.one(base, "ConfigMap")
    assert (
        yaml.safe_load(cm["data"]["config.yaml"])
        == yaml.safe_load((h.CHART / "values.yaml").read_text())["config"]
    )
    mount = {
        m["mountPath"]: m
        for m in h.container(h.pod_spec(h.one(base, "PyTorchJob"), "Master"), "pytorch")["volumeMounts"]
    }
    volumes = {v["name"]: v for v in h.pod_spec(h.one(base, "PyTorchJob"), "Master")["volumes"]}
    assert volumes[mount["/etc/pretrain"]["name"]]["configMap"]["name"] == cm["metadata"]["name"]

    def checksum(docs):
        return h.one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"][
            "annotations"
        ]["checksum/config"]

    changed = h.render({"config": {"preset": "gpt2-124m", "train": {"max_hours": 20}}})
    assert yaml.safe_load(h.one(changed, "ConfigMap")["data"]["config.yaml"])["train"] == {"max_hours": 20}
    assert checksum(base) != checksum(changed)
    assert checksum(base) == checksum(h.render({"gpus": 8}))


def test_prepare_job_on_cpu_pool(helm_bin):
    docs = h.render(
        {
            "prepare.nodeSelector": {"pool": "cpu"},
            "prepare.input": "hf://datasets/karpathy/tinyshakespeare",
            "prepare.tokenizer": "char",
            "prepare.extraArgs": ["--workers", "4"],
        }
    )
    job = h.prepare_job(docs)
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["restartPolicy"] == "Never"
    assert GPU not in json.dumps(c["resources"])
    assert c["command"] == ["python", "-m", "app.data.prepare_job"] and c["args"][0] == "run"
    fp = c["args"][c["args"].index("--fingerprint") + 1]
    c["args"] = c["args"][c["args"].index("--") + 1 :]  # those of `pretrain prepare`
    assert c["args"][:4] == [
        "--input",
        "hf://datasets/karpathy/tinyshakespeare",
        "--out",
        "/data/fineweb-edu-10bt",
    ]
    assert c["args"][c["args"].index("--tokenizer") + 1] == "char" and "--vocab-size" not in c["args"]
    assert c["args"][-2:] == ["--workers", "4"]
    for rtype in ("Master",):
        wait = h.container(h.pod_spec(h.one(docs, "PyTorchJob"), rtype), "wait-for-data", init=True)
        assert wait["args"][wait["args"].index("--fingerprint") + 1] == fp
    other = h.prepare_job(h.render({"prepare.input": "/data/raw"}))["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert other["args"][other["args"].index("--fingerprint") + 1] != fp


def test_prepare_disabled(helm_bin):
    docs = h.render({"prepare.enabled": False, "config": {"preset": "tiny", "data": {"dataset": "embedded"}}})
    h.validate_all(docs)
    assert not h.by_kind(docs, "Job")
    pod = h.pod_spec(h.one(docs, "PyTorchJob"), "Master")
    assert [c["name"] for c in pod["initContainers"]] == ["volume-permissions", "budget-watcher"]
    trainer = h.container(pod, "pytorch")
    assert not any(a.startswith("data.dataset=") for a in trainer["args"])
    assert "PRETRAIN_DATA_VERDICT" not in h.env_map(trainer)


def test_job_disabled_keeps_volumes_and_prepare(helm_bin):
    docs = h.render({"job.enabled": False, "metrics.podMonitor.enabled": True})
    h.validate_all(docs)
    assert {d["kind"] for d in docs} == {
        "ServiceAccount",
        "ConfigMap",
        "PersistentVolumeClaim",
        "Job",
        "NetworkPolicy",
    }
    assert [d["metadata"]["name"] for d in h.by_kind(docs, "NetworkPolicy")] == ["pretrain-prepare"]


# ------------------------------------------------------------- the shell scripts, run for real


def test_prepare_and_wait_steps(helm_bin, tmp_path):
    docs = h.render({"prepare.wait.pollSeconds": 1, "prepare.wait.timeoutSeconds": 2})
    api = h.JobApi(docs, tmp_path)
    prep = h.PreparePod(docs, tmp_path, kubeconfig=api.kubeconfig)
    (tmp_path / "run").mkdir()
    marker = tmp_path / "data" / "fineweb-edu-10bt" / "_READY"

    # nothing prepared: the trainer waits, then gives up after the timeout, leaving a verdict
    t0 = time.monotonic()
    proc = pods.wait_step(docs, tmp_path)
    assert proc.returncode == 0 and time.monotonic() - t0 >= 2, proc.stderr
    verdict = json.loads((tmp_path / "run" / "data-verdict.json").read_text())
    assert verdict["code"] == 4 and "prepare.wait.timeoutSeconds=2" in verdict["reason"]
    (tmp_path / "run" / "data-verdict.json").unlink()
    proc = prep.run()
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text().strip() == prep.fingerprint
    assert api.job["spec"]["runPolicy"]["suspend"] is True  # the pod that parses the input releases nothing
    fin = h.PreparePod(docs, tmp_path, role="finalizer", kubeconfig=api.kubeconfig)
    assert fin.run().returncode == 0
    assert api.job["spec"]["runPolicy"]["suspend"] is False  # released
    assert (
        prep.calls.read_text()
        .splitlines()[-1]
        .startswith("prepare --input hf://datasets/HuggingFaceFW/fineweb-edu")
    )
    # idempotent: the same fingerprint skips the work
    n = len(prep.calls.read_text().splitlines())
    assert "nothing to do" in prep.run().stdout and len(prep.calls.read_text().splitlines()) == n
    proc = pods.wait_step(docs, tmp_path)
    assert proc.returncode == 0 and "is ready" in proc.stdout
    assert not (tmp_path / "run" / "data-verdict.json").exists()
    # a marker of other arguments is not ready; a stop file releases the wait so the trainer can exit 0
    marker.write_text("0123456789abcdef\n")
    (tmp_path / "run" / "stop.json").write_text("{}")
    proc = pods.wait_step(docs, tmp_path)
    assert proc.returncode == 0 and "stop file" in proc.stdout
    assert not (tmp_path / "run" / "data-verdict.json").exists()
    api.close()


def test_notes(helm_bin, tmp_path):
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run(
        [helm_bin, "install", "pretrain", str(h.CHART), "--dry-run=client", "--set", "gpus=16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "2 node(s) x 8 GPU(s) = 16 GPU(s)" in notes
    for needle in (
        "logs -f pretrain-master-0 -c pytorch",
        "logs -f pretrain-master-0 -c budget-watcher",
        "logs -f job/pretrain-prepare",
        "port-forward pod/pretrain-master-0 9400:9400 9401:9401",
        "grafanaDashboards.enabled=true",
        "cap $1000",
    ):
        assert needle in notes, needle
    # the "stop by hand" command writes a stop file the trainer can parse
    line = re.search(r"sh -c \\\n\s+'(.*)'\n", notes)
    assert line, notes
    cmd = line.group(1).replace("/run/pretrain", str(tmp_path))
    subprocess.run(["sh", "-c", cmd], check=True, timeout=10)
    stop = json.loads((tmp_path / "stop.json").read_text())
    assert stop["mode"] == "graceful" and stop["cause"] == "user" and stop["written_unix"] > 1.6e9


# ------------------------------------------------------------- dashboards and alert rules


def _chart_copy(tmp_path: Path) -> Path:
    chart = tmp_path / "chart"
    shutil.copytree(h.CHART, chart, ignore=shutil.ignore_patterns("dashboards", "rules"))
    return chart


def test_dashboards_and_rules_picked_up(helm_bin, tmp_path):
    chart = _chart_copy(tmp_path)
    (chart / "dashboards").mkdir()
    for name in ("Training Overview.json", "budget.json"):
        (chart / "dashboards" / name).write_text(json.dumps({"title": name, "panels": []}))
    (chart / "rules").mkdir()
    rules = {
        "groups": [{"name": "pretrain", "rules": [{"alert": "BudgetAlmostSpent", "expr": "vector(1) > 0"}]}]
    }
    (chart / "rules" / "pretrain-rules.yaml").write_text(yaml.safe_dump(rules))
    on = {
        "metrics.grafanaDashboards.enabled": True,
        "metrics.prometheusRule.enabled": True,
        "metrics.prometheusRule.labels": {"release": "kube-prometheus-stack"},
    }
    docs = h.render(on, chart=chart)
    h.validate_all(docs)
    dash = [
        d for d in h.by_kind(docs, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    assert sorted(d["metadata"]["name"] for d in dash) == [
        "pretrain-dashboard-budget",
        "pretrain-dashboard-training-overview",
    ]
    for d in dash:
        ((key, text),) = d["data"].items()
        assert json.loads(text)["title"] == key
    rule = h.one(docs, "PrometheusRule")
    assert rule["spec"] == rules and rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # opt-in: nothing by default
    docs = h.render(chart=chart)
    assert not h.by_kind(docs, "PrometheusRule")
    assert all("grafana_dashboard" not in d["metadata"]["labels"] for d in h.by_kind(docs, "ConfigMap"))
    # a rules file that is not a `groups:` file is refused
    (chart / "rules" / "pretrain-rules.yaml").write_text("alerts: []\n")
    assert "top-level `groups:` list" in h.render_error(on, chart=chart)


def test_renders_without_dashboards_and_rules(helm_bin, tmp_path):
    chart = _chart_copy(tmp_path)
    docs = h.render(
        {"metrics.grafanaDashboards.enabled": True, "metrics.prometheusRule.enabled": True}, chart=chart
    )
    h.validate_all(docs)
    assert not h.by_kind(docs, "PrometheusRule")
    assert [d["metadata"]["name"] for d in h.by_kind(docs, "ConfigMap")] == ["pretrain-config"]


def test_shipped_dashboards_and_rules_if_present(helm_bin):
    """The observability files in helm/dashboards and helm/rules render into valid objects."""
    dashboards = sorted((h.CHART / "dashboards").glob("*.json"))
    rules = h.CHART / "rules" / "pretrain-rules.yaml"
    if not dashboards and not rules.exists():
        pytest.skip("helm/dashboards and helm/rules are not there yet")
    docs = h.render({"metrics.grafanaDashboards.enabled": True, "metrics.prometheusRule.enabled": True})
    h.validate_all(docs)
    dash = [
        d for d in h.by_kind(docs, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    assert len(dash) == len(dashboards)
    for d in dash:
        for text in d["data"].values():
            assert json.loads(text)["panels"]
    if rules.exists():
        assert h.one(docs, "PrometheusRule")["spec"]["groups"] == yaml.safe_load(rules.read_text())["groups"]


# ------------------------------------------------------------- values documentation and schema


def _leaves(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if (
            isinstance(v, dict)
            and v
            and key not in {"config", "commonLabels", "commonAnnotations"}
            and not key.endswith(
                (
                    "resources",
                    "Labels",
                    "labels",
                    "Annotations",
                    "annotations",
                    "nodeSelector",
                    "affinity",
                    "SecurityContext",
                )
            )
        ):
            out.update(_leaves(v, key + "."))
        else:
            out[key] = v
    return out


def test_every_value_documented_and_typed():
    text = (h.CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    documented = set(re.findall(r"^\s*## @param (\S+) \S", text, re.M))
    leaves = set(_leaves(values))
    assert leaves - documented == set(), "values without a `## @param` line"
    assert documented - leaves == set(), "`## @param` lines for values that do not exist"
    readme = (h.CHART / "README.md").read_text()
    assert {k for k in documented if f"| `{k}` |" not in readme} == set(), "helm/README.md parameter table"
    schema = json.loads((h.CHART / "values.schema.json").read_text())

    for leaf in leaves:
        cur = schema
        for part in leaf.split("."):
            assert cur.get("additionalProperties") is False, (
                f"{leaf}: unknown keys next to {part} are not refused"
            )
            cur = cur["properties"][part]
        assert cur.get("description"), f"{leaf}: no description in values.schema.json"


def test_schema_accepts_the_defaults():
    import jsonschema

    schema = json.loads((h.CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load((h.CHART / "values.yaml").read_text()), schema)
