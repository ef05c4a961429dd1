"""The export after training (export.enabled): an export Job created suspended, which runs `pretrain export
--format hf` (and `pretrain push` when a repo is named), and a wait Job that releases it once the training
job has ended and its pods are gone.

Rendered by the real helm binary for both operators (Training Operator v1 PyTorchJob, Kubeflow Trainer v2
TrainJob) and validated strictly (tests/k8s_helpers.py): the export side's objects with kubernetes-validate
in every render, and once per operator the training job against its Kubeflow CRD schema. The wait pod's program (`python -m app.tools.export_job`, with
the rendered arguments) runs here for real against a fake API server on 127.0.0.1 (tests/test_budget_kube.py's,
which serves the rendered objects and applies merge patches) that also lists pods; every call it makes is
checked against the rendered Role. No cluster runs here: what the kubelet, the Job controller and the
operators do with these objects is read from their documentation (docs/kubernetes.md).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs

import k8s_helpers as h
import pytest
from netpol import Endpoint, allowed, isolated, selects
from test_budget_kube import FakeApiServer

from app.cli import build_parser
from app.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:HTTPResponse.getheader:DeprecationWarning")
SCHEDULERS = ["pytorchjob", "trainjob"]
ON = {"export.enabled": True}
PUSH = {
    **ON,
    "export.push.repo": "my-org/tiny",
    "export.push.tokenSecret.name": "hf-write-token",
    "export.license": "apache-2.0",
}


def render(scheduler: str, values: dict) -> list[dict]:
    """The objects of `helm template` (one render per set of values in this module), the export side's
    validated strictly (the rest of the chart is validated by the other chart tests)."""
    return copy.deepcopy(_render(scheduler, json.dumps(values, sort_keys=True)))


@functools.cache
def _render(scheduler: str, values: str) -> list[dict]:
    docs = h.render({"scheduler": scheduler, **json.loads(values)})
    h.validate_all(
        [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "export"]
    )
    return docs


def refused(values: dict, key: str) -> str:
    """helm's error for values that must be refused, which names `key` (a.b.c, or a/b/c from the schema)."""
    err = h.render_error(values)
    assert key in err or "/" + key.replace(".", "/") in err, err
    return err


def export_jobs(docs: list[dict]) -> dict[str, dict]:
    """The export side's Jobs by role: "export" and (with a training job) "wait"."""
    jobs = [
        d
        for d in h.by_kind(docs, "Job")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "export"
    ]
    return {j["metadata"]["labels"]["pretrain/export-role"]: j for j in jobs}


def pod(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def containers(spec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def training_job(docs: list[dict]) -> dict:
    (job,) = [d for d in docs if d["kind"] in ("PyTorchJob", "TrainJob")]
    return job


def trainer_pod_labels(docs: list[dict]) -> list[dict]:
    return [
        meta["labels"]
        for _, meta in h.pod_templates(docs)
        if meta["labels"].get("app.kubernetes.io/component") == "trainer"
    ]


def selector(text: str) -> dict:
    return {"matchLabels": dict(pair.split("=", 1) for pair in text.split(","))}


def wait_args(job: dict):
    from app.command import Parser
    from app.tools.export_job import add_arguments

    parser = Parser(prog="export_job")
    add_arguments(parser)
    (c,) = pod(job)["containers"]
    assert c["command"] == ["python", "-m", "app.tools.export_job"]
    return parser.parse_args(c["args"])


# ---- rendering ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_off_by_default(scheduler):
    docs = render(scheduler, {})
    assert not [
        d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "export"
    ]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_an_export_job_created_suspended_and_a_wait_job_that_releases_it(scheduler):
    docs = render(scheduler, PUSH)
    h.validate_all([training_job(docs)])  # against its operator's CRD (the export objects: in render())
    jobs = export_jobs(docs)
    assert set(jobs) == {"export", "wait"}
    export, wait = jobs["export"], jobs["wait"]
    assert export["spec"]["suspend"] is True, "no pod (no volume attached) until the wait pod releases it"
    assert "suspend" not in wait["spec"]

    # the wait pod watches this release's training job and its pods, and releases this export Job
    args = wait_args(wait)
    train = training_job(docs)
    assert args.job == f"{train['kind']}/{train['metadata']['name']}"
    assert args.export_job == export["metadata"]["name"] and args.on_failure == "skip"
    trainers = trainer_pod_labels(docs)
    assert trainers and all(selects(selector(args.pods), labels) for labels in trainers)
    others = [meta["labels"] for _, meta in h.pod_templates(docs) if meta["labels"] not in trainers]
    assert others and not any(selects(selector(args.pods), labels) for labels in others)

    # the wait pod: the API token, no volume of the run, no HF token; the export pod: the reverse
    wspec, espec = pod(wait), pod(export)
    assert wspec["automountServiceAccountToken"] is False and espec["automountServiceAccountToken"] is False
    assert [v["name"] for v in wspec["volumes"]] == ["kube-api-access"]
    assert not [v for v in espec["volumes"] if "projected" in v or "secret" in v]
    for c in containers(wspec).values():
        assert "HF_TOKEN" not in h.env_map(c)
    assert wspec["restartPolicy"] == espec["restartPolicy"] == "Never"  # for the podFailurePolicy

    # on the CPU pool: no GPU, no GPU toleration
    for spec in (wspec, espec):
        for c in containers(spec).values():
            assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {}))
        assert not spec.get("tolerations")
    assert h.psa_violations(wspec, "restricted") == []


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_the_export_then_the_push_with_the_token_from_the_secret_alone(scheduler):
    docs = render(scheduler, PUSH)
    spec = pod(export_jobs(docs)["export"])
    cs = containers(spec)
    assert [c["name"] for c in spec["initContainers"]] == ["volume-permissions", "export"]
    assert [c["name"] for c in spec["containers"]] == ["push"]
    export, push = cs["export"], cs["push"]
    out = "/ckpt/pretrain-hf"
    exported = build_parser("export").parse_args(export["args"])
    assert (exported.run_dir, exported.output, exported.format, exported.dtype) == (
        "/ckpt/pretrain",
        out,
        "hf",
        "float32",
    )
    assert exported.license == "apache-2.0" and exported.force
    assert export["args"] == [
        "export",
        "/ckpt/pretrain",
        "--output",
        out,
        "--format",
        "hf",
        "--dtype",
        "float32",
        "--license",
        "apache-2.0",
        "--force",
    ]
    parsed = build_parser("push").parse_args(push["args"])  # the chart speaks the CLI's language
    assert (parsed.dir, parsed.repo, parsed.private, parsed.revision) == (out, "my-org/tiny", True, "main")
    # the token: a secretKeyRef in the push container, nowhere else, never a plain value
    assert h.env_map(push)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-write-token", "key": "token"}}
    for c in cs.values():
        for var in c.get("env", []):
            assert "value" not in var or not var["value"].startswith("hf_")
        if c["name"] != "push":
            assert "HF_TOKEN" not in h.env_map(c)
    # the checkpoint claim of the run: written by the export step, read-only for the push
    (ckpt,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert ckpt["persistentVolumeClaim"] == {"claimName": "pretrain-ckpt"}
    mounts = {name: {m["mountPath"]: m for m in c["volumeMounts"]} for name, c in cs.items()}
    assert not mounts["export"]["/ckpt"].get("readOnly") and mounts["push"]["/ckpt"]["readOnly"] is True
    assert h.psa_violations(spec, "baseline") == []


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_no_repo_no_push_step_and_no_token(scheduler):
    docs = render(
        scheduler, {**ON, "export.push.tokenSecret.name": "hf-write-token", "export.dtype": "bfloat16"}
    )
    spec = pod(export_jobs(docs)["export"])
    assert [c["name"] for c in spec["containers"]] == ["export"]
    assert "push" not in containers(spec)
    assert "HF_TOKEN" not in json.dumps(spec) and "hf-write-token" not in json.dumps(spec)
    (export,) = spec["containers"]
    assert (
        export["args"][export["args"].index("--dtype") + 1] == "bfloat16"
        and "--license" not in export["args"]
    )


def test_scratch_output_mounts_the_checkpoint_claim_read_only():
    """export.keepOnVolume=false: the folder goes to the pod's scratch space, for the push alone, so nothing
    writes to the checkpoint volume: the claim is mounted read-only, and no root step touches it."""
    docs = render("pytorchjob", {**PUSH, "export.keepOnVolume": False})
    spec = pod(export_jobs(docs)["export"])
    (ckpt,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert ckpt["persistentVolumeClaim"] == {"claimName": "pretrain-ckpt", "readOnly": True}
    cs = containers(spec)
    assert set(cs) == {"export", "push"}  # no volume-permissions step
    for c in cs.values():
        (m,) = [m for m in c["volumeMounts"] if m["name"] == "ckpt"]
        assert m["readOnly"] is True
    export, push = cs["export"], cs["push"]
    assert export["args"][export["args"].index("--output") + 1] == push["args"][1] == "/scratch/export"
    assert h.psa_violations(spec, "restricted") == []


def test_a_named_output_an_existing_claim_and_the_cpu_pool_of_the_prepare():
    docs = render(
        "pytorchjob",
        {
            **ON,
            "export.output": "exports/tiny-v1",
            "export.extraArgs": ["--max-shard-size", "2GB"],
            "storage.checkpoints.existingClaim": "team-ckpt",
            "prepare.nodeSelector": {"pool": "cpu"},
            "prepare.tolerations": [
                {"key": "pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
            ],
            "export.format": "report",
        },
    )
    for job in export_jobs(docs).values():
        assert pod(job)["nodeSelector"] == {"pool": "cpu"} and pod(job)["tolerations"][0]["value"] == "cpu"
    spec = pod(export_jobs(docs)["export"])
    (export,) = spec["containers"]
    assert export["args"] == [
        "export",
        "/ckpt/pretrain",
        "--output",
        "/ckpt/exports/tiny-v1",
        "--format",
        "report",
        "--force",
        "--max-shard-size",
        "2GB",
    ]
    (ckpt,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert ckpt["persistentVolumeClaim"]["claimName"] == "team-ckpt"
    own = render(
        "pytorchjob",
        {**ON, "prepare.nodeSelector": {"pool": "cpu"}, "export.nodeSelector": {"pool": "big-cpu"}},
    )
    assert pod(export_jobs(own)["export"])["nodeSelector"] == {"pool": "big-cpu"}


def test_without_a_training_job_the_export_runs_at_once():
    """job.enabled=false: a run already on the volume; nothing to wait for, no API token on the export side."""
    docs = render("pytorchjob", {**ON, "job.enabled": False})
    jobs = export_jobs(docs)
    assert set(jobs) == {"export"} and "suspend" not in jobs["export"]["spec"]
    assert not [r for r in h.by_kind(docs, "Role") if r["metadata"]["name"].endswith("-export")]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_the_role_allows_what_the_wait_pod_calls_and_nothing_more(scheduler):
    docs = render(scheduler, PUSH)
    (role,) = [r for r in h.by_kind(docs, "Role") if r["metadata"]["name"] == "pretrain-export"]
    train = training_job(docs)
    group, plural = (
        ("kubeflow.org", "pytorchjobs")
        if scheduler == "pytorchjob"
        else ("trainer.kubeflow.org", "trainjobs")
    )
    assert role["rules"] == [
        {
            "apiGroups": [group],
            "resources": [plural],
            "resourceNames": [train["metadata"]["name"]],
            "verbs": ["get"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {
            "apiGroups": ["batch"],
            "resources": ["jobs"],
            "resourceNames": [export_jobs(docs)["export"]["metadata"]["name"]],
            "verbs": ["patch"],
        },
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    ]
    (binding,) = [b for b in h.by_kind(docs, "RoleBinding") if b["metadata"]["name"] == "pretrain-export"]
    (sa,) = [s for s in h.by_kind(docs, "ServiceAccount") if s["metadata"]["name"] == "pretrain-export"]
    assert binding["roleRef"]["name"] == "pretrain-export"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pretrain-export", "namespace": "default"}
    ]
    assert sa["automountServiceAccountToken"] is False
    for job in export_jobs(docs).values():
        assert pod(job)["serviceAccountName"] == "pretrain-export"
    # the trainer's and the prepare's Roles do not grow
    assert {r["metadata"]["name"] for r in h.by_kind(docs, "Role")} == {
        "pretrain-watcher",
        "pretrain-prepare",
        "pretrain-export",
    }


def test_jobs_are_named_per_pod_template():
    """A `helm upgrade` that changes the export (a repo named after the run) creates new Jobs rather than
    failing on the immutable template of Jobs that already ran."""
    a, b = export_jobs(render("pytorchjob", ON)), export_jobs(render("pytorchjob", PUSH))
    for role in ("export", "wait"):
        assert a[role]["metadata"]["name"] != b[role]["metadata"]["name"]
        assert len(b[role]["metadata"]["name"]) <= 58  # the pods' names add a suffix
    assert a == export_jobs(h.render({"scheduler": "pytorchjob", **ON}))  # the same on every render
    long = export_jobs(h.render({**ON, "fullnameOverride": "x" * 50}))
    assert all(len(j["metadata"]["name"]) <= 58 for j in long.values())


BAD_REPOS = [
    "tiny",
    "org/",
    "a/b/c",
    "org/ti ny",
    "org/ti--ny",
    "org/ti..ny",
    "org/-tiny",
    "org/tiny.git",
    "org/" + "x" * 97,
]
GOOD_REPOS = ["org/tiny", "Org_1/tiny.v2-final", "o/" + "x" * 96]


@pytest.mark.parametrize("repo", BAD_REPOS + GOOD_REPOS)
def test_the_chart_and_the_push_refuse_the_same_repo_names(repo):
    from app.tools.push import check_repo

    try:
        check_repo(repo)
        push_accepts = True
    except UserError:
        push_accepts = False
    values = {**PUSH, "export.push.repo": repo}
    if push_accepts:
        render("pytorchjob", values)
    else:
        refused(values, "export.push.repo")
    assert push_accepts == (repo in GOOD_REPOS)


@pytest.mark.parametrize(
    "values, message",
    [
        ({**ON, "export.push.repo": "org/tiny"}, "needs export.push.tokenSecret.name"),
        ({**PUSH, "export.format": "report"}, "use export.format=hf"),
        ({**ON, "export.keepOnVolume": False}, "export.keepOnVolume=false"),
        ({**ON, "export.output": "pretrain"}, "inside the run directory"),
        ({**ON, "export.output": "pretrain/hf"}, "inside the run directory"),
        ({**ON, "export.output": "/etc"}, "export.output"),
        ({**ON, "export.output": "../other"}, "export.output"),
        ({**ON, "export.output": "a/../../b"}, "export.output"),
        ({**ON, "export.dtype": "float16"}, "export.dtype"),
        ({**ON, "export.onFailure": "retry"}, "export.onFailure"),
        ({**PUSH, "export.push.tokenSecret.name": "HF Token"}, "tokenSecret"),
        (
            {
                **ON,
                "serviceAccount.create": False,
                "prepare.enabled": False,
                "budget.watcher.kubernetesActions": False,
            },
            "the export's Role would be bound to the namespace's `default` ServiceAccount",
        ),
    ],
)
def test_values_that_cannot_work_are_refused(values, message):
    refused(values, message)


def test_network_policies_isolate_the_export_pods_and_open_only_what_they_call():
    api = {"networkPolicy.egress.apiServer": [{"ipBlock": {"cidr": "10.0.0.5/32"}}]}
    assert "the export's wait pod reads the training job" in h.render_error(
        {
            **PUSH,
            "networkPolicy.restrictEgress": True,
            "budget.watcher.kubernetesActions": False,
            "prepare.enabled": False,
        }
    )
    docs = render("pytorchjob", {**PUSH, "networkPolicy.restrictEgress": True, **api})
    nps = h.by_kind(docs, "NetworkPolicy")
    jobs = export_jobs(docs)
    ends = {
        role: Endpoint("default", job["spec"]["template"]["metadata"]["labels"]) for role, job in jobs.items()
    }
    hub, api_server, dns = (
        Endpoint(ip="18.164.174.17"),
        Endpoint(ip="10.0.0.5"),
        Endpoint("kube-system", {"k8s-app": "kube-dns"}),
    )
    neighbour = Endpoint("default", {"app": "notebook"})
    for end in ends.values():
        assert isolated(nps, end) and isolated(nps, end, "Egress")
        assert not allowed(nps, neighbour, end, 8000)
        assert allowed(nps, end, dns, 53, "UDP")
    assert allowed(nps, ends["export"], hub, 443) and not allowed(nps, ends["export"], api_server, 443)
    assert allowed(nps, ends["wait"], api_server, 443) and not allowed(nps, ends["wait"], hub, 443)
    quiet = render("pytorchjob", {**ON, "networkPolicy.restrictEgress": True, **api})
    ends = {
        r: Endpoint("default", j["spec"]["template"]["metadata"]["labels"])
        for r, j in export_jobs(quiet).items()
    }
    assert not allowed(h.by_kind(quiet, "NetworkPolicy"), ends["export"], hub, 443), "no push: no Hub"


def test_notes_say_what_runs_next(tmp_path):
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run(
        [h.helm_binary(), "install", "pretrain", str(h.CHART), "--dry-run=client", *h._set_args(PUSH)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    manifest = proc.stdout.split("NOTES:", 1)[0].split("MANIFEST:", 1)[1]
    docs = h.objects(manifest)
    jobs = export_jobs(docs)
    export, wait = jobs["export"]["metadata"]["name"], jobs["wait"]["metadata"]["name"]
    assert f"kubectl -n default logs -f job/{wait}" in notes
    assert f"kubectl -n default logs -f job/{export} -c push" in notes
    assert "/ckpt/pretrain-hf" in notes and "my-org/tiny" in notes and "hf-write-token" in notes
    assert (
        f'kubectl -n default patch job {export} --type merge -p \'{{"spec":{{"suspend":false}}}}\'' in notes
    )


def test_lint_strict_with_the_export_on():
    proc = h.helm("lint", "--strict", str(h.CHART), *h._set_args(PUSH), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- the wait pod, run for real against a fake API ----------------------------------------------------


class ExportApi(FakeApiServer):
    """The fake API server of tests/test_budget_kube.py, which also lists pods by label selector."""

    def __init__(self) -> None:
        super().__init__()
        self.pods: list[dict] = []

    def answer(self, req: dict) -> tuple[int, dict]:
        path, _, query = req["path"].partition("?")
        if req["method"] == "GET" and re.fullmatch(r"/api/v1/namespaces/[^/]+/pods", path):
            wanted = selector(parse_qs(query)["labelSelector"][0])
            items = [p for p in self.pods if selects(wanted, p["metadata"]["labels"])]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        return super().answer(req)


def trainer_pod(name: str, labels: dict, phase: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "status": {"phase": phase},
    }


def condition(kind: str, outcome: str) -> dict:
    """The training job's condition when it has ended: the operator's type for success, or Failed."""
    ctype = {"PyTorchJob": "Succeeded", "TrainJob": "Complete"}[kind] if outcome == "succeeded" else "Failed"
    return {
        "type": ctype,
        "status": "True",
        "reason": "JobFailed" if ctype == "Failed" else "JobSucceeded",
        "message": "exit code 1" if ctype == "Failed" else "done",
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    }


class Cluster:
    """The rendered objects in a fake API: the training job (with the conditions a test gives it), the
    export Job, the trainer pods; and the rendered wait container, run for real against it."""

    def __init__(self, docs: list[dict], root: Path) -> None:
        self.docs = docs
        self.api = ExportApi()
        self.train = {
            **training_job(docs),
            "metadata": {**training_job(docs)["metadata"], "namespace": "default"},
        }
        self.job_path = self.api.store(self.train)
        jobs = export_jobs(docs)
        self.export_path = self.api.store(
            {**jobs["export"], "metadata": {**jobs["export"]["metadata"], "namespace": "default"}}
        )
        self.wait = jobs["wait"]
        self.labels = trainer_pod_labels(docs)[0]
        self.kubeconfig = self.api.kubeconfig(root / "kubeconfig")
        self.root = root

    def end(self, outcome: str) -> None:
        self.api.objects[self.job_path]["status"] = {"conditions": [condition(self.train["kind"], outcome)]}

    def command(self, *own: str) -> list[str]:
        (c,) = pod(self.wait)["containers"]
        return [sys.executable, *c["command"][1:], *c["args"], "--poll", "0.05", *own]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")}
        env.update(
            KUBECONFIG=str(self.kubeconfig),
            POD_NAMESPACE="default",
            PYTHONPATH=str(h.REPO),
            HOME=str(self.root),
        )
        return env

    def run(self, *own: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(*own), env=self.env(), capture_output=True, text=True, timeout=120, cwd=h.REPO
        )

    def start(self, *own: str) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(*own),
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=h.REPO,
        )

    @property
    def export_suspended(self) -> bool:
        return self.api.objects[self.export_path]["spec"]["suspend"]

    def calls(self, method: str, path: str) -> int:
        return sum(
            1 for r in self.api.requests if r["method"] == method and r["path"].partition("?")[0] == path
        )

    def events(self) -> list[dict]:
        return [r["body"] for r in self.api.calls("POST") if r["path"].endswith("/events")]

    def close(self) -> None:
        self.api.close()


def within_the_role(docs: list[dict], requests: list[dict]) -> None:
    """Every request the wait pod sent is allowed by the rendered export Role (what the API server's RBAC
    checks: API group, resource, verb, and the name where the rule lists names)."""
    (role,) = [r for r in h.by_kind(docs, "Role") if r["metadata"]["name"] == "pretrain-export"]
    for r in requests:
        path = r["path"].partition("?")[0]
        m = re.fullmatch(r"/(?:api/v1|apis/([^/]+)/[^/]+)/namespaces/[^/]+/([^/]+)(?:/([^/]+))?", path)
        assert m, path
        group, resource, name = m.group(1) or "", m.group(2), m.group(3)
        verb = {"GET": "get" if name else "list", "PATCH": "patch", "POST": "create"}[r["method"]]
        assert any(
            group in rule["apiGroups"]
            and resource in rule["resources"]
            and verb in rule["verbs"]
            and (name is None or "resourceNames" not in rule or name in rule["resourceNames"])
            for rule in role["rules"]
        ), f"{r['method']} {path}: not allowed by the export Role"


@pytest.fixture
def cluster_of(tmp_path):
    made = []

    def make(scheduler: str, values: dict | None = None) -> Cluster:
        c = Cluster(render(scheduler, {**PUSH, **(values or {})}), tmp_path)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_the_wait_releases_the_export_only_when_the_job_ended_and_its_pods_are_gone(cluster_of, scheduler):
    c = cluster_of(scheduler)
    c.api.pods = [
        trainer_pod("trainer-0", c.labels, "Running"),
        trainer_pod("prepare-0", {"app": "other"}, "Running"),
    ]
    proc = c.start()
    try:
        # the run trains: the wait looks again and again and releases nothing
        wait_for(lambda: c.calls("GET", c.job_path) >= 3, "three looks at the training job")
        assert proc.poll() is None and c.export_suspended
        # it ended, but a trainer pod still runs (saving, or being deleted): still nothing
        c.end("succeeded")
        seen = c.calls("GET", "/api/v1/namespaces/default/pods")
        wait_for(lambda: c.calls("GET", "/api/v1/namespaces/default/pods") >= seen + 3, "three pod lists")
        assert proc.poll() is None and c.export_suspended
        # its pods are gone (a pod of something else still runs): released
        c.api.pods[0]["status"]["phase"] = "Succeeded"
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert not c.export_suspended
    (patch,) = [r for r in c.api.calls("PATCH")]
    assert patch["path"] == c.export_path and patch["content_type"] == "application/merge-patch+json"
    assert patch["body"] == {"spec": {"suspend": False}}
    (event,) = c.events()
    assert (event["reason"], event["type"]) == ("ExportStarted", "Normal")
    assert (
        event["involvedObject"]["kind"] == c.train["kind"] and event["involvedObject"]["name"] == "pretrain"
    )
    assert "released job/" in out
    within_the_role(c.docs, c.api.requests)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_failed_run_is_not_exported_and_the_event_says_how_to(cluster_of, scheduler):
    c = cluster_of(scheduler)
    c.end("failed")
    proc = c.run()
    assert proc.returncode == 0, proc.stderr
    assert c.export_suspended and not c.api.calls("PATCH")
    (event,) = c.events()
    assert (event["reason"], event["type"]) == ("ExportSkipped", "Warning")
    export = c.export_path.rsplit("/", 1)[1]
    manual = f'kubectl -n default patch job {export} --type merge -p \'{{"spec":{{"suspend":false}}}}\''
    assert manual in event["message"] and manual in proc.stdout
    assert "exit code 1" in event["message"]  # the job's own reason
    within_the_role(c.docs, c.api.requests)


def test_a_failed_run_is_exported_when_asked(cluster_of):
    c = cluster_of("pytorchjob", {"export.onFailure": "export"})
    c.end("failed")
    proc = c.run()
    assert proc.returncode == 0, proc.stderr
    assert not c.export_suspended
    assert [e["reason"] for e in c.events()] == ["ExportStarted"]


def test_a_training_job_that_never_comes_ends_the_wait_in_one_line(cluster_of):
    c = cluster_of("pytorchjob")
    del c.api.objects[c.job_path]
    proc = c.run("--missing-grace", "0.5")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "PyTorchJob default/pretrain does not exist" in line and "kubectl -n default patch job" in line
    assert c.export_suspended


def test_a_release_the_rbac_refuses_is_one_line_with_the_command_that_does_it(cluster_of):
    c = cluster_of("trainjob")
    c.end("succeeded")
    c.api.forbidden.add(c.export_path)
    proc = c.run()
    assert proc.returncode == 2, proc.stderr  # the Job's podFailurePolicy fails it: retrying cannot help
    (line,) = proc.stderr.strip().splitlines()
    assert "HTTP 403" in line and "kubectl -n default patch job" in line
    assert c.export_suspended


def test_the_push_runs_on_the_folder_the_export_writes(tmp_path):
    """The rendered push container, run for real (`--dry-run` added: no Hub here) with /ckpt on a local
    directory holding an export folder where the rendered export writes it."""
    from test_push import write_export

    spec = pod(export_jobs(render("pytorchjob", PUSH))["export"])
    cs = containers(spec)
    out = cs["export"]["args"][cs["export"]["args"].index("--output") + 1]
    write_export(tmp_path / out.removeprefix("/ckpt/"))
    args = [a.replace("/ckpt/", f"{tmp_path}/") for a in cs["push"]["args"]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", *args, "--dry-run"],
        env={**env, "PYTHONPATH": str(h.REPO), "HF_HOME": str(tmp_path / "hf")},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=h.REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert "my-org/tiny (revision main, private)" in proc.stdout and "model.safetensors" in proc.stdout


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--job", "Deployment/pretrain"], "expected KIND/NAME with KIND one of PyTorchJob, TrainJob"),
        (["--poll", "0"], "--poll must be > 0"),
        ([], "no Kubernetes API here"),
    ],
)
def test_the_wait_refuses_what_it_cannot_use_in_one_line(tmp_path, args, expect):
    """Arguments it cannot use, or no API to ask (no token, no kubeconfig): exit 2, one line, which the
    Job's podFailurePolicy turns into a failed Job at once."""
    (c,) = pod(export_jobs(render("pytorchjob", ON))["wait"])["containers"]
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")}
    proc = subprocess.run(
        [sys.executable, "-m", "app.tools.export_job", *c["args"], *args],
        env={**env, "HOME": str(tmp_path), "PYTHONPATH": str(h.REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=h.REPO,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("export: ") and expect in line, line


@pytest.mark.slow
def test_the_export_pod_on_a_trained_run(tmp_path):
    """The rendered export pod's containers, run in their order with /ckpt on a local directory: the export
    step on a run trained here through the CLI, then the push step on the folder it wrote (`--dry-run`
    added: no Hub here)."""
    from conftest import FAST, cli_env, pretrain

    ckpt = tmp_path / "ckpt"
    pretrain("train", "--out", str(ckpt / "pretrain"), "--max-steps", "3", *FAST, check=True)
    spec = pod(export_jobs(render("pytorchjob", {**PUSH, "export.dtype": "bfloat16"}))["export"])
    cs = containers(spec)
    env = {k: v for k, v in cli_env().items() if not k.startswith("HF_")}
    for name, extra in (("export", []), ("push", ["--dry-run"])):
        args = [a.replace("/ckpt/", f"{ckpt}/") for a in cs[name]["args"]]
        proc = pretrain(*args, *extra, env={**env, "HF_HOME": str(tmp_path / "hf")})
        assert proc.returncode == 0, proc.stderr
    folder = ckpt / "pretrain-hf"
    assert json.loads((folder / "config.json").read_text())["architectures"]
    assert "model.safetensors" in proc.stdout and "my-org/tiny (revision main, private)" in proc.stdout
    # exported again (a retried pod): the same folder, written over
    args = [a.replace("/ckpt/", f"{ckpt}/") for a in cs["export"]["args"]]
    assert pretrain(*args, env=env).returncode == 0
