"""Helpers for the Kubernetes packaging tests: a real helm binary, rendering, and schema validation.

The PyTorchJob is validated against the training-operator v1.9 CRD schema in
tests/fixtures/k8s-schemas/ (upstream source and licence in its README), made strict the way
`kubectl apply --validate=strict` is: unknown fields are errors, not silently pruned.
Core kinds are validated with kubernetes-validate in strict mode.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm"
SCHEMAS = REPO / "tests" / "fixtures" / "k8s-schemas"
PYTORCHJOB_CRD = SCHEMAS / "kubeflow.org_pytorchjobs.v1.9.0.yaml"
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
    "Deployment",
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
) -> list[dict[str, Any]]:
    """`helm template` with dotted-key values (JSON-typed); returns the parsed objects."""
    out = helm("template", release, str(chart), "--namespace", namespace, *_set_args(values)).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def render_error(values: dict[str, Any], chart: Path = CHART) -> str:
    """helm's error message for values that must be refused."""
    proc = helm("template", "pretrain", str(chart), *_set_args(values), check=False)
    if proc.returncode == 0:
        raise AssertionError(f"helm accepted {values}")
    return proc.stderr


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


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
    crd = yaml.safe_load(PYTORCHJOB_CRD.read_text())
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
        kind = doc["kind"]
        if kind == "PyTorchJob":
            validate_pytorchjob(doc)
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
