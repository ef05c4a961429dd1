"""Kubernetes actions against a recorded API contract.

No cluster runs here: a fake API server on 127.0.0.1 (http.server) records the requests the real
`kubernetes` Python client sends, and the tests assert their paths, verbs, content types and bodies; these
are the calls the chart's RBAC must allow (events: create; pytorchjobs: get, patch). Objects put in its
`objects` are served and patched as an API server does (JSON merge patch, the status subresource apart,
resourceVersion conflicts): tests/test_prepare_release.py releases a rendered job through it.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client

from app.budget.kube import KubeActions
from app.budget.metrics import BudgetMetrics
from app.budget.watcher import Watcher
from app.config.budget import BudgetConfig
from app.errors import UserError
from app.files import atomic_write_json

T = 1_700_000_000.0
NS, JOB = "ml", "demo"
# the kubernetes client still calls urllib3's deprecated getheader(s); not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:HTTPResponse.getheader:DeprecationWarning")
JOB_PATH = f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs/{JOB}"
TRAINJOB_PATH = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs/{JOB}"
EVENTS_PATH = f"/api/v1/namespaces/{NS}/events"
WORKLOADS_PATH = f"/apis/kueue.x-k8s.io/v1beta1/namespaces/{NS}/workloads"


class FakeApiServer:
    def __init__(self):
        self.requests: list[dict] = []
        self.deny_events = False
        self.job_labels: dict = {}
        self.workloads: list[dict] = []  # Kueue Workloads in the namespace
        self.workload_uid_label = True  # Kueue versions before the job-uid label: owner references only
        self.objects: dict[str, dict] = {}  # API path -> object: served, and patched by merge patches
        self.conflicts = 0  # answer this many patches that carry a resourceVersion with 409 Conflict first
        self.forbidden: set[str] = set()  # API paths (with /status) that answer 403, as missing RBAC would
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                req = {
                    "method": self.command,
                    "path": self.path,
                    "content_type": self.headers.get("Content-Type", ""),
                    "body": json.loads(raw) if raw else None,
                }
                fake.requests.append(req)
                status, body = fake.answer(req)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PATCH = _handle

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, req: dict) -> tuple[int, dict]:
        path = req["path"].partition("?")[0]
        if path in self.forbidden:
            return 403, {
                "kind": "Status",
                "code": 403,
                "reason": "Forbidden",
                "message": f"{path} is forbidden",
            }
        if path.removesuffix("/status") in self.objects:
            return self._stored(req, path)
        if (
            req["method"] == "POST"
            and re.fullmatch(r"/api/v1/namespaces/[^/]+/events", path)
            and path != EVENTS_PATH
        ):
            return 201, dict(req["body"], metadata={"name": "event-1", "namespace": path.split("/")[4]})
        job = {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": JOB, "namespace": NS, "uid": "uid-42", "labels": self.job_labels},
        }
        path, _, query = req["path"].partition("?")
        if req["method"] == "GET" and path == WORKLOADS_PATH:
            items = self.workloads
            if "labelSelector=" in query:
                want = (
                    query.split("labelSelector=", 1)[1].split("&")[0].replace("%2F", "/").replace("%3D", "=")
                )
                key, _, value = want.partition("=")
                items = [
                    w for w in items if self.workload_uid_label and w["metadata"]["labels"].get(key) == value
                ]
            return 200, {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "WorkloadList", "items": items}
        if req["method"] == "PATCH" and path.startswith(WORKLOADS_PATH + "/"):
            return 200, {"metadata": {"name": path.rsplit("/", 1)[1]}}
        if req["path"] == TRAINJOB_PATH and req["method"] in ("GET", "PATCH"):
            return 200, dict(job, apiVersion="trainer.kubeflow.org/v1alpha1", kind="TrainJob")
        if req["method"] == "GET" and req["path"] == JOB_PATH:
            return 200, job
        if req["method"] == "PATCH" and req["path"] == JOB_PATH:
            return 200, job
        if req["method"] == "POST" and req["path"] == EVENTS_PATH:
            if self.deny_events:
                return 403, {
                    "kind": "Status",
                    "code": 403,
                    "reason": "Forbidden",
                    "message": "events is forbidden",
                }
            return 201, dict(req["body"], metadata={"name": f"{JOB}-budget-abc", "namespace": NS})
        return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}

    def _stored(self, req: dict, path: str) -> tuple[int, dict]:
        """A stored object: GET it; PATCH it with a JSON merge patch (RFC 7386) of its main resource (status
        left alone) or of /status (status only), refused with 409 on a stale resourceVersion."""
        base = path.removesuffix("/status")
        obj = self.objects[base]
        if req["method"] == "GET":
            return 200, obj
        if req["method"] != "PATCH":
            return 405, {"kind": "Status", "code": 405}
        body = copy.deepcopy(req["body"])
        version = (body.get("metadata") or {}).pop("resourceVersion", None)
        if version is not None and (self.conflicts or version != obj["metadata"]["resourceVersion"]):
            self.conflicts = max(0, self.conflicts - 1)
            obj["metadata"]["resourceVersion"] = str(
                int(obj["metadata"]["resourceVersion"]) + 1
            )  # someone else
            return 409, {
                "kind": "Status",
                "code": 409,
                "reason": "Conflict",
                "message": "the object has been modified",
            }
        if path.endswith("/status"):
            body = {"status": body.get("status", {})}
        else:
            body.pop("status", None)
        patched = merge_patch(obj, body)
        patched["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        self.objects[base] = patched
        return 200, patched

    def store(self, obj: dict) -> str:
        """Serve `obj` (a namespaced object of a group API) at its path; returns the path."""
        group_version = obj["apiVersion"]
        plural = {"PyTorchJob": "pytorchjobs", "TrainJob": "trainjobs", "Job": "jobs"}[obj["kind"]]
        meta = obj["metadata"]
        path = f"/apis/{group_version}/namespaces/{meta.get('namespace', NS)}/{plural}/{meta['name']}"
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", "uid-42")
        obj["metadata"].setdefault("resourceVersion", "1")
        self.objects[path] = obj
        return path

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for this server (what $KUBECONFIG names outside a pod)."""
        cluster = {"name": "fake", "cluster": {"server": self.url}}
        context = {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NS}}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": "fake", "user": {"token": "test"}}],
            "contexts": [context],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path

    def calls(self, method: str | None = None) -> list[dict]:
        return [r for r in self.requests if method is None or r["method"] == method]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def merge_patch(target, patch):
    """RFC 7386: objects merge key by key, null deletes, anything else replaces (lists too)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


@pytest.fixture
def api():
    server = FakeApiServer()
    yield server
    server.close()


def actions(api: FakeApiServer) -> KubeActions:
    conf = client.Configuration(host=api.url)
    return KubeActions(NS, JOB, client.ApiClient(conf))


def test_event_on_the_pytorchjob(api):
    assert actions(api).event("BudgetAlert", "budget alert: $80 of $100")
    get, post = api.requests
    assert (get["method"], get["path"]) == ("GET", JOB_PATH)
    assert (post["method"], post["path"]) == ("POST", EVENTS_PATH)
    ev = post["body"]
    assert ev["involvedObject"] == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "name": JOB,
        "namespace": NS,
        "uid": "uid-42",
    }
    assert (
        ev["reason"] == "BudgetAlert"
        and ev["type"] == "Warning"
        and ev["message"] == "budget alert: $80 of $100"
    )
    assert ev["metadata"] == {"generateName": f"{JOB}-budget-", "namespace": NS}
    assert ev["source"] == {"component": "pretrain-budget-watcher"} and ev["count"] == 1
    assert ev["firstTimestamp"].endswith("Z")


def test_suspend_is_a_merge_patch_of_run_policy(api):
    assert actions(api).suspend()
    get, patch = api.requests  # the job's labels first: a job under Kueue is not suspended this way
    assert (get["method"], get["path"]) == ("GET", JOB_PATH)
    assert (patch["method"], patch["path"]) == ("PATCH", JOB_PATH)
    assert patch["content_type"] == "application/merge-patch+json"
    assert patch["body"] == {"spec": {"runPolicy": {"suspend": True}}}


def _workload(name: str, owner_uid: str) -> dict:
    return {
        "metadata": {
            "name": name,
            "labels": {"kueue.x-k8s.io/job-uid": owner_uid},
            "ownerReferences": [{"kind": "PyTorchJob", "name": "x", "uid": owner_uid}],
        }
    }


@pytest.mark.parametrize("uid_label", [True, False], ids=["job-uid-label", "owner-reference"])
def test_under_kueue_the_last_resort_deactivates_the_workload(api, uid_label):
    """Kueue unsuspends an admitted job, so a job with a queue-name label gets its Workload deactivated
    (spec.active: false), which Kueue honours: it evicts the workload and keeps the job suspended."""
    api.job_labels = {"kueue.x-k8s.io/queue-name": "gpu-queue"}
    api.workloads = [
        _workload("pytorchjob-other-1a2b3", "uid-7"),
        _workload("pytorchjob-demo-9f8e7", "uid-42"),
    ]
    api.workload_uid_label = uid_label
    assert actions(api).suspend()
    patches = api.calls("PATCH")
    assert [p["path"] for p in patches] == [f"{WORKLOADS_PATH}/pytorchjob-demo-9f8e7"]
    assert patches[0]["body"] == {"spec": {"active": False}}
    assert patches[0]["content_type"] == "application/merge-patch+json"
    assert not [r for r in api.requests if r["method"] == "PATCH" and r["path"] == JOB_PATH]
    api.workloads = []
    assert actions(api).suspend() is False  # no Workload found: logged, not raised


def test_api_errors_are_logged_not_raised(api, caplog):
    api.deny_events = True
    assert actions(api).event("BudgetAlert", "x") is False
    assert "HTTP 403" in caplog.text
    assert (
        KubeActions(NS, JOB, client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))).suspend()
        is False
    )


def heartbeat(run, now: float, state: str = "running") -> None:
    atomic_write_json(
        run / "status.json",
        {"step": 10, "step_seconds": 1.0, "checkpoint_seconds": 5.0, "state": state, "updated_unix": now},
    )


def test_watcher_events_and_last_resort_suspend(api, tmp_path):
    """$36/h, cap $1: alert at $0.70, graceful at $1 - horizon ($0.21), immediate at $1; the trainer keeps
    heartbeating past the grace period, so the job is suspended, once."""
    c = BudgetConfig(
        cap_usd=1.0,
        poll_seconds=5.0,
        margin_seconds=10.0,
        suspend_grace_seconds=30.0,
        alert_fraction=0.7,
        kube="on",
    )
    metrics = BudgetMetrics()
    w = Watcher(
        c,
        run_dir=tmp_path,
        stop_file=tmp_path / "stop.json",
        static_rate_usd_per_hour=36.0,
        kube=actions(api),
        metrics=metrics,
        now=T,
    )
    reasons = lambda: [r["body"]["reason"] for r in api.calls("POST")]  # noqa: E731
    heartbeat(tmp_path, T)
    w.tick(T + 50)
    assert reasons() == []
    w.tick(T + 72)  # $0.72: alert; + horizon 21 s ($0.21) < $1
    assert reasons() == ["BudgetAlert"]
    w.tick(T + 78)
    assert reasons() == ["BudgetAlert"]  # once
    w.tick(T + 85)  # $0.85 + $0.21 >= $1: graceful
    assert reasons() == ["BudgetAlert", "BudgetGracefulStop"]
    heartbeat(tmp_path, T + 90)  # the trainer ignores it
    w.tick(T + 100)  # $1.00: immediate
    assert reasons()[-1] == "BudgetImmediateStop"
    assert json.loads((tmp_path / "stop.json").read_text())["mode"] == "immediate"
    heartbeat(tmp_path, T + 120)
    w.tick(T + 120)  # within the 30 s grace: no suspend yet
    assert not api.calls("PATCH")
    heartbeat(tmp_path, T + 130)
    w.tick(T + 131)
    (patch,) = api.calls("PATCH")
    assert patch["body"] == {"spec": {"runPolicy": {"suspend": True}}}
    assert reasons()[-1] == "BudgetSuspended"
    w.tick(T + 140)
    assert len(api.calls("PATCH")) == 1
    assert metrics.registry.get_sample_value("pretrain_budget_suspends_total") == 1.0
    assert metrics.registry.get_sample_value("pretrain_budget_stops_total", {"mode": "immediate"}) == 1.0
    w.close(T + 141)


def test_no_suspend_when_the_trainer_is_done(api, tmp_path):
    c = BudgetConfig(
        cap_usd=1.0, poll_seconds=5.0, margin_seconds=10.0, suspend_grace_seconds=30.0, kube="on"
    )
    w = Watcher(
        c,
        run_dir=tmp_path,
        stop_file=tmp_path / "stop.json",
        static_rate_usd_per_hour=36.0,
        kube=actions(api),
        now=T,
    )
    w.tick(T + 100)
    heartbeat(tmp_path, T + 105, state="done")
    w.tick(T + 200)
    assert not api.calls("PATCH")
    w.close(T + 201)


def test_from_config(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("PRETRAIN_JOB_NAME", raising=False)
    assert KubeActions.from_config(BudgetConfig(kube="off")) is None
    assert KubeActions.from_config(BudgetConfig(kube="auto")) is None  # not in a cluster
    with pytest.raises(UserError, match="--job-name"):
        KubeActions.from_config(BudgetConfig(kube="on"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert KubeActions.from_config(BudgetConfig(kube="auto")) is None  # in a cluster but no job name


def test_one_client_loader_whose_bad_credentials_are_one_line(api, tmp_path, monkeypatch):
    """The watcher, the wait step and the prepare's finalizer load the client alike: a kubeconfig (or in a
    pod the service-account token) that does not load is a UserError naming it, never a traceback."""
    from app.budget.kube import api_client

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)
    assert api_client() is None
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "nonexistent"))
    with pytest.raises(UserError, match=f"from {tmp_path / 'nonexistent'}: Invalid kube-config file"):
        api_client()
    cfg = BudgetConfig(kube="on", job_name=JOB, namespace=NS)
    with pytest.raises(UserError, match="^budget.kube=on but cannot load the Kubernetes credentials"):
        KubeActions.from_config(cfg)
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path / "kubeconfig")))
    kube = KubeActions.from_config(cfg)
    assert kube is not None and kube.event("LowMFU", "MFU 12%")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # a pod without its token
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(
        UserError, match="from the service-account token .*: Service token file does not exist"
    ):
        api_client()
    assert KubeActions.from_config(BudgetConfig(kube="auto", job_name=JOB)) is None  # logged, actions off


def test_a_trainjob_gets_its_events_and_is_suspended_through_spec_suspend(api):
    """Kubeflow Trainer v2: the same actions on trainer.kubeflow.org/v1alpha1 TrainJob (spec.suspend)."""
    kube = KubeActions(NS, JOB, client.ApiClient(client.Configuration(host=api.url)), kind="TrainJob")
    assert kube.event("LowMFU", "MFU 12% under train.mfu_floor=0.3")
    get, post = api.requests
    assert (get["method"], get["path"]) == ("GET", TRAINJOB_PATH)
    assert post["body"]["involvedObject"] == {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "name": JOB,
        "namespace": NS,
        "uid": "uid-42",
    }
    assert kube.suspend()
    patch = api.calls("PATCH")[-1]
    assert patch["path"] == TRAINJOB_PATH and patch["body"] == {"spec": {"suspend": True}}
    assert patch["content_type"] == "application/merge-patch+json"


def test_the_job_kind_comes_from_the_config_or_the_environment(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("PRETRAIN_JOB_NAME", JOB)
    monkeypatch.setattr("kubernetes.config.load_incluster_config", lambda: None)
    monkeypatch.delenv("PRETRAIN_JOB_KIND", raising=False)
    assert KubeActions.from_config(BudgetConfig(kube="auto")).kind == "PyTorchJob"
    monkeypatch.setenv("PRETRAIN_JOB_KIND", "TrainJob")
    assert KubeActions.from_config(BudgetConfig(kube="auto")).plural == "trainjobs"
    assert KubeActions.from_config(BudgetConfig(kube="auto", job_kind="PyTorchJob")).kind == "PyTorchJob"
    monkeypatch.setenv("PRETRAIN_JOB_KIND", "MPIJob")
    with pytest.raises(UserError, match="MPIJob"):
        KubeActions.from_config(BudgetConfig(kube="auto"))


@pytest.mark.parametrize("posted", [False, True], ids=["relayed", "already-posted"])
def test_the_watcher_relays_the_trainers_event_once_when_the_trainer_could_not_post_it(api, tmp_path, posted):
    """In the chart's pods the trainer has no API token: its LowMFU stop reaches the job's Events through
    status.json and the watcher; a trainer that posted it itself is not echoed."""
    w = Watcher(
        BudgetConfig(cap_usd=100.0, poll_seconds=5.0, kube="on"),
        run_dir=tmp_path,
        stop_file=tmp_path / "stop.json",
        static_rate_usd_per_hour=1.0,
        kube=actions(api),
        now=T,
    )
    heartbeat(tmp_path, T + 10)
    w.tick(T + 10)
    event = {"reason": "LowMFU", "message": "MFU 12.0% under train.mfu_floor=0.3", "posted": posted}
    atomic_write_json(
        tmp_path / "status.json", {"state": "preempted", "step": 40, "updated_unix": T + 20, "event": event}
    )
    w.tick(T + 20)
    w.tick(T + 25)
    posts = [r["body"] for r in api.calls("POST")]
    assert [(p["reason"], p["message"]) for p in posts] == ([] if posted else [("LowMFU", event["message"])])
    w.close(T + 30)
