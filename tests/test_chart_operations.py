"""The chart on a real cluster (issue 12), tested on rendered objects: a real helm v4 binary, the
PyTorchJob v1.9 CRD schema and kubernetes-validate strict (k8s_helpers.validate_all). What ran in the
containers is run here too (the prepare script, `pretrain wait-data`, the launcher's gate, the volume
permission step, the `helm test` pod's commands) with their paths moved under a temp dir. No cluster:
`lookup` is served by a fake API server (k8s_helpers.FakeCluster).

One test (group) per point of the issue: 1 retries that end, 2 a failed prepare, 3 volumes a non-root
pod can write, 4 storage classes and access modes, 5 upgrades, 6 gpus vs the preset, 7 decimal --set
values, 8 Kueue, 9 RBAC/labels/Pod Security, 10 what operators expect.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import chart_pods as pods
import k8s_helpers as h
import pytest
import yaml

from app import restarts

CI = sorted((h.CHART / "ci").glob("*-values.yaml"))
TRAINER_ENV = (
    "PRETRAIN_RUN_DIR",
    "PRETRAIN_MAX_RESTARTS",
    "PRETRAIN_RESTARTS_EPOCH",
    "PRETRAIN_DATA_VERDICT",
)


@pytest.fixture(scope="module", autouse=True)
def helm_bin() -> str:
    return h.helm_binary()


def trainer(docs: list, rtype: str = "Master") -> dict:
    return h.container(h.pod_spec(h.one(docs, "PyTorchJob"), rtype), "pytorch")


def arg(c: dict, flag: str) -> str:
    return c["args"][c["args"].index(flag) + 1]


def gate_env(c: dict, root: Path, monkeypatch) -> None:
    """The environment the rendered trainer container gives the launcher, its paths under root."""
    for key in TRAINER_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in h.env_map(c).items():
        if key in TRAINER_ENV:
            monkeypatch.setenv(key, h.local_path(value, root))
    monkeypatch.setenv("PRETRAIN_TERMINATION_LOG", str(root / "termination-log"))
    (root / "termination-log").write_text("")


# ------------------------------------------------------------- 1. retries that end


def test_1_crash_loops_end_after_max_restarts(tmp_path, monkeypatch):
    """Under ExitCode the operator retries codes >= 128 forever (kubeflow/trainer#2045): the chart hands
    the launcher a retry budget in the run dir, and the rendered settings end a crash loop with exit 5."""
    docs = h.render({"trainer.maxRestarts": 1, "job.activeDeadlineSeconds": 86400, "gpus": 16})
    h.validate_all(docs)
    job = h.one(docs, "PyTorchJob")
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 86400
    for rtype in ("Master", "Worker"):
        env = h.env_map(trainer(docs, rtype))
        assert env["PRETRAIN_RUN_DIR"] == arg(trainer(docs, rtype), "--out") == "/ckpt/pretrain"
        assert env["PRETRAIN_MAX_RESTARTS"] == "1" and env["PRETRAIN_RESTARTS_EPOCH"] == "1"
    gate_env(trainer(docs), tmp_path, monkeypatch)
    (tmp_path / "ckpt" / "pretrain").mkdir(parents=True)
    assert restarts.gated(lambda argv: 137, []) == 137  # an OOM kill: retried once
    assert restarts.gated(lambda argv: 137, []) == restarts.EXIT_RETRIES_SPENT
    assert "trainer.maxRestarts=1" in (tmp_path / "termination-log").read_text()
    assert trainer(docs)["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert restarts.EXIT_RETRIES_SPENT < 128, "must be permanent under ExitCode"


# ------------------------------------------------------------- 2. a failed prepare


def test_2_a_failed_prepare_ends_the_job_with_a_reason(tmp_path, monkeypatch):
    """`pretrain prepare` fails with a bad argument: the prepare pod marks the failure final, and the
    finalizer leaves the training job suspended (no GPU pod) with a PrepareFailed Event and the condition
    DataReady=False that `kubectl describe` shows. Were its pods started anyway, their wait step gives up at
    once and leaves a verdict, and the launcher exits 4 (permanent) instead of the initContainer failing
    (read as 0xbeef = retryable by the operator)."""
    docs = h.render({"prepare.wait.pollSeconds": 1})
    h.validate_all(docs)
    api = h.JobApi(docs, tmp_path)
    prep = h.PreparePod(docs, tmp_path)
    (tmp_path / "run").mkdir()
    proc = prep.run(FAIL="2")
    assert proc.returncode == 2 and "final: true" in proc.stderr
    failed = json.loads((tmp_path / "data" / "fineweb-edu-10bt" / "_FAILED").read_text())
    assert failed["final"] is True and failed["fingerprint"] == prep.fingerprint
    assert failed["reason"] == "error: stub failed"
    fin = h.PreparePod(docs, tmp_path, role="finalizer", kubeconfig=api.kubeconfig)
    assert fin.run().returncode == 4
    job = api.job
    assert job["spec"]["runPolicy"]["suspend"] is True
    (event,) = [e for e in api.events() if e["reason"] == "PrepareFailed"]
    assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "PyTorchJob"
    assert (
        "`pretrain prepare` failed for good: exit 2" in event["message"]
        and "error: stub failed" in event["message"]
    )
    (condition,) = [c for c in job["status"]["conditions"] if c["type"] == "DataReady"]
    assert (condition["status"], condition["reason"]) == ("False", "PrepareFailed")
    h.validate_all([job])
    api.close()
    proc = pods.wait_step(docs, tmp_path)
    assert proc.returncode == 0 and "gave up" in proc.stderr and "exit 2" in proc.stderr
    gate_env(trainer(docs), tmp_path, monkeypatch)
    assert restarts.gated(lambda argv: 0, []) == restarts.EXIT_DATA_NOT_READY
    assert "`pretrain prepare` failed for good: exit 2" in (tmp_path / "termination-log").read_text()
    # the Job itself: exit 2 fails it at once; evictions do not count against backoffLimit
    rules = h.prepare_job(docs)["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "prepare", "operator": "In", "values": [2]},
    }
    assert rules[1] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }


def test_2_a_crashing_prepare_is_final_only_past_its_backoff_limit(tmp_path):
    docs = h.render({"prepare.backoffLimit": 1})
    api = h.JobApi(docs, tmp_path)
    prep = h.PreparePod(docs, tmp_path)
    # the finalizer, with the prepare Job's uid (which the marker carries) in the fake API
    job = h.prepare_job(docs)
    api.server.store({**job, "metadata": {**job["metadata"], "namespace": "default", "uid": "uid-1"}})
    fin = h.PreparePod(docs, tmp_path, role="finalizer", kubeconfig=api.kubeconfig, own=("--poll", "0.2"))
    waiting = fin.start()
    failed = tmp_path / "data" / "fineweb-edu-10bt" / "_FAILED"
    assert prep.run(FAIL="137", PRETRAIN_JOB_UID="uid-1").returncode == 137
    assert json.loads(failed.read_text())["final"] is False
    assert prep.run(FAIL="143", PRETRAIN_JOB_UID="uid-1").returncode == 143  # a preemption does not count
    assert json.loads(failed.read_text())["failures"] == 1
    time.sleep(1.0)
    assert waiting.poll() is None, "not final yet: the finalizer waits"
    assert not [e for e in api.events() if e["reason"] == "PrepareFailed"]
    assert prep.run(FAIL="137", PRETRAIN_JOB_UID="uid-1").returncode == 137
    assert json.loads(failed.read_text())["final"] is True
    assert waiting.wait(timeout=60) == 4
    assert [e["reason"] for e in api.events()] == ["PrepareFailed"]
    # a new Job (a new uid) after a fix gets its whole backoff limit again, and its finalizer does not take
    # the old Job's final marker for its own
    api.server.store({**job, "metadata": {**job["metadata"], "namespace": "default", "uid": "uid-2"}})
    waiting = fin.start()
    assert prep.run(FAIL="137", PRETRAIN_JOB_UID="uid-2").returncode == 137
    assert json.loads(failed.read_text())["final"] is False
    assert prep.run(PRETRAIN_JOB_UID="uid-2").returncode == 0 and not failed.exists()
    assert waiting.wait(timeout=60) == 0
    assert api.job["spec"]["runPolicy"]["suspend"] is False
    (condition,) = [c for c in api.job["status"]["conditions"] if c["type"] == "DataReady"]
    assert (condition["status"], condition["reason"]) == ("True", "DataPrepared")
    api.close()


def test_2_the_wait_reads_the_prepare_job_and_posts_events(tmp_path):
    docs = h.render()
    master = h.pod_spec(h.one(docs, "PyTorchJob"), "Master")
    wait = h.container(master, "wait-for-data", init=True)
    job = h.prepare_job(docs)["metadata"]["name"]
    assert arg(wait, "--job") == job and arg(wait, "--event-job") == "pretrain"
    assert arg(wait, "--timeout") == "21600", "a finite default wait"
    mounts = {m["mountPath"]: m["name"] for m in wait["volumeMounts"]}
    token = mounts["/var/run/secrets/kubernetes.io/serviceaccount"]
    assert "serviceAccountToken" in json.dumps({v["name"]: v for v in master["volumes"]}[token])
    jobs_rule = [r for r in h.one(h.not_prepare(docs), "Role")["rules"] if r["resources"] == ["jobs"]]
    assert jobs_rule == [
        {"apiGroups": ["batch"], "resources": ["jobs"], "resourceNames": [job], "verbs": ["get"]}
    ]
    # Workers wait too, but only the Master posts the Event
    worker_wait = h.container(
        h.pod_spec(h.one(h.render({"gpus": 16}), "PyTorchJob"), "Worker"), "wait-for-data", True
    )
    assert "--event-job" not in worker_wait["args"]
    # the watcher does not bill the wait beyond its allowance
    watcher = h.container(master, "budget-watcher", init=True)
    assert arg(watcher, "--idle-allowance-seconds") == "1800"


def test_2_a_wait_step_that_cannot_run_ends_the_job_with_a_reason(tmp_path, monkeypatch, capsys):
    """The wait-for-data step given arguments it cannot use (here a flag of a newer chart than the image)
    must not fail as an initContainer (the operator reads the placeholder 48879, retryable, and loops
    uncounted): it leaves a verdict, and the launcher's gate ends the pod with 2, permanent, in one line."""
    docs = h.render()
    h.validate_all(docs)
    (tmp_path / "run").mkdir()
    (tmp_path / "ckpt" / "pretrain").mkdir(parents=True)
    proc = pods.wait_step(docs, tmp_path, extra_args=("--missing-gracee", "5"))
    assert proc.returncode == 0, proc.stderr
    line = pods.one_line(proc.stderr)
    assert "bad arguments" in line and "unrecognized arguments: --missing-gracee 5" in line
    verdict = json.loads((tmp_path / "run" / "data-verdict.json").read_text())
    assert verdict["code"] == 2 and verdict["reason"] in line
    gate_env(trainer(docs), tmp_path, monkeypatch)
    ran = []
    assert restarts.gated(lambda argv: ran.append(argv) or 0, []) == 2
    line = pods.one_line(capsys.readouterr().err)
    assert line.startswith("launch: the wait-for-data step failed: bad arguments")
    assert line.endswith("-> exit 2 (permanent)") and not ran, "the trainer must not start"
    assert (tmp_path / "termination-log").read_text().strip() == line


def test_2_a_crashing_wait_step_is_a_verdict_not_a_traceback(tmp_path, monkeypatch, capsys):
    """An unexpected error in the wait step (a bug, a library surprise): one line naming it and where,
    verdict code 1 (permanent, like a trainer crash), never the initContainer failure the operator loops on."""
    from app.data import wait

    docs = h.render()
    c = h.container(h.pod_spec(h.one(docs, "PyTorchJob"), "Master"), "wait-for-data", init=True)
    assert c["command"] == ["python", "-m", "app.data.wait"]

    def broken(*_a, **_k):
        raise RuntimeError("the volume said something odd\nsecond line")

    monkeypatch.setattr(wait, "wait_for_data", broken)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (tmp_path / "run").mkdir()
    assert wait.main([h.local_path(a, tmp_path) for a in c["args"]]) == 0
    err = capsys.readouterr().err
    line = pods.one_line(err)
    assert "crashed: RuntimeError: the volume said something odd (test_chart_operations.py:" in line
    verdict = json.loads((tmp_path / "run" / "data-verdict.json").read_text())
    assert verdict == {"code": 1, "reason": line.removeprefix("wait-for-data: ")}
    gate_env(trainer(docs), tmp_path, monkeypatch)
    assert restarts.gated(lambda argv: 0, []) == 1
    assert (
        "the wait-for-data step failed: crashed: RuntimeError" in (tmp_path / "termination-log").read_text()
    )


# ------------------------------------------------------------- 3. volumes a non-root pod can write


@pytest.fixture
def shared() -> Path:
    """A temp dir that uid 1000 can reach (pytest's own tmp_path is private to its user)."""
    path = Path(tempfile.mkdtemp())
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow  # ~7 s: the real watcher and launcher processes
def test_3_an_unwritable_checkpoint_volume_ends_the_job_instead_of_hanging_in_init(shared):
    """/ckpt that the pods' uid cannot write, with the budget-watcher sidecar on (the default): the
    watcher must not exit before serving /metrics (a native sidecar would restart in a loop, its
    startupProbe never pass, and the pod stay in Init holding GPUs with no exit code for the operator).
    It leaves a verdict on the shared emptyDir and passes its probe; the launcher exits 2 with one line."""
    docs = h.render()
    h.validate_all(docs)
    spec = pods.master(docs)
    watcher = h.container(spec, "budget-watcher", init=True)
    pytorch = h.container(spec, "pytorch")
    # the wiring: the verdict goes to the emptyDir both containers mount, where the launcher looks for it
    verdict_path = watcher["args"][watcher["args"].index("--verdict") + 1]
    assert h.env_map(pytorch)["PRETRAIN_WATCHER_VERDICT"] == verdict_path
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (watcher, pytorch)}
    run_volume = mounts["budget-watcher"]["/run/pretrain"]
    assert verdict_path.startswith("/run/pretrain/") and mounts["pytorch"]["/run/pretrain"] == run_volume
    assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}[run_volume]
    probe_port = watcher["startupProbe"]["httpGet"]["port"]
    (port_def,) = [p for p in watcher["ports"] if p["name"] == probe_port]
    assert watcher["args"][watcher["args"].index("--metrics-port") + 1] == str(port_def["containerPort"])

    # the pod, for real: a root-owned /ckpt (a fresh export), the trainer's uid 1000
    uid = 1000 if os.geteuid() == 0 else None
    (shared / "ckpt").mkdir(mode=0o755)
    if uid is None:
        os.chmod(shared / "ckpt", 0o555)  # not root: a read-only volume
    (shared / "run").mkdir()
    os.chmod(shared / "run", 0o777)
    (shared / "etc").mkdir()
    (shared / "etc" / "config.yaml").write_text(h.one(docs, "ConfigMap")["data"]["config.yaml"])
    port = pods.free_port()
    sidecar = pods.watcher_sidecar(docs, shared, port, uid=uid)
    try:
        assert pods.startup_probe(watcher, port, sidecar), (
            f"the sidecar never became ready (exit {sidecar.poll()}): {sidecar.communicate(timeout=10)}"
        )
        verdict = json.loads((shared / "run" / "watcher-verdict.json").read_text())
        assert (
            verdict["code"] == 2
            and f"is not writable by uid {os.geteuid() if uid is None else uid}" in (verdict["reason"])
        )
        proc = pods.launcher(docs, shared, uid=uid)
        assert proc.returncode == 2, proc.stderr
        line = pods.one_line(proc.stderr)
        assert line.startswith("launch: the budget watcher cannot run: ") and "-> exit 2 (permanent)" in line
        assert f"{shared}/ckpt/pretrain/budget" in line and verdict["reason"] in line
        assert (shared / "termination-log").read_text().strip() == line
        assert not (shared / "ran").exists(), "the trainer must not start"
        # the kubelet stops the sidecar once the trainer container has exited
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(timeout=30) == 0
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the root init step as root")
def test_3_the_volume_permission_step_hands_the_mount_points_to_uid_1000(tmp_path):
    docs = h.render()
    h.validate_all(docs)
    master = h.pod_spec(h.one(docs, "PyTorchJob"), "Master")
    step = h.container(master, "volume-permissions", init=True)
    assert master["initContainers"][0]["name"] == "volume-permissions"
    sc = step["securityContext"]
    assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER", "DAC_OVERRIDE"]}
    assert step["args"] == ["/ckpt", "/ckpt/pretrain"] and h.env_map(step)["OWNER"] == "1000:1000"
    prep_pod = h.prepare_job(docs)["spec"]["template"]["spec"]
    assert h.container(prep_pod, "volume-permissions", init=True)["args"] == [
        "/data",
        "/data/fineweb-edu-10bt",
    ]
    # run it for real on a root-owned "export" (as a fresh NFS/EFS volume is), then write as uid 1000
    vol = Path(tempfile.mkdtemp())
    try:
        os.chmod(vol, 0o755)
        script = step["command"][2].replace("/ckpt", str(vol))
        cmd = [
            "sh",
            "-c",
            script,
            "volume-permissions",
            *(a.replace("/ckpt", str(vol)) for a in step["args"]),
        ]
        proc = subprocess.run(cmd, env={**os.environ, "OWNER": "1000:1000"}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert (vol.stat().st_uid, (vol / "pretrain").stat().st_gid) == (1000, 1000)
        as_1000 = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
        write = subprocess.run([*as_1000, "mkdir", "-p", f"{vol}/pretrain/budget", f"{vol}/other-run"])
        assert write.returncode == 0
    finally:
        shutil.rmtree(vol)


@pytest.mark.parametrize(
    ("values", "on"),
    [
        ({}, True),  # ReadWriteMany: fsGroup is not applied by most CSI drivers
        ({"storage.data.existingClaim": "team-data"}, True),
        (
            {
                "storage.data.accessModes": ["ReadWriteOnce"],
                "storage.checkpoints.accessModes": ["ReadWriteOnce"],
            },
            False,
        ),
        ({"volumePermissions.enabled": False}, False),
        (
            {
                "volumePermissions.enabled": True,
                "storage.checkpoints.accessModes": ["ReadWriteOnce"],
                "storage.data.accessModes": ["ReadWriteOnce"],
            },
            True,
        ),
    ],
    ids=["rwx", "existing-claim", "rwo", "off", "forced"],
)
def test_3_volume_permissions_auto(values, on):
    docs = h.render(values)
    for where, spec in h.pod_specs(docs):
        if not where.startswith("Pod/"):  # the helm test pod writes nothing
            names = [c["name"] for c in spec.get("initContainers", [])]
            assert ("volume-permissions" in names) is on, where


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the script as uid 1000")
def test_3_an_unwritable_data_volume_is_one_line_and_fails_the_job_at_once(tmp_path):
    """The prepare pod cannot write the volume, nor so a marker: exit 2 fails its Job at once (the
    podFailurePolicy), and the finalizer reads that Failed condition and tells the training job (the
    PrepareFailed Event, DataReady=False), which stays suspended."""
    work = Path(tempfile.mkdtemp())
    try:
        os.chmod(work, 0o755)
        docs = h.render()
        api = h.JobApi(docs, work)
        prep = h.PreparePod(docs, work)
        os.chmod(work / "data", 0o755)  # root-owned, as a fresh export
        cmd = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", *prep.command()]
        proc = subprocess.run(cmd, env=prep.env, capture_output=True, text=True, timeout=60, cwd=h.REPO)
        assert proc.returncode == 2, proc.stderr  # the podFailurePolicy fails the Job on 2
        (line,) = proc.stderr.strip().splitlines()
        assert "is not writable as uid 1000 gid 1000" in line and "volumePermissions.enabled=true" in line
        # the Job controller's verdict on that exit, as the finalizer reads it
        job = h.prepare_job(docs)
        policy = (
            "Container prepare for pod default/x failed with exit code 2 matching FailJob rule at index 0"
        )
        failed = {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": policy}
        meta = {**job["metadata"], "namespace": "default"}
        api.server.store({**job, "metadata": meta, "status": {"conditions": [failed]}})
        fin = h.PreparePod(docs, work, role="finalizer", kubeconfig=api.kubeconfig)
        cmd = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", *fin.command()]
        proc = subprocess.run(cmd, env=fin.env, capture_output=True, text=True, timeout=60, cwd=h.REPO)
        api.close()
        assert proc.returncode == 4, proc.stderr
        (event,) = [e for e in api.events() if e["reason"] == "PrepareFailed"]
        assert f"prepare job/{meta['name']} failed: PodFailurePolicy: {policy}" in event["message"]
        assert f"kubectl logs job/{meta['name']}" in event["message"]
        (condition,) = [c for c in api.job["status"]["conditions"] if c["type"] == "DataReady"]
        assert condition["reason"] == "PrepareFailed" and api.job["spec"]["runPolicy"]["suspend"] is True
    finally:
        shutil.rmtree(work)


# ------------------------------------------------------------- 4. storage


def test_4_storage_classes_and_access_modes(tmp_path):
    docs = h.render({"storage.data.storageClass": "efs-sc", "storage.checkpoints.storageClass": "-"})
    pvcs = {p["metadata"]["name"]: p["spec"] for p in h.by_kind(docs, "PersistentVolumeClaim")}
    assert pvcs["pretrain-data"]["storageClassName"] == "efs-sc"
    assert pvcs["pretrain-ckpt"]["storageClassName"] == ""
    # several nodes on ReadWriteOnce: refused (bad values test); one node on ReadWriteOnce: the prepare pod
    # runs on the CPU pool (the training job has no pod until the prepare is done), and its finalizer on the
    # same node: the first of the two anywhere (it matches its own term), the second beside it; else the
    # second would hang on Multi-Attach, and they would wait for each other
    rwo = {
        "storage.data.accessModes": ["ReadWriteOnce"],
        "storage.checkpoints.accessModes": ["ReadWriteOnce"],
    }
    docs = h.render({"gpus": 4, **rwo, "prepare.nodeSelector": {"pool": "cpu"}})
    h.validate_all(docs)
    for role in ("prepare", "finalizer"):
        pod = h.prepare_job(docs, role)["spec"]["template"]
        (term,) = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    for rwx in (h.render({"gpus": 4}), h.render({"gpus": 4, "storage.data.existingClaim": "team-data"})):
        assert "affinity" not in h.prepare_job(rwx, "finalizer")["spec"]["template"]["spec"]
    assert h.one(docs, "PyTorchJob")["spec"]["runPolicy"]["suspend"] is True
    # an existing claim is not second-guessed (its access mode is unknown at render time)
    h.validate_all(h.render({"gpus": 16, "storage.data.existingClaim": "team-data"}))


# ------------------------------------------------------------- 5. upgrades


def test_5_the_prepare_job_is_named_per_pod_template():
    base = h.render()
    name = h.prepare_job(base)["metadata"]["name"]
    assert re.fullmatch(r"pretrain-prepare-[0-9a-f]{8}", name)
    assert h.prepare_job(h.render())["metadata"]["name"] == name, "deterministic"
    assert h.prepare_job(h.render({"gpus": 16}))["metadata"]["name"] == name, "trainer values do not matter"
    for change in (
        {"image.tag": "0.2.0"},
        {"prepare.workers": 8},
        {"prepare.resources": {"requests": {"cpu": "4"}}},
    ):
        other = h.render(change)
        new = h.prepare_job(other)["metadata"]["name"]
        assert new != name, change  # helm deletes the old Job and creates this one: no immutable-field error
        wait = h.container(h.pod_spec(h.one(other, "PyTorchJob"), "Master"), "wait-for-data", init=True)
        assert arg(wait, "--job") == new
    long = h.render(release="a-release-name-of-fifty-three-characters-helm-max-53")  # helm's longest
    job_name = h.prepare_job(long)["metadata"]["name"]
    assert len(job_name) <= 63 and h.NAME.match(job_name)
    h.validate_all(long)


@pytest.fixture
def cluster(tmp_path):
    fake = h.FakeCluster(tmp_path)
    yield fake
    fake.close()


def _running_job(topology: str, finished: bool = False) -> dict:
    conditions = [{"type": "Running", "status": "True"}]
    if finished:
        conditions.append({"type": "Succeeded", "status": "True"})
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": "pretrain",
            "namespace": "default",
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "annotations": {
                "pretrain/topology": topology,
                "meta.helm.sh/release-name": "pretrain",
                "meta.helm.sh/release-namespace": "default",
            },
        },
        "status": {"conditions": conditions},
    }


def test_5_an_upgrade_that_creates_the_training_job_again_runs_a_prepare_that_releases_it(cluster):
    """The job is created suspended and only a prepare pod releases it. An upgrade after `kubectl delete
    pytorchjob` (how "Upgrades" applies changes) creates it again, suspended: the prepare Jobs then get new
    names (the revision), so new pods run, find the marker and release it. An upgrade of a live job keeps
    the names, and so a prepare that is still running."""

    def job_names(proc: subprocess.CompletedProcess) -> list[str]:
        assert proc.returncode == 0, proc.stderr
        docs = h.objects(proc.stdout)
        return sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Job")

    sharded = {"prepare.parallelism": 2}
    install = job_names(cluster.render(sharded))
    assert install == sorted(d["metadata"]["name"] for d in h.by_kind(h.render(sharded), "Job"))
    recreated = job_names(cluster.render(sharded, "--is-upgrade"))
    assert set(recreated).isdisjoint(install)
    cluster.objects["/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/pretrain"] = _running_job("1x8")
    assert job_names(cluster.render(sharded, "--is-upgrade")) == install


def test_5_a_cluster_with_trainer_v2_alone_installs(cluster):
    """The shape guard looks up a PyTorchJob; where the v1 operator is not installed there is none to look
    up, and Helm's lookup of an API the cluster does not serve would fail the install."""
    cluster.GROUPS = {gv: r for gv, r in cluster.GROUPS.items() if gv != "kubeflow.org/v1"}
    cluster.GROUPS["trainer.kubeflow.org/v1alpha1"] = ["trainjobs", "trainingruntimes"]
    cluster.KINDS = {**cluster.KINDS, "trainjobs": "TrainJob", "trainingruntimes": "TrainingRuntime"}
    proc = cluster.render({"scheduler": "trainjob"}, "--is-upgrade")
    assert proc.returncode == 0, proc.stderr
    assert "kind: TrainJob" in proc.stdout


def test_5_an_upgrade_that_reshapes_a_running_job_is_refused(cluster):
    """The operator never replaces running pods: a new Worker with --nnodes=2 would wait forever beside
    the old Master with --nnodes=1. A real `helm upgrade` looks the job up and refuses."""
    path = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/pretrain"
    cluster.objects[path] = _running_job("1x8")
    proc = cluster.render({"gpus": 16})
    assert proc.returncode == 1
    assert "changes the running PyTorchJob pretrain from 1x8 to 2x8" in proc.stderr
    assert (
        "kubectl -n default delete pytorchjob pretrain" in proc.stderr
        and "resumes from /ckpt/pretrain" in proc.stderr
    )
    assert path in cluster.requests
    assert cluster.render({"gpus": 8}).returncode == 0  # same shape: fine (nothing changes until recreated)
    cluster.objects[path] = _running_job("1x8", finished=True)
    assert cluster.render({"gpus": 16}).returncode == 0  # a finished job: nothing runs to hang
    del cluster.objects[path]
    assert cluster.render({"gpus": 16}).returncode == 0  # first install
    assert (
        h.one(h.render({"gpus": 16}), "PyTorchJob")["metadata"]["annotations"]["pretrain/topology"] == "2x8"
    )


# ------------------------------------------------------------- 6. gpus vs the preset


def test_6_gpus_the_preset_cannot_split_are_refused_before_scheduling():
    """Checked against the trainer's own rule (app/trainer/parallel/runtime.py grad_accum_steps) for the two
    presets that fix a global batch, over GPU counts that divide and that do not."""
    from app.config import load_config
    from app.errors import UserError
    from app.trainer.parallel.layout import fit_memory
    from app.trainer.parallel.runtime import grad_accum_steps

    for preset in ("x1-50m", "gpt2-124m"):
        cfg = load_config(preset=preset)
        for gpus in (3, 5, 8, 12, 24, 32, 40):
            try:  # micro_batch_size auto: the batch layout's rule (app/trainer/parallel/layout.py)
                auto = cfg.train.micro_batch_size == "auto"
                fit_memory(cfg, gpus, int(80e9), True, "GPU") if auto else grad_accum_steps(cfg, gpus)
                trainer_ok = True
            except UserError:
                trainer_ok = False
            values = {"gpus": gpus, "gpusPerNode": 1 if gpus > 8 and gpus % 8 else 8, "config.preset": preset}
            proc = h.helm("template", "pretrain", str(h.CHART), *h._set_args(values), check=False)
            assert (proc.returncode == 0) == trainer_ok, f"{preset} on {gpus} GPUs: {proc.stderr}"
    # overrides in config and in extraTrainArgs move the limit
    h.render({"gpus": 24, "config.train.batch_tokens": 393216})
    h.render({"gpus": 24, "extraTrainArgs": ["--set", "train.batch_tokens=393216"]})
    err = h.render_error({"gpus": 24, "extraTrainArgs": ["--set", "train.micro_batch_size=8"]})
    assert "micro_batch_size 8" in err
    h.render({"gpus": 24, "config": {"preset": "tiny"}})  # no global batch: any count


def test_6_the_preset_table_matches_the_trainer_presets():
    proc = subprocess.run(
        [sys.executable, str(h.REPO / "scripts" / "chart_presets.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------- 7. decimal values with --set


def test_7_decimal_values_with_plain_set():
    """`helm --set` types only integers: 2.49 arrives as the string "2.49". Accepted, and the same
    arguments as the numbers --set-json gives."""
    sets = ["budget.pricePerGpuHour=2.49", "budget.capUSD=999.99", "prepare.valFraction=0.002"]
    out = h.helm("template", "pretrain", str(h.CHART), *[x for s in sets for x in ("--set", s)]).stdout
    as_strings = h.objects(out)
    as_numbers = h.render(
        {"budget.pricePerGpuHour": 2.49, "budget.capUSD": 999.99, "prepare.valFraction": 0.002}
    )
    h.validate_all(as_strings)
    for docs in (as_strings, as_numbers):
        t = trainer(docs)
        assert arg(t, "--budget-cap-usd") == "999.99" and arg(t, "--price-per-gpu-hour") == "2.49"
        watcher = h.container(h.pod_spec(h.one(docs, "PyTorchJob"), "Master"), "budget-watcher", init=True)
        assert arg(watcher, "--budget-cap-usd") == "999.99" and arg(watcher, "--price-per-gpu-hour") == "2.49"
        prep = h.prepare_job(docs)["spec"]["template"]["spec"]["containers"][0]
        assert arg(prep, "--val-fraction") == "0.002"
    assert trainer(as_strings)["args"] == trainer(as_numbers)["args"]


# ------------------------------------------------------------- 8. Kueue


def test_8_kueue(tmp_path):
    """Kueue owns `suspend` of the jobs it manages: the job stays out of the queue (no queue label) while the
    data is tokenized, and the prepare hands it to the queue (adds the label) when the data is ready."""
    docs = h.render({"job.kueueQueueName": "gpu-queue", "prepare.kueueQueueName": "cpu-queue"})
    h.validate_all(docs)
    job = h.one(docs, "PyTorchJob")
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]
    assert job["spec"]["runPolicy"]["suspend"] is True
    args = h.prepare_job(docs, "finalizer")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--queue") + 1] == "gpu-queue"
    rules = {tuple(r["apiGroups"]): r["verbs"] for r in h.one(h.not_prepare(docs), "Role")["rules"]}
    assert rules[("kueue.x-k8s.io",)] == ["list", "patch"]  # the watcher deactivates the Workload
    notes = _notes(tmp_path, {"job.kueueQueueName": "gpu-queue"})
    assert "joins queue gpu-queue only when its data is ready" in notes
    assert "kueue.x-k8s.io/queue-name=gpu-queue" in notes  # the manual release
    # without a prepare the job is queued at once
    own_data = {
        "job.kueueQueueName": "gpu-queue",
        "prepare.enabled": False,
        "config": {"data": {"dataset": "/data/x"}},
    }
    job = h.one(h.render(own_data), "PyTorchJob")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert "suspend" not in job["spec"]["runPolicy"]


# ------------------------------------------------------------- 9. RBAC, labels, Pod Security


def test_9_service_account_labels_and_pod_security():
    docs = h.render({"serviceAccount.create": False, "serviceAccount.name": "ml-runner"})
    assert not h.by_kind(docs, "ServiceAccount")
    assert h.one(h.not_prepare(docs), "RoleBinding")["subjects"][0]["name"] == "ml-runner"
    assert h.pod_spec(h.one(docs, "PyTorchJob"), "Master")["serviceAccountName"] == "ml-runner"
    # commonLabels/Annotations reach every pod; the prepare pod takes its own too
    docs = h.render(
        {
            "gpus": 16,
            "commonLabels": {"team": "llm"},
            "commonAnnotations": {"cost-center": "42"},
            "prepare.podLabels": {"pool": "cpu"},
            "prepare.podAnnotations": {"note": "tokenize"},
        }
    )
    h.validate_all(docs)
    metas = dict(h.pod_templates(docs))
    assert len(metas) == 5  # Master, Worker, prepare, its finalizer, helm test
    for where, meta in metas.items():
        assert meta["labels"]["team"] == "llm" and meta["annotations"]["cost-center"] == "42", where
    for prepare in (m for w, m in metas.items() if w.startswith("Job/")):
        assert prepare["labels"]["pool"] == "cpu" and prepare["annotations"]["note"] == "tokenize"
    # Pod Security Standards: the default passes `baseline`; without the root step, `restricted`
    for where, spec in h.pod_specs(docs):
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert h.psa_violations(spec, "baseline") == [], where
        if any(c["name"] == "volume-permissions" for c in spec.get("initContainers", [])):
            assert h.psa_violations(spec, "restricted"), f"{where}: the root init step is not `restricted`"
    strict = h.render({"volumePermissions.enabled": False, "gpus": 16})
    for where, spec in h.pod_specs(strict):
        assert h.psa_violations(spec, "restricted") == [], where


def test_9_a_release_name_must_start_with_a_letter():
    proc = h.helm("template", "1st", str(h.CHART), check=False)
    assert proc.returncode == 1 and "must start with a letter" in proc.stderr
    h.validate_all(h.render(release="run1"))
    h.validate_all(h.render(release="1st", values={"fullnameOverride": "first"}))


# ------------------------------------------------------------- 10. what operators expect


def test_10_resources_scale_per_gpu_and_qos():
    one = trainer(h.render({"gpus": 1}))["resources"]
    assert one == {
        "requests": {"cpu": "1", "memory": "8Gi", "nvidia.com/gpu": 1},
        "limits": {"memory": "32Gi", "nvidia.com/gpu": 1},
    }
    eight = trainer(h.render({"gpus": 16}), "Worker")["resources"]
    assert eight["requests"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 8}
    half = trainer(h.render({"gpus": 1, "trainer.resourcesPerGpu.cpu": "0.5"}))["resources"]
    assert half["requests"]["cpu"] == "500m"
    given = trainer(h.render({"trainer.resources": {"requests": {"cpu": "30"}}}))["resources"]
    assert given == {"requests": {"cpu": "30", "nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}
    for where, spec in h.pod_specs(h.render({"gpus": 16})):
        if where.startswith("PyTorchJob"):
            assert h.qos_class(spec) == "Burstable", where
    docs = h.render({"gpus": 16, "trainer.qos": "Guaranteed"})
    h.validate_all(docs)
    for rtype in ("Master", "Worker"):
        spec = h.pod_spec(h.one(docs, "PyTorchJob"), rtype)
        assert h.qos_class(spec) == "Guaranteed", rtype  # every container, the sidecar and init steps too
    res = trainer(docs)["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"] == "256Gi"


def test_10_network_fabric_and_capabilities_of_the_trainer_alone():
    docs = h.render(
        {
            "gpus": 16,
            "trainer.network.socketIfname": "eth0",
            "trainer.network.fabric": "efa",
            "trainer.network.fabricResources": {"vpc.amazonaws.com/efa": 32},
            "trainer.network.ncclDebug": "INFO",
        }
    )
    h.validate_all(docs)
    for rtype in ("Master", "Worker"):
        spec = h.pod_spec(h.one(docs, "PyTorchJob"), rtype)
        t = h.container(spec, "pytorch")
        env = h.env_map(t)
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert (
            env["FI_PROVIDER"] == "efa"
            and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
            and env["NCCL_DEBUG"] == "INFO"
        )
        assert t["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32
        assert t["resources"]["requests"]["vpc.amazonaws.com/efa"] == 32
        assert t["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        for c in spec["initContainers"]:
            assert "IPC_LOCK" not in json.dumps(c.get("securityContext", {})), c["name"]
    ib = trainer(
        h.render({"trainer.network.fabric": "infiniband", "trainer.extraCapabilities": ["SYS_NICE"]})
    )
    assert h.env_map(ib)["NCCL_IB_DISABLE"] == "0"
    assert ib["securityContext"]["capabilities"]["add"] == ["SYS_NICE", "IPC_LOCK"]
    assert "add" not in trainer(h.render())["securityContext"]["capabilities"]  # none by default


def test_10_eviction_protection():
    docs = h.render({"gpus": 16, "trainer.podDisruptionBudget.enabled": True})
    h.validate_all(docs)
    pdb = h.one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 0
    for rtype in ("Master", "Worker"):
        meta = h.one(docs, "PyTorchJob")["spec"]["pytorchReplicaSpecs"][rtype]["template"]["metadata"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items()
        assert meta["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
        assert meta["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert not h.by_kind(h.render(), "PodDisruptionBudget")
    meta = h.one(h.render({"trainer.safeToEvict": True}), "PyTorchJob")["spec"]["pytorchReplicaSpecs"][
        "Master"
    ]
    assert "cluster-autoscaler.kubernetes.io/safe-to-evict" not in meta["template"]["metadata"]["annotations"]


def test_10_helm_test_pod_runs_the_chart_arguments(tmp_path):
    """The `helm test` pod is valid, and what it runs succeeds against the chart's own config."""
    docs = h.render({"gpus": 16})
    pod = h.one(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    h.validate_all([pod])
    cm = h.one(docs, "ConfigMap")
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])

    def local(a: str) -> str:
        return (
            a.replace("/etc/pretrain", str(tmp_path))
            .replace("/ckpt", str(tmp_path / "ckpt"))
            .replace("/run/pretrain", str(tmp_path))
        )

    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert list(containers) == ["image-user", "trainer-args", "watcher-args", "wait-args"]
    trainer_args, watcher_args, wait_args = (
        containers[n] for n in ("trainer-args", "watcher-args", "wait-args")
    )
    # the trainer's own arguments, which tests/test_k8s_manifests.py runs with --print-config
    assert trainer_args["command"] == ["python", "-m", "app.train"]
    assert trainer_args["args"][-1] == "--print-config"
    # the watcher's dry run, here as in the pod: the ledger directory must be writable
    assert watcher_args["command"] == ["pretrain"] and watcher_args["args"][-1] == "--dry-run-budget"
    cmd = [sys.executable, "-m", "app.cli", *map(local, watcher_args["args"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=h.REPO)
    assert proc.returncode == 0 and "cap $1000" in proc.stdout, proc.stdout + proc.stderr
    # the wait step's arguments, parsed and checked (nothing waited for, no verdict written)
    assert (
        wait_args["command"] == ["python", "-m", "app.data.wait"] and wait_args["args"][-1] == "--check-args"
    )
    cmd = [sys.executable, "-m", "app.data.wait", *map(local, wait_args["args"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=h.REPO, env=pods.clean_env())
    assert proc.returncode == 0 and "would wait for" in proc.stdout, proc.stderr
    bad = subprocess.run([*cmd, "--no-such-flag"], capture_output=True, text=True, timeout=60, cwd=h.REPO)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in pods.one_line(bad.stderr)
    assert not list(tmp_path.glob("*verdict*")), "a check writes no verdict"
    # their arguments are exactly the trainer's, the watcher's and the Master's wait step's
    assert trainer_args["args"][:-1] == trainer(docs)["args"][5:]
    master = h.pod_spec(h.one(docs, "PyTorchJob"), "Master")
    assert watcher_args["args"][:-1] == h.container(master, "budget-watcher", init=True)["args"]
    assert wait_args["args"][:-1] == h.container(master, "wait-for-data", init=True)["args"]
    assert not h.by_kind(h.render({"helmTest.enabled": False}), "Pod")
    no_prepare = h.render(
        {"prepare.enabled": False, "config": {"preset": "tiny", "data": {"dataset": "embedded"}}}
    )
    assert "wait-args" not in [c["name"] for c in h.one(no_prepare, "Pod")["spec"]["containers"]]


def test_10_helm_test_checks_the_image_user(tmp_path):
    """`helm test` says the image starts as the uid the chart runs its pods as: the test pod leaves
    runAsUser/runAsGroup unset (the image's USER applies) and compares `id -u` with
    podSecurityContext.runAsUser; its script, run for real, passes for that uid and fails for another."""
    for values, uid in (({}, 1000), ({"podSecurityContext.runAsUser": 2000}, 2000)):
        pod = h.one(h.render(values), "Pod")
        h.validate_all([pod])
        assert "runAsUser" not in pod["spec"]["securityContext"]
        assert "runAsGroup" not in pod["spec"]["securityContext"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        c = {c["name"]: c for c in pod["spec"]["containers"]}["image-user"]
        assert "runAsUser" not in c.get("securityContext", {})
        assert h.env_map(c)["EXPECTED_UID"] == str(uid)
    assert c["command"][:2] == ["sh", "-c"]
    me = os.getuid()
    ok = subprocess.run(
        [*c["command"], "image-user"],
        env={"EXPECTED_UID": str(me), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert ok.returncode == 0 and f"uid {me}" in ok.stdout, ok.stderr
    bad = subprocess.run(
        [*c["command"], "image-user"],
        env={"EXPECTED_UID": str(me + 1), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert bad.returncode == 1
    line = pods.one_line(bad.stderr)
    assert f"the image runs as uid {me}" in line and f"runs its pods as uid {me + 1}" in line
    assert "APP_UID" in line


@pytest.mark.parametrize("values_file", CI, ids=[p.stem for p in CI])
def test_10_ci_values_files(values_file):
    """The value sets `ct install` would install: lint --strict, render, validate."""
    lint = h.helm("lint", "--strict", str(h.CHART), "-f", str(values_file), check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = h.helm("template", "pretrain", str(h.CHART), "-f", str(values_file)).stdout
    docs = h.objects(out)
    h.validate_all(docs)
    if values_file.stem == "psa-restricted-values":
        for where, spec in h.pod_specs(docs):
            assert h.psa_violations(spec, "restricted") == [], where
    if values_file.stem == "guaranteed-efa-values":
        for where, spec in h.pod_specs(docs):
            if where.startswith("PyTorchJob"):
                assert h.qos_class(spec) == "Guaranteed", where


def _notes(tmp_path: Path, values: dict) -> str:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    cmd = [h.helm_binary(), "install", "pretrain", str(h.CHART), "--dry-run=client", *h._set_args(values)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


def test_10_notes_warn_before_the_pods_hang(tmp_path):
    notes = _notes(tmp_path, {})
    assert "WARNING: image pretrain:0.1.0 names no registry" in notes
    for key in ("data", "checkpoints"):
        assert f"WARNING: storage.{key}.storageClass is empty" in notes
    assert "cannot do ReadWriteMany" in notes and "efs-sc" in notes
    assert "volumePermissions is on" in notes
    assert "6 failures in a row without a new checkpoint (trainer.maxRestarts=5)" in notes
    quiet = _notes(
        tmp_path,
        {
            "image.repository": "registry.example.com/team/pretrain",
            "storage.data.storageClass": "efs-sc",
            "storage.checkpoints.storageClass": "efs-sc",
        },
    )
    assert "WARNING" not in quiet


def test_10_chart_metadata_and_packaged_readme(tmp_path):
    chart = yaml.safe_load((h.CHART / "Chart.yaml").read_text())
    assert chart["icon"].startswith("data:image/svg+xml;base64,")
    assert chart["maintainers"] and chart["kubeVersion"]
    # the packaged chart carries README.md alone: its links must stay inside the chart
    readme = (h.CHART / "README.md").read_text()
    for target in re.findall(r"\]\(<?([^)>#\s]+)", readme):
        assert not target.startswith(("/", "..")) and ":" not in target, target
        assert (h.CHART / target).exists(), target
    pkg = h.helm("package", str(h.CHART), "-d", str(tmp_path))
    assert pkg.returncode == 0 and list(tmp_path.glob("pretrain-*.tgz"))
