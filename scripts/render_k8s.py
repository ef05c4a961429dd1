#!/usr/bin/env python3
"""Render the Helm chart with its default values into plain manifests in k8s/ (one file per object).

    python scripts/render_k8s.py [--helm PATH]            # (re)write k8s/*.yaml
    python scripts/render_k8s.py [--helm PATH] --check    # exit 1 if k8s/ differs from a fresh render

For users without Helm: `kubectl apply -f k8s/` (after k8s/PREREQUISITES.md) on a cluster with the
Kubeflow Training Operator v1 (PyTorchJob), `kubectl apply -f k8s/trainjob/` on one with Kubeflow
Trainer v2 (the chart with scheduler=trainjob: TrainingRuntime, then TrainJob). The files are named
`NN-kind-name.yaml` so that kubectl applies them in a sensible order (the TrainingRuntime before the
TrainJob, which the Trainer refuses without it). Other files in k8s/ (such as PREREQUISITES.md) are left
alone.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm"
OUT = ROOT / "k8s"
RELEASE = "pretrain"
NAMESPACE = "default"
HEADER = (
    "# Rendered from the Helm chart in helm/ with its default values{extra} (release {release}, namespace {ns})\n"
    "# by scripts/render_k8s.py (`make k8s`). Do not edit: change the chart and re-render.\n"
)
# subdirectory of the output -> extra `helm template` arguments ("" = the output directory itself)
VARIANTS = {"": [], "trainjob": ["--set", "scheduler=trainjob"]}
ORDER = {
    "Namespace": 0,
    "ServiceAccount": 10,
    "Role": 20,
    "RoleBinding": 21,
    "NetworkPolicy": 25,
    "ConfigMap": 30,
    "PersistentVolumeClaim": 40,
    "Service": 50,
    "Job": 60,
    "PyTorchJob": 70,
    "TrainingRuntime": 70,
    "TrainJob": 75,
    "PodMonitor": 80,
    "ServiceMonitor": 80,
    "PrometheusRule": 80,
}


def find_helm(explicit: str | None) -> str:
    if explicit:
        return explicit
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    sys.path.insert(0, str(ROOT / "scripts"))
    from get_helm import get_helm

    return str(get_helm(ROOT / "bin"))


def render(helm: str, chart: Path = CHART, extra: list[str] | None = None) -> dict[str, str]:
    """file name -> content of every object of `helm template` with the default values (and `extra`)."""
    # No `helm test` hook pods: kubectl would create them as ordinary pods.
    cmd = [helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE, "--skip-tests", *(extra or [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    files: dict[str, str] = {}
    for chunk in re.split(r"^---\s*$", out, flags=re.M):
        body = chunk.strip("\n")
        doc = yaml.safe_load(body) if body.strip() else None
        if not doc:
            continue
        kind, name = doc["kind"], doc["metadata"]["name"]
        fname = f"{ORDER.get(kind, 90):02d}-{kind.lower()}-{name}.yaml"
        if fname in files:
            raise SystemExit(f"render_k8s: two objects map to {fname}")
        note = f" and {' '.join(extra[1::2])}" if extra else ""
        files[fname] = HEADER.format(extra=note, release=RELEASE, ns=NAMESPACE) + body.rstrip() + "\n"
    return files


def check(files: dict[str, str], out: Path) -> list[str]:
    """Differences between a fresh render and the files in `out` (empty = equal)."""
    problems = []
    existing = {p.name for p in out.glob("*.yaml")}
    for name in sorted(existing - files.keys()):
        problems.append(f"{out.name}/{name}: not produced by the chart any more (stale)")
    for name, text in sorted(files.items()):
        path = out / name
        if not path.exists():
            problems.append(f"{out.name}/{name}: missing")
            continue
        old = path.read_text()
        if old != text:
            diff = difflib.unified_diff(
                old.splitlines(), text.splitlines(), f"{out.name}/{name}", "fresh render", lineterm="", n=1
            )
            problems.append("\n".join(list(diff)[:40]))
    return problems


def write(files: dict[str, str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in set(p.name for p in out.glob("*.yaml")) - files.keys():
        (out / stale).unlink()
    for name, text in files.items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--helm", help="helm binary (default: helm on PATH, else bin/helm via scripts/get_helm.py)"
    )
    p.add_argument("--check", action="store_true", help="compare with k8s/ instead of writing")
    p.add_argument("--out", type=Path, default=OUT, help="output directory (default k8s/)")
    p.add_argument("--chart", type=Path, default=CHART, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    helm = find_helm(args.helm)
    renders = {args.out / sub: render(helm, args.chart, extra) for sub, extra in VARIANTS.items()}
    if args.check:
        problems = [line for out, files in renders.items() for line in check(files, out)]
        if problems:
            print("k8s/ is out of date with the chart; run `make k8s`:", file=sys.stderr)
            print("\n".join(problems), file=sys.stderr)
            return 1
        for out, files in renders.items():
            print(f"{out}: {len(files)} manifests equal a fresh render of {args.chart.name}/")
        return 0
    for out, files in renders.items():
        write(files, out)
        print(f"wrote {len(files)} manifests to {out}: {', '.join(sorted(files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
