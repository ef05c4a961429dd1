"""Helpers for the Kubernetes packaging tests: a real helm binary, rendering, and schema validation.

The PyTorchJob is validated against the training-operator v1.9 CRD schema, the TrainJob and the
TrainingRuntime against the Kubeflow Trainer v2.3.0 ones, all in tests/fixtures/k8s-schemas/
(upstream source and licence in its README), made strict the way `kubectl apply --validate=strict`
is: unknown fields are errors, not silently pruned.
Core kinds are validated with kubernetes-validate in strict mode.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.procs import Proc

# kubernetes_validate.validate reads and parses its JSON schemas on every call (the definitions file
# alone is megabytes, 15 ms a document); the chart tests validate a thousand documents, so each file is
# parsed once per process. validate() looks the function up at each call and only reads what it returns.
kubernetes_validate.utils.schema_contents = functools.cache(kubernetes_validate.utils.schema_contents)
# libyaml's loader where PyYAML was built with it: the same documents, parsed in C (helm's output is long)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm"
SCHEMAS = REPO / "tests" / "fixtures" / "k8s-schemas"
PYTORCHJOB_CRD = SCHEMAS / "kubeflow.org_pytorchjobs.v1.9.0.yaml"
TRAINER_CRDS = {
    "TrainJob": SCHEMAS / "trainer.kubeflow.org_trainjobs.v2.3.0.yaml",
    "TrainingRuntime": SCHEMAS / "trainer.kubeflow.org_trainingruntimes.v2.3.0.yaml",
}
# The chart's kubeVersion floor (native sidecars) and the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CORE_KINDS = {
    "ConfigMap",
    "PersistentVolumeClaim",
    "Job",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "Service",
    "Pod",
    "PodDisruptionBudget",
    "Deployment",
    "NetworkPolicy",
}


@functools.lru_cache(maxsize=1)
def helm_binary() -> str:
    """helm on PATH, or extracted once into <repo>/bin by scripts/get_helm.py (cached in ~/.cache)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from get_helm import get_helm
    finally:
        sys.path.pop(0)
    return str(get_helm(REPO / "bin"))


class HelmError(Exception):
    pass


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise HelmError(proc.stderr.strip() or proc.stdout.strip())
    return proc


def _set_args(values: dict[str, Any] | None) -> list[str]:
    args: list[str] = []
    for key, value in (values or {}).items():
        if isinstance(value, str):
            args += ["--set-string", f"{key}={value}"]
        else:
            args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def render(
    values: dict[str, Any] | None = None,
    chart: Path = CHART,
    release: str = "pretrain",
    namespace: str = "default",
    api_versions: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """`helm template` with dotted-key values (JSON-typed) and the cluster's extra API versions (what
    `.Capabilities.APIVersions` then holds); returns the parsed objects."""
    apis = [a for v in api_versions for a in ("--api-versions", v)]
    out = helm("template", release, str(chart), "--namespace", namespace, *apis, *_set_args(values)).stdout
    return objects(out)


def objects(manifest: str) -> list[dict[str, Any]]:
    """The objects of a multi-document manifest (helm's output), empty documents left out."""
    return [d for d in yaml.load_all(manifest, Loader=YAML_LOADER) if d]


def render_error(values: dict[str, Any], chart: Path = CHART, release: str = "pretrain") -> str:
    """helm's error message for values that must be refused."""
    proc = helm("template", release, str(chart), *_set_args(values), check=False)
    if proc.returncode == 0:
        raise AssertionError(f"helm accepted {values}")
    return proc.stderr


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def prepare_job(docs: list[dict[str, Any]], role: str = "prepare") -> dict[str, Any]:
    """The prepare Job (role "prepare": the pods that tokenize) or its finalizer (role "finalizer")."""
    (job,) = [d for d in by_kind(docs, "Job") if d["metadata"]["labels"].get("pretrain/prepare-role") == role]
    return job


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _strict(schema: Any) -> Any:
    """Every object schema with properties and no other rule for extra keys refuses unknown keys."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            out.get("type") == "object"
            and "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=1)
def pytorchjob_validator() -> jsonschema.Draft7Validator:
    crd = yaml.load(PYTORCHJOB_CRD.read_text(), Loader=YAML_LOADER)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def validate_pytorchjob(job: dict[str, Any]) -> None:
    errors = sorted(pytorchjob_validator().iter_errors(job), key=lambda e: list(e.absolute_path))
    if errors:
        raise AssertionError(
            "PyTorchJob does not match the v1.9 CRD:\n"
            + "\n".join(f"  {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:20])
        )
    # Pod templates also as Pods of the oldest and newest supported Kubernetes: fields that the
    # CRD (generated from one Kubernetes version) would accept but a 1.29 API server would not.
    for rtype, spec in job["spec"]["pytorchReplicaSpecs"].items():
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{job['metadata']['name']}-{rtype.lower()}-0",
                **spec["template"]["metadata"],
            },
            "spec": spec["template"]["spec"],
        }
        validate_core(pod)


@functools.lru_cache(maxsize=2)
def trainer_validator(kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.load(TRAINER_CRDS[kind].read_text(), Loader=YAML_LOADER)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return jsonschema.Draft7Validator(_strict(copy.deepcopy(version["schema"]["openAPIV3Schema"])))


def validate_trainer_object(doc: dict[str, Any]) -> None:
    """A TrainJob or TrainingRuntime against its Kubeflow Trainer v2.3.0 CRD; a runtime's pod templates
    also as Pods of the oldest and newest supported Kubernetes."""
    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1", doc["apiVersion"]
    errors = sorted(trainer_validator(doc["kind"]).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        raise AssertionError(
            f"{doc['kind']} does not match the v2.3.0 CRD:\n"
            + "\n".join(f"  {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:20])
        )
    for where, meta, spec in runtime_pods(doc):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": where, **meta}, "spec": spec}
        validate_core(pod)


def runtime_pods(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(pod name, metadata, spec) of each replicated Job's pod template of a TrainingRuntime."""
    if doc["kind"] != "TrainingRuntime":
        return []
    out = []
    for rjob in doc["spec"]["template"]["spec"]["replicatedJobs"]:
        tpl = rjob["template"]["spec"]["template"]
        out.append((f"{doc['metadata']['name']}-{rjob['name']}-0-0", tpl["metadata"], tpl["spec"]))
    return out


def validate_core(doc: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(
                f"{doc['kind']}/{doc['metadata'].get('name')} invalid for {version}: {e}"
            ) from e


LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_metadata(meta: dict[str, Any], where: str) -> None:
    """Label syntax and DNS-1123 names (what the API server checks and the schemas do not)."""
    for key, value in (meta.get("labels") or {}).items():
        assert LABEL_KEY.match(key) and len(key.split("/")[-1]) <= 63, f"{where}: bad label key {key!r}"
        assert isinstance(value, str) and len(value) <= 63 and LABEL_VALUE.match(value), (
            f"{where}: bad label value {key}={value!r}"
        )
    for key, value in (meta.get("annotations") or {}).items():
        assert isinstance(value, str), f"{where}: annotation {key} must be a string"
    if "name" in meta:
        assert len(meta["name"]) <= 63 and NAME.match(meta["name"]), f"{where}: bad name {meta['name']!r}"


def validate_all(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        check_metadata(doc["metadata"], f"{doc['kind']}/{doc['metadata'].get('name')}")
        if doc["kind"] == "PyTorchJob":
            for rtype, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                check_metadata(spec["template"]["metadata"], f"PyTorchJob {rtype} template")
        for where, meta, _ in runtime_pods(doc):
            check_metadata(meta, f"TrainingRuntime pod {where}")
        kind = doc["kind"]
        if kind == "PyTorchJob":
            validate_pytorchjob(doc)
        elif kind in TRAINER_CRDS:
            validate_trainer_object(doc)
        elif kind in CORE_KINDS:
            validate_core(doc)
        elif doc["apiVersion"] == "monitoring.coreos.com/v1":
            assert kind in {"PodMonitor", "ServiceMonitor", "PrometheusRule"}, kind
            assert doc["metadata"]["name"] and isinstance(doc["spec"], dict)
        else:
            raise AssertionError(f"unexpected kind {doc['apiVersion']}/{kind}")


def pod_spec(job: dict[str, Any], rtype: str) -> dict[str, Any]:
    return job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]


def container(spec: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    (c,) = [c for c in spec.get("initContainers" if init else "containers", []) if c["name"] == name]
    return c


def env_map(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# ------------------------------------------------------------- pods, QoS, Pod Security Standards


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod the objects would create: PyTorchJob replicas, Jobs, Pods."""
    out = []
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "PyTorchJob":
            for rtype, spec in d["spec"]["pytorchReplicaSpecs"].items():
                out.append((f"{name} {rtype}", spec["template"]["spec"]))
        elif d["kind"] == "TrainingRuntime":
            out += [(f"{name} {where}", spec) for where, _, spec in runtime_pods(d)]
        elif d["kind"] == "Job":
            out.append((name, d["spec"]["template"]["spec"]))
        elif d["kind"] == "Pod":
            out.append((name, d["spec"]))
    return out


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod metadata) matching pod_specs."""
    out = []
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] == "PyTorchJob":
            for rtype, spec in d["spec"]["pytorchReplicaSpecs"].items():
                out.append((f"{name} {rtype}", spec["template"]["metadata"]))
        elif d["kind"] == "TrainingRuntime":
            out += [(f"{name} {where}", meta) for where, meta, _ in runtime_pods(d)]
        elif d["kind"] == "Job":
            out.append((name, d["spec"]["template"]["metadata"]))
        elif d["kind"] == "Pod":
            out.append((name, d["metadata"]))
    return out


_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
}


def quantity(q: Any) -> float:
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, f"not a quantity: {q!r}"
    return float(m.group(1)) * _SUFFIX.get(m.group(2), 1.0)


def qos_class(spec: dict[str, Any]) -> str:
    """The pod's QoS class by the kubelet's rules, init containers (sidecars too) included."""
    containers = spec.get("containers", []) + spec.get("initContainers", [])
    guaranteed, empty = True, True
    for c in containers:
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for r in ("cpu", "memory"):
            if r in limits or r in requests:
                empty = False
            if r not in limits or quantity(requests.get(r, limits[r])) != quantity(limits[r]):
                guaranteed = False
    return "BestEffort" if empty else "Guaranteed" if guaranteed else "Burstable"


BASELINE_CAPS = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def psa_violations(spec: dict[str, Any], level: str) -> list[str]:
    """What the Pod Security Standard `level` (baseline or restricted) refuses in a pod spec (the checks
    that can apply to this chart's pods)."""
    bad: list[str] = []
    psc = spec.get("securityContext") or {}
    containers = spec.get("containers", []) + spec.get("initContainers", [])
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(key)
    for v in spec.get("volumes", []):
        if "hostPath" in v:
            bad.append(f"hostPath volume {v['name']}")
        if level == "restricted" and not set(v) - {"name"} <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']} of type {sorted(set(v) - {'name'})}")
    for c in containers:
        sc = c.get("securityContext") or {}
        caps = sc.get("capabilities") or {}
        added = set(caps.get("add") or [])
        if sc.get("privileged"):
            bad.append(f"{c['name']}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{c['name']}: hostPort")
        if added - BASELINE_CAPS:
            bad.append(f"{c['name']}: capabilities {sorted(added - BASELINE_CAPS)} beyond baseline")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp == "Unconfined":
            bad.append(f"{c['name']}: seccomp Unconfined")
        if level != "restricted":
            continue
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{c['name']}: allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            bad.append(f"{c['name']}: runAsNonRoot not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{c['name']}: runAsUser 0")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{c['name']}: seccompProfile {seccomp!r}")
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{c['name']}: capabilities do not drop ALL")
        if added - {"NET_BIND_SERVICE"}:
            bad.append(f"{c['name']}: adds capabilities {sorted(added)}")
    return bad


# ------------------------------------------------------------- a fake API server for `lookup`


class FakeCluster:
    """Enough of a Kubernetes API on 127.0.0.1 for `helm template --dry-run=server` (discovery, and GET of
    the objects in `objects`, keyed by API path): what the chart's `lookup` sees on a real upgrade."""

    GROUPS = {
        "v1": ["configmaps", "serviceaccounts", "persistentvolumeclaims", "services", "pods", "events"],
        "rbac.authorization.k8s.io/v1": ["roles", "rolebindings"],
        "batch/v1": ["jobs"],
        "policy/v1": ["poddisruptionbudgets"],
        "networking.k8s.io/v1": ["networkpolicies"],
        "kubeflow.org/v1": ["pytorchjobs"],
        "monitoring.coreos.com/v1": ["podmonitors", "servicemonitors", "prometheusrules"],
    }
    KINDS = {
        "configmaps": "ConfigMap",
        "serviceaccounts": "ServiceAccount",
        "persistentvolumeclaims": "PersistentVolumeClaim",
        "services": "Service",
        "pods": "Pod",
        "events": "Event",
        "roles": "Role",
        "rolebindings": "RoleBinding",
        "jobs": "Job",
        "poddisruptionbudgets": "PodDisruptionBudget",
        "networkpolicies": "NetworkPolicy",
        "pytorchjobs": "PyTorchJob",
        "podmonitors": "PodMonitor",
        "servicemonitors": "ServiceMonitor",
        "prometheusrules": "PrometheusRule",
    }

    def __init__(self, tmp: Path):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.objects: dict[str, dict] = {}
        self.requests: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?")[0]
                fake.requests.append(path)
                status, body = fake.answer(path)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "c", "cluster": {"server": f"http://127.0.0.1:{self.server.server_port}"}}
                    ],
                    "users": [{"name": "u", "user": {"token": "test"}}],
                    "contexts": [
                        {"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "default"}}
                    ],
                    "current-context": "c",
                }
            )
        )

    def answer(self, path: str) -> tuple[int, dict]:
        if path in self.objects:
            return 200, self.objects[path]
        if path == "/version":
            return 200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            groups = [
                {
                    "name": gv.split("/")[0],
                    "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                    "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]},
                }
                for gv in self.GROUPS
                if "/" in gv
            ]
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        gv = path.removeprefix("/apis/").removeprefix("/api/") if path != "/api/v1" else "v1"
        if gv in self.GROUPS:
            resources = [
                {
                    "name": r,
                    "singularName": self.KINDS[r].lower(),
                    "namespaced": True,
                    "kind": self.KINDS[r],
                    "verbs": ["get", "list", "create", "update", "patch", "delete"],
                }
                for r in self.GROUPS[gv]
            ]
            return 200, {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": gv,
                "resources": resources,
            }
        return 404, {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "NotFound",
            "code": 404,
        }

    def render(self, values: dict[str, Any] | None = None, *extra: str) -> subprocess.CompletedProcess:
        """`helm template --dry-run=server` against this API: templates' `lookup` calls reach it."""
        cmd = [helm_binary(), "template", "pretrain", str(CHART), "--namespace", "default", *extra]
        cmd += ["--dry-run=server", "--disable-openapi-validation", "--kubeconfig", str(self.kubeconfig)]
        return subprocess.run(cmd + _set_args(values), capture_output=True, text=True, timeout=120)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------- the containers' programs, run locally


def local_path(arg: str, root: Path) -> str:
    return (
        arg.replace("/data/", f"{root}/data/")
        .replace("/run/pretrain", f"{root}/run")
        .replace("/ckpt", f"{root}/ckpt")
    )


class PreparePod:
    """A rendered prepare container (`python -m app.data.prepare_job`, role "prepare" or "finalizer") run for
    real with /data under root: with a stand-in `pretrain` that exits $FAIL (its arguments go to calls.txt),
    or with real=True the real one; the Kubernetes API is the one `kubeconfig` names (none: no API, and no
    ~/.kube/config either: HOME is root)."""

    def __init__(
        self,
        docs: list,
        root: Path,
        role: str = "prepare",
        kubeconfig: Path | None = None,
        real: bool = False,
        own: tuple[str, ...] = (),
    ):
        job = prepare_job(docs, role)
        self.job = job
        self.own = list(own)  # more options of the step (before `--`), e.g. a short --missing-grace
        self.c = job["spec"]["template"]["spec"]["containers"][0]
        assert self.c["command"] == ["python", "-m", "app.data.prepare_job"], self.c["command"]
        self.fingerprint = self.c["args"][self.c["args"].index("--fingerprint") + 1]
        self.root = root
        (root / "data").mkdir(exist_ok=True)
        fake_bin = root / "bin"
        fake_bin.mkdir(exist_ok=True)
        self.calls = root / "calls.txt"
        stub = f'#!/bin/sh\necho "$@" >> {self.calls}\n[ "${{FAIL:-0}}" = 0 ] || echo "error: stub failed" >&2\nexit "${{FAIL:-0}}"\n'
        (fake_bin / "pretrain").write_text(stub)
        (fake_bin / "pretrain").chmod(0o755)
        path = f"{Path(sys.executable).parent if real else fake_bin}:{os.environ['PATH']}"
        self.env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG")}
        self.env.update(PATH=path, PYTHONPATH=str(REPO), POD_NAMESPACE="default", HOME=str(root))
        if kubeconfig is not None:
            self.env["KUBECONFIG"] = str(kubeconfig)

    def command(self) -> list[str]:
        args = [local_path(a, self.root) for a in self.c["args"]]
        split = args.index("--")
        return [sys.executable, "-m", "app.data.prepare_job", *args[:split], *self.own, *args[split:]]

    def run(self, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(),
            env={**self.env, **extra},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    def start(self, **extra: str) -> Proc:
        """The pod's command in the background (stdout and stderr apart); stopped at the test's end."""
        return Proc(self.command(), env={**self.env, **extra}, separate_stderr=True)


class JobApi:
    """A fake API server (tests/test_budget_kube.py's) serving the rendered training job, as it is before the
    operator sees it: suspended. `kubeconfig` points the real `kubernetes` client of a prepare pod at it."""

    def __init__(self, docs: list, root: Path, namespace: str = "default"):
        from test_budget_kube import FakeApiServer

        self.server = FakeApiServer()
        (self.rendered,) = [
            {**d, "metadata": {**d["metadata"], "namespace": namespace}}
            for d in docs
            if d["kind"] in ("PyTorchJob", "TrainJob")
        ]
        self.path = self.server.store(self.rendered)
        self.kubeconfig = self.server.kubeconfig(root / "kubeconfig")

    def reset(self) -> None:
        """The job as rendered again (as `helm upgrade` re-creates a deleted one)."""
        self.server.store(self.rendered)

    @property
    def job(self) -> dict:
        return self.server.objects[self.path]

    def events(self) -> list[dict]:
        return [r["body"] for r in self.server.calls("POST") if r["path"].endswith("/events")]

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> JobApi:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def not_prepare(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The objects but the prepare side's ServiceAccount, Role and RoleBinding (those of the trainer remain)."""
    return [
        d
        for d in docs
        if not (
            d["kind"] in ("ServiceAccount", "Role", "RoleBinding")
            and d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "prepare"
        )
    ]
