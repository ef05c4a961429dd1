"""The training job waits suspended until its data is ready, and the prepare side releases it.

The chart's prepare pods (`python -m app.data.prepare_job`, as rendered by a real helm) run here for real, with
the real `pretrain prepare` on local files, against a fake API server on 127.0.0.1 that serves the rendered
job and applies the merge patches the real `kubernetes` client sends (tests/test_budget_kube.py). What is
checked is what a user sees: the job's suspend field (or under Kueue its queue label), its DataReady
condition (`kubectl describe`), its Events, and the job still valid against the operator's CRD. The pods
that tokenize hold no API token; the finalizer pod (which parses no download) releases the job.
"""

from __future__ import annotations

import json
from pathlib import Path

import k8s_helpers as h
import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:HTTPResponse.getheader:DeprecationWarning")
TJ = {"scheduler": "trainjob"}


def local_values(**extra) -> dict:
    """A prepare of local text files on the data volume, quick to tokenize."""
    return {
        "prepare.input": "/data/raw",
        "prepare.tokenizer": "char",
        "prepare.valFraction": 0.1,
        "prepare.extraArgs": ["--txt-split", "line", "--shard-tokens", "4000", "--workers", "1"],
        **extra,
    }


def write_input(root: Path) -> None:
    raw = root / "data" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3):
        lines = [
            " ".join(f"w{k}" for k in rng.integers(0, 50, size=int(rng.integers(3, 40)))) for _ in range(150)
        ]
        (raw / f"part-{i}.txt").write_text("\n".join(lines) + "\n")


def suspended(job: dict) -> bool:
    spec = job["spec"]
    return (spec["runPolicy"] if job["kind"] == "PyTorchJob" else spec).get("suspend", False)


def data_ready(job: dict) -> dict:
    (condition,) = [c for c in job.get("status", {}).get("conditions", []) if c["type"] == "DataReady"]
    return condition


def finalizer(docs: list, root: Path, api: h.JobApi | None, *own: str, real: bool = False) -> h.PreparePod:
    """The rendered finalizer pod, against `api` (None: no API), with more options (a short grace)."""
    kubeconfig = api.kubeconfig if api is not None else None
    return h.PreparePod(docs, root, role="finalizer", kubeconfig=kubeconfig, real=real, own=own)


def store_prepare_job(api: h.JobApi, docs: list, *conditions: dict) -> str:
    """The prepare Job (the shares' Indexed Job) in the fake API, with these status conditions; its name."""
    job = h.prepare_job(docs)
    meta = {**job["metadata"], "namespace": "default"}
    api.server.store({**job, "metadata": meta, "status": {"conditions": list(conditions)}})
    return meta["name"]


COMPLETE = {"type": "Complete", "status": "True"}
QUICK = ("--poll", "0.2", "--missing-grace", "1")  # the finalizer's grace, shortened


@pytest.mark.parametrize("values", [{}, TJ], ids=["pytorchjob", "trainjob"])
def test_a_prepare_pod_prepares_then_the_finalizer_releases_the_suspended_job(tmp_path, values):
    docs = h.render(local_values(**values))
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        assert suspended(api.job), "rendered suspended: no trainer pod, no GPU, while the data is made"
        prep = h.PreparePod(docs, tmp_path, kubeconfig=api.kubeconfig)  # a stand-in `pretrain prepare`
        proc = prep.run()
        assert proc.returncode == 0, proc.stderr
        out = tmp_path / "data" / "fineweb-edu-10bt"
        assert (out / "_READY").read_text().strip() == prep.fingerprint
        assert not api.server.requests and suspended(api.job), "the pod that parses the input calls no API"
        proc = finalizer(docs, tmp_path, api).run()
        assert proc.returncode == 0, proc.stderr
        job = api.job
        assert not suspended(job)
        assert job["metadata"]["annotations"]["pretrain/data-ready"] == prep.fingerprint
        (release,) = [r for r in api.server.calls("PATCH") if not r["path"].endswith("/status")]
        assert release["content_type"] == "application/merge-patch+json"
        assert release["path"] == api.path
        unsuspend = (
            {"spec": {"runPolicy": {"suspend": False}}}
            if job["kind"] == "PyTorchJob"
            else {"spec": {"suspend": False}}
        )
        assert release["body"] == {
            "metadata": {"annotations": {"pretrain/data-ready": prep.fingerprint}},
            **unsuspend,
        }
        condition = data_ready(job)
        assert (condition["status"], condition["reason"]) == ("True", "DataPrepared")
        assert [(e["reason"], e["type"]) for e in api.events()] == [("DataReady", "Normal")]
        h.validate_all([job])  # the patched job, status included, still matches the operator's CRD


def test_a_prepare_pod_whose_marker_matches_does_nothing_and_the_job_is_released(tmp_path):
    """A job created again (after `kubectl delete` and `helm upgrade`, which then runs new prepare Jobs):
    the prepare pod finds the marker of these arguments, and the finalizer releases the job at once."""
    docs = h.render(local_values())
    with h.JobApi(docs, tmp_path) as api:
        prep = h.PreparePod(docs, tmp_path, kubeconfig=api.kubeconfig)
        out = tmp_path / "data" / "fineweb-edu-10bt"
        out.mkdir()
        (out / "_READY").write_text(f"{prep.fingerprint}\n")
        proc = prep.run()
        assert proc.returncode == 0 and "nothing to do" in proc.stdout, proc.stderr
        assert not prep.calls.exists()
        proc = finalizer(docs, tmp_path, api).run()
        assert proc.returncode == 0, proc.stderr
        assert not suspended(api.job)
        assert not [c for c in api.server.calls("PATCH") if "Preparing" in json.dumps(c["body"])]


def test_under_kueue_releasing_hands_the_job_to_its_queue(tmp_path):
    """Kueue owns `suspend` of the jobs it manages and would unsuspend an admitted one at once: the job is
    rendered without its queue label, so Kueue ignores it while the data is made, and the release adds the
    label (suspend stays true: Kueue clears it when it admits the job)."""
    docs = h.render(local_values(**{"job.kueueQueueName": "gpu-queue"}))
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        assert "kueue.x-k8s.io/queue-name" not in api.job["metadata"]["labels"]
        assert h.PreparePod(docs, tmp_path).run().returncode == 0
        proc = finalizer(docs, tmp_path, api).run()
        assert proc.returncode == 0, proc.stderr
        (release,) = [r for r in api.server.calls("PATCH") if not r["path"].endswith("/status")]
        assert "spec" not in release["body"]
        assert release["body"]["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "gpu-queue"}
        assert api.job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        assert suspended(api.job), "Kueue's to clear"
        assert "handed to Kueue queue gpu-queue" in data_ready(api.job)["message"]


def test_the_condition_keeps_the_operators_own_and_survives_a_conflict(tmp_path):
    """The DataReady condition is read-modify-written with the resourceVersion read: the operator's
    conditions stay, and a concurrent update (409 Conflict) is read again, not overwritten."""
    from kubernetes import client

    from app.budget.kube import KubeActions

    docs = h.render(TJ)
    with h.JobApi(docs, tmp_path) as api:
        operator = {
            "type": "Suspended",
            "status": "True",
            "reason": "Suspended",
            "message": "suspended",
            "lastTransitionTime": "2025-01-01T00:00:00Z",
        }
        api.job["status"] = {"conditions": [operator]}
        api.server.conflicts = 1
        kube = KubeActions(
            "default",
            "pretrain",
            client.ApiClient(client.Configuration(host=api.server.url)),
            kind="TrainJob",
        )
        kube.set_condition(False, "Preparing", "`pretrain prepare` is writing /data/x")
        kube.set_condition(False, "Preparing", "still")
        conditions = api.job["status"]["conditions"]
        assert [c["type"] for c in conditions] == ["Suspended", "DataReady"] and conditions[0] == operator
        assert conditions[1]["message"] == "still"
        patches = [r for r in api.server.calls("PATCH") if r["path"].endswith("/status")]
        assert (
            len(patches) == 3 and patches[0]["body"]["metadata"]["resourceVersion"] == "1"
        )  # 409, then again
        h.validate_all([api.job])


def test_a_release_the_rbac_refuses_is_one_line_with_the_command_that_does_it(tmp_path):
    docs = h.render(local_values())
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        api.server.forbidden.add(api.path)
        assert h.PreparePod(docs, tmp_path).run().returncode == 0
        proc = finalizer(docs, tmp_path, api).run()
        assert proc.returncode == 2, proc.stderr  # the podFailurePolicy fails the Job: retrying cannot help
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("prepare: the data is ready")]
        assert "HTTP 403" in line
        assert (
            'kubectl -n default patch pytorchjob pretrain --type merge -p \'{"spec":{"runPolicy":{"suspend":false}}}\''
            in line
        )
        # the data itself is ready
        assert (tmp_path / "data" / "fineweb-edu-10bt" / "_READY").exists()


def test_the_chart_renders_a_sharded_prepare_as_an_indexed_job_and_a_finalizer():
    docs = h.render({"prepare.parallelism": 3, "prepare.backoffLimit": 2})
    h.validate_all(docs)
    shares = h.prepare_job(docs)
    spec = shares["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert (spec["backoffLimitPerIndex"], spec["maxFailedIndexes"]) == (2, 0) and "backoffLimit" not in spec
    share_pod = spec["template"]["spec"]
    c = share_pod["containers"][0]
    assert c["args"][:2] == ["run", "--dir"] and c["args"][c["args"].index("--shard-count") + 1] == "3"
    assert "--job" not in c["args"], "a share releases nothing: no API token"
    assert not any(v.get("projected") for v in share_pod["volumes"])
    fin = h.prepare_job(docs, "finalizer")
    f = fin["spec"]["template"]["spec"]["containers"][0]
    assert (
        f["args"][0] == "finalize"
        and f["args"][f["args"].index("--prepare-job") + 1] == shares["metadata"]["name"]
    )
    assert f["args"][f["args"].index("--job") + 1] == "PyTorchJob/pretrain"
    assert f["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert fin["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2, 4]
    mounts = {m["mountPath"] for m in f["volumeMounts"]}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts
    # the trainer's wait step and its Role watch the finalizer, which writes the marker
    wait = h.container(h.pod_spec(h.one(docs, "PyTorchJob"), "Master"), "wait-for-data", init=True)
    assert wait["args"][wait["args"].index("--job") + 1] == fin["metadata"]["name"]
    # the prepare's Role: the shares' Job, besides releasing this job
    role = [r for r in h.by_kind(docs, "Role") if r["metadata"]["name"] == "pretrain-prepare"][0]
    assert {
        "apiGroups": ["batch"],
        "resources": ["jobs"],
        "resourceNames": [shares["metadata"]["name"]],
        "verbs": ["get"],
    } in role["rules"]


@pytest.mark.parametrize("values", [{}, TJ], ids=["pytorchjob", "trainjob"])
def test_the_prepares_rbac_is_this_jobs_release_alone(values):
    docs = h.render(values)
    kind, plural, group = (
        ("TrainJob", "trainjobs", "trainer.kubeflow.org")
        if values
        else ("PyTorchJob", "pytorchjobs", "kubeflow.org")
    )
    role = [r for r in h.by_kind(docs, "Role") if r["metadata"]["name"] == "pretrain-prepare"][0]
    assert role["rules"] == [
        {
            "apiGroups": [group],
            "resources": [plural],
            "resourceNames": ["pretrain"],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": [group],
            "resources": [f"{plural}/status"],
            "resourceNames": ["pretrain"],
            "verbs": ["patch"],
        },
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {
            "apiGroups": ["batch"],
            "resources": ["jobs"],
            "resourceNames": [h.prepare_job(docs)["metadata"]["name"]],
            "verbs": ["get"],
        },
    ]
    binding = [b for b in h.by_kind(docs, "RoleBinding") if b["metadata"]["name"] == "pretrain-prepare"][0]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pretrain-prepare", "namespace": "default"}
    ]
    # The pod that downloads and parses the input (parquet, tokenizer.json) holds no token: a parser exploit
    # there cannot patch the job's pod template. The finalizer, which parses no download, holds it.
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    prep, fin = (h.prepare_job(docs, role)["spec"]["template"]["spec"] for role in ("prepare", "finalizer"))
    for pod in (prep, fin):
        assert (
            pod["serviceAccountName"] == "pretrain-prepare" and pod["automountServiceAccountToken"] is False
        )
    c = prep["containers"][0]
    assert c["args"][0] == "run" and "--job" not in c["args"]
    assert token not in json.dumps(c["volumeMounts"]) and not any(v.get("projected") for v in prep["volumes"])
    f = fin["containers"][0]
    assert f["args"][0] == "finalize" and f["args"][f["args"].index("--job") + 1] == f"{kind}/pretrain"
    assert token in {m["mountPath"] for m in f["volumeMounts"]}
    # no trainer pod has this ServiceAccount, and the job renders suspended only with a prepare to release it
    job = h.one(docs, kind)
    assert suspended(job)
    own = h.render({**values, "prepare.enabled": False, "config": {"data": {"dataset": "/data/x"}}})
    assert not suspended(h.one(own, kind))
    assert not [r for r in h.by_kind(own, "Role") if r["metadata"]["name"] == "pretrain-prepare"]


def test_a_share_that_failed_for_good_leaves_the_job_suspended_naming_it(tmp_path):
    """Share 1 of 2 fails with a bad argument: its final marker names it, and the finalizer gives up (exit 4,
    which fails its Job at once) with a PrepareFailed Event and the DataReady condition saying which share."""
    docs = h.render(local_values(**{"prepare.parallelism": 2}))
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        share = h.PreparePod(docs, tmp_path)
        proc = share.run(FAIL="2", JOB_COMPLETION_INDEX="1")
        assert proc.returncode == 2 and "final: true" in proc.stderr
        assert "--shard-count 2 --shard-index 1" in share.calls.read_text()
        fin = finalizer(docs, tmp_path, api, real=True)
        proc = fin.run()
        assert proc.returncode == 4, proc.stderr
        assert "share 1 of 2 failed for good: exit 2" in proc.stderr
        assert suspended(api.job)
        (event,) = [e for e in api.events() if e["reason"] == "PrepareFailed"]
        assert "share 1 of 2 failed for good" in event["message"] and "error: stub failed" in event["message"]
        assert "share 1 of 2" in data_ready(api.job)["message"]
        failed = json.loads((tmp_path / "data" / "fineweb-edu-10bt" / "_FAILED").read_text())
        assert failed["final"] is True and failed["fingerprint"] == fin.fingerprint


def test_the_finalizer_gives_up_when_the_shares_job_failed(tmp_path):
    """Without a marker (the Job's deadline passed, say), the shares' Job Failed condition ends the wait."""
    docs = h.render(local_values(**{"prepare.parallelism": 2}))
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        failed = {
            "type": "Failed",
            "status": "True",
            "reason": "DeadlineExceeded",
            "message": "Job was active longer than specified deadline",
        }
        name = store_prepare_job(api, docs, failed)
        proc = finalizer(docs, tmp_path, api, real=True).run()
        assert proc.returncode == 4, proc.stderr
        assert f"prepare job/{name} failed: DeadlineExceeded" in proc.stderr
        assert suspended(api.job)
        assert "DeadlineExceeded" in data_ready(api.job)["message"]


def test_the_finalizer_gives_up_when_the_shares_job_completed_without_them(tmp_path):
    """The shares' Job is Complete (its pods exited 0) but no share left its state, or the Job is gone: the
    finalizer gives up after its grace, as the trainer's wait step does, instead of waiting for ever with
    the job suspended and its condition saying "Preparing"."""
    docs = h.render(local_values(**{"prepare.parallelism": 2}))
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        name = store_prepare_job(api, docs, COMPLETE)
        proc = finalizer(docs, tmp_path, api, *QUICK, real=True).run(timeout=60)
        assert proc.returncode == 4, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith(f"prepare: prepare job/{name} completed but shares 0 (not started), 1 (not")
        assert "delete the prepare Jobs and run them again" in line
        assert suspended(api.job)
        (event,) = [e for e in api.events() if e["reason"] == "PrepareFailed"]
        assert f"prepare job/{name} completed but shares 0" in event["message"]
        assert (data_ready(api.job)["status"], data_ready(api.job)["reason"]) == ("False", "PrepareFailed")
    with h.JobApi(docs, tmp_path) as api:  # no such Job: deleted
        proc = finalizer(docs, tmp_path, api, *QUICK, real=True).run(timeout=60)
        assert proc.returncode == 4 and f"prepare job/{name} does not exist" in proc.stderr
        assert [e["reason"] for e in api.events()] == ["PrepareFailed"]


@pytest.mark.slow
def test_shares_made_for_an_input_that_changed_end_the_finalizers_wait(tmp_path):
    """The review's reproduction: both shares finish, then an input file changes on the volume (or an hf://
    revision moves between pods), and the shares' Job is Complete: the finalizer names the shares made for
    other inputs and gives up, leaving the job suspended with the reason."""
    docs = h.render(local_values(**{"prepare.parallelism": 2}))
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        share = h.PreparePod(docs, tmp_path, real=True)
        for i in range(2):
            proc = share.run(JOB_COMPLETION_INDEX=str(i))
            assert proc.returncode == 0, proc.stderr
        with open(tmp_path / "data" / "raw" / "part-2.txt", "a") as f:
            f.write("one more line\n")
        store_prepare_job(api, docs, COMPLETE)
        proc = finalizer(docs, tmp_path, api, *QUICK, real=True).run(timeout=60)
        assert proc.returncode == 4, proc.stderr
        assert "made for other inputs or settings" in proc.stderr and "an input changed" in proc.stderr
        assert suspended(api.job) and data_ready(api.job)["reason"] == "PrepareFailed"


def test_a_one_pod_prepare_that_completed_without_its_marker_is_reported(tmp_path):
    docs = h.render(local_values())
    with h.JobApi(docs, tmp_path) as api:
        name = store_prepare_job(api, docs, COMPLETE)
        proc = finalizer(docs, tmp_path, api, *QUICK).run(timeout=60)
        assert proc.returncode == 4, proc.stderr
        assert f"prepare job/{name} completed but " in proc.stderr and "/_READY" in proc.stderr
        assert data_ready(api.job)["reason"] == "PrepareFailed" and suspended(api.job)


def test_a_one_pod_prepare_with_a_bad_argument_is_reported_with_its_line(tmp_path):
    """`pretrain prepare` refuses an argument (exit 2, one line): its pod, which has no API, leaves the final
    marker; the finalizer reads it and posts that line as the PrepareFailed Event and the condition."""
    docs = h.render(local_values(**{"prepare.extraArgs": ["--no-such-flag"]}))
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        proc = h.PreparePod(docs, tmp_path, real=True).run()
        assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr
        proc = finalizer(docs, tmp_path, api).run()
        assert proc.returncode == 4, proc.stderr
        (event,) = [e for e in api.events() if e["reason"] == "PrepareFailed"]
        assert "`pretrain prepare` failed for good: exit 2" in event["message"]
        assert "unrecognized arguments: --no-such-flag" in event["message"]
        assert "--no-such-flag" in data_ready(api.job)["message"] and suspended(api.job)


def test_the_finalizer_reports_its_own_bad_arguments_and_missing_input_in_one_line(tmp_path):
    """A sharded prepare's finalizer parses the prepare arguments itself: an unknown flag, or an input that
    is not there, is one line (not argparse's usage page), exit 2 (its podFailurePolicy fails it at once),
    and the PrepareFailed Event and condition on the job, which stays suspended."""
    bad_flag = h.render(local_values(**{"prepare.parallelism": 2, "prepare.extraArgs": ["--no-such-flag"]}))
    no_input = h.render(local_values(**{"prepare.parallelism": 2}))  # /data/raw not written
    for docs, what in ((bad_flag, "unrecognized arguments: --no-such-flag"), (no_input, "raw")):
        with h.JobApi(docs, tmp_path) as api:
            proc = finalizer(docs, tmp_path, api, real=True).run(timeout=60)
            assert proc.returncode == 2, proc.stderr
            (line,) = proc.stderr.strip().splitlines()
            assert line.startswith("prepare: ") and what in line and "usage:" not in proc.stderr
            (event,) = [e for e in api.events() if e["reason"] == "PrepareFailed"]
            assert what in event["message"]
            assert data_ready(api.job)["reason"] == "PrepareFailed" and suspended(api.job)


def test_bad_kubernetes_credentials_are_one_line(tmp_path):
    docs = h.render(local_values())
    proc = finalizer(docs, tmp_path, None).run(KUBECONFIG=str(tmp_path / "nonexistent"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (
        f"prepare: cannot load the Kubernetes credentials from {tmp_path / 'nonexistent'}: Invalid kube-config "
        "file. No configuration found."
    )


@pytest.mark.slow
def test_two_share_pods_and_the_finalizer_pod_release_the_job_with_a_one_pod_result(tmp_path):
    """The rendered Indexed Job's two pods at once and the finalizer pod, all real: the joined token stream
    and validation split equal a one-pod prepare's, and the finalizer releases the job."""
    one = tmp_path / "one"
    one.mkdir()
    write_input(one)
    single = h.render(local_values())
    with h.JobApi(single, one) as api:
        proc = h.PreparePod(single, one, kubeconfig=api.kubeconfig, real=True).run()
        assert proc.returncode == 0, proc.stderr
    docs = h.render(local_values(**{"prepare.parallelism": 2}))
    write_input(tmp_path)
    with h.JobApi(docs, tmp_path) as api:
        store_prepare_job(api, docs)  # running: however long the shares take here, the finalizer waits
        fin = finalizer(docs, tmp_path, api, real=True).start()
        share = h.PreparePod(docs, tmp_path, real=True)
        pods = [share.start(JOB_COMPLETION_INDEX=str(i)) for i in range(2)]
        outs = [p.communicate(timeout=300) for p in pods]
        assert [p.returncode for p in pods] == [0, 0], [o[1] for o in outs]
        out, err = fin.communicate(timeout=300)
        assert fin.returncode == 0, err
        assert "joined 2 shares" in out and not suspended(api.job)
    import test_prepare_shares

    test_prepare_shares.assert_same_data(
        tmp_path / "data" / "fineweb-edu-10bt", one / "data" / "fineweb-edu-10bt", same_input=False
    )


def test_the_finalizer_needs_the_api_to_release_the_job_and_the_prepare_pod_refuses_it(tmp_path):
    docs = h.render(local_values())
    proc = finalizer(docs, tmp_path, None).run()
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "prepare: --job PyTorchJob/pretrain: no Kubernetes API here (no service-account token, no kubeconfig) "
        "to release the job when the data is ready"
    )
    # a chart older than this image (its prepare pod released the job): refused in one line, naming the fix
    prep = h.PreparePod(docs, tmp_path)
    split = prep.c["args"].index("--")
    prep.c["args"][split:split] = ["--job", "PyTorchJob/pretrain"]
    proc = prep.run()
    assert proc.returncode == 2 and "renders a finalizer Job" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not prep.calls.exists()
