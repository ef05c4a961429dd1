"""The GPU machine's setup without a GPU: scripts/gpu_setup.py's decisions on nvidia-smi outputs recorded on GPU
machines (tests/fixtures/nvidia-smi: public logs of an R550 driver on an A100, R535 on an A30, R580 on two
H100s, and the line nvidia-smi prints when no driver is loaded) and on what torch reports, and the Makefile's
setup stamp run for real in a copy of the repository with a stand-in python (it records each command and
installs nothing), so that which venv gets rebuilt with which torch is checked without downloading GBs.
The other side of the seam, a real nvidia-smi, driver and CUDA torch, only `make setup-gpu && make gpu-check`
on a GPU machine checks."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SMI = REPO / "tests" / "fixtures" / "nvidia-smi"


def gpu_setup():
    spec = importlib.util.spec_from_file_location("gpu_setup", REPO / "scripts" / "gpu_setup.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def smi(name: str) -> str:
    return (SMI / f"{name}.txt").read_text()


# ---------------------------------------------------------------- the decisions, on recorded inputs


def test_the_driver_header_is_read_from_each_recorded_output():
    g = gpu_setup()
    r550, r535, r580 = (g.parse_smi(smi(n)) for n in ("r550-a100", "r535-a30", "r580-h100"))
    assert (r550.version, r550.cuda, r550.branch, r550.gpus) == (
        "550.54.15",
        (12, 4),
        550,
        ("NVIDIA A100-SXM4-80GB",),
    )
    assert (r535.branch, r535.cuda, r535.gpus) == (535, (12, 2), ("NVIDIA A30",))
    assert (r580.branch, r580.cuda, r580.gpus) == (580, (13, 0), ("NVIDIA H100 80GB HBM3",) * 2)
    assert g.parse_smi(smi("failed")) is None


def test_the_wheel_index_follows_the_driver():
    """PyPI's torch is the CUDA 13 build, which an R550 driver cannot run: setup-gpu picks the CUDA 12 build
    there (CUDA 12.6: the pinned torch has no 12.8 build), CUDA 13 on R580, and whatever CUDA=X.Y asks."""
    g = gpu_setup()
    assert g.choose_index(smi("r550-a100"))[0] == "https://download.pytorch.org/whl/cu126"
    assert g.choose_index(smi("r535-a30"))[0] == "https://download.pytorch.org/whl/cu126"
    assert g.choose_index(smi("r580-h100"))[0] == "https://download.pytorch.org/whl/cu130"
    assert g.choose_index(smi("r550-a100"), "12.8")[0] == "https://download.pytorch.org/whl/cu128"
    url, why = g.choose_index(None)
    assert url is None and "nvidia-smi not found" in why and "make setup" in why
    url, why = g.choose_index(smi("failed"))
    assert url is None and why.startswith("nvidia-smi failed: NVIDIA-SMI has failed")
    old = (
        smi("r535-a30")
        .replace("535.183.01", "470.256.02")
        .replace("CUDA Version: 12.2", "CUDA Version: 11.4")
    )
    url, why = g.choose_index(old)
    assert url is None and "upgrade the NVIDIA driver to R525" in why
    assert g.choose_index(smi("r550-a100"), "twelve")[0] is None


GOOD = {
    "torch": "2.13.0+cu126",
    "torch_cuda": "12.6",
    "cuda_available": True,
    "capability": (8, 0),
    "arch_list": ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
    "compiler": "/usr/bin/gcc",
    "python_h": True,
    "python": "3.11",
}


@pytest.mark.parametrize(
    "recorded,host,line",
    [
        ("r550-a100", GOOD, None),
        (
            "r550-a100",
            {**GOOD, "torch": "2.13.0+cpu", "torch_cuda": None},
            "CPU build of torch (2.13.0+cpu): make setup-gpu",
        ),
        (
            "r550-a100",
            {**GOOD, "torch": "2.13.0+cu130", "torch_cuda": "13.0", "cuda_available": False},
            "driver too old for this wheel (needs R580, found 550; torch 2.13.0+cu130): make setup-gpu CUDA=12.6",
        ),
        ("r580-h100", {**GOOD, "torch_cuda": "13.0", "capability": (9, 0)}, None),
        (
            "r550-a100",
            {**GOOD, "compiler": None},
            "no C compiler for Triton: apt-get install build-essential python3-dev",
        ),
        (
            "r550-a100",
            {**GOOD, "python_h": False},
            "no Python headers for Triton (Python.h of Python 3.11): apt-get install python3-dev",
        ),
        ("r550-a100", {**GOOD, "cuda_available": False}, "sees no CUDA device although nvidia-smi lists 1"),
        ("r580-h100", {**GOOD, "capability": (10, 0)}, "has no kernels for this GPU (sm_100"),
        ("r580-h100", {**GOOD, "capability": (9, 0), "arch_list": ("sm_80", "compute_90")}, None),  # PTX
        ("failed", GOOD, "nvidia-smi failed: NVIDIA-SMI has failed because"),
        (None, GOOD, "no NVIDIA driver here (nvidia-smi not found)"),
        ("r550-a100", {**GOOD, "torch": None}, "torch is not installed in this venv: make setup-gpu"),
    ],
    ids=[
        "ok",
        "cpu-torch",
        "driver-too-old",
        "ok-cuda13",
        "no-compiler",
        "no-headers",
        "no-device",
        "no-kernels",
        "ptx",
        "smi-failed",
        "no-smi",
        "no-torch",
    ],
)
def test_the_first_check_names_what_stops_the_gpu_path_in_one_line(recorded, host, line):
    g = gpu_setup()
    said = g.diagnose(g.Host(smi(recorded) if recorded else None, **host))
    if line is None:
        assert said is None
    else:
        assert said is not None and line in said and "\n" not in said, said


def test_the_check_on_this_machine_is_one_line():
    """This side of the seam, run for real: the machine as it is (no GPU here: exit 2 with its reason; on a
    GPU machine with a CUDA torch, exit 0 and what it found)."""
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_setup.py", "check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 2) and proc.stderr == "", proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("gpu setup: "), proc.stdout
    if shutil.which("nvidia-smi") is None:
        assert proc.returncode == 2 and "nvidia-smi not found" in proc.stdout


# ---------------------------------------------------------------- the Makefile's stamp, for real, in a copy

FAKE_PYTHON = """\
#!{real}
# A stand-in for python3 and for the venv's python: records its arguments, makes a venv of itself,
# "installs" by writing what it was asked for; runs real scripts with the real python.
import os, shutil, sys
from pathlib import Path

args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
if args[:2] == ["-m", "venv"]:
    venv = Path(args[2])
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(sys.argv[0], venv / "bin" / "python")
    (venv / "pyvenv.cfg").write_text("home = stand-in\\n")
    sys.exit(0)
venv = Path(sys.argv[0]).parent.parent
if args[:3] == ["-m", "pip", "install"]:
    torch = [a for a in args if a.startswith("torch")]
    if torch:
        (venv / "torch.txt").write_text(" ".join(args))
    sys.exit(0)
if args[:1] == ["-c"]:  # `import torch`: only after a stand-in install
    sys.exit(0 if (venv / "torch.txt").exists() else 1)
os.execv(os.environ["REAL_PYTHON"], [os.environ["REAL_PYTHON"], *args])
"""


@pytest.fixture()
def checkout(tmp_path):
    """A copy of what `make setup` reads (Makefile, pyproject.toml, the setup script), a stand-in python and
    a bin/ directory for a stand-in nvidia-smi."""
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml", "scripts/gpu_setup.py"):
        shutil.copy(REPO / name, work / name)
    os.utime(work / "pyproject.toml", (1, 1))  # older than any stamp the runs write
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable))
    fake.chmod(0o755)
    (tmp_path / "bin").mkdir()
    return work


def make(work: Path, *args: str, smi_output: str | None = None) -> subprocess.CompletedProcess:
    bin_dir = work.parent / "bin"
    if smi_output is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\ncat '{SMI / smi_output}.txt'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            # as a user's shell runs make, also when the suite itself runs under make (CI): no make[N] prefix
            if k not in ("TORCH_SPEC", "TORCH_INDEX", "EXTRAS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")
        },
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_LOG": str(work.parent / "commands.log"),
        "REAL_PYTHON": sys.executable,
    }
    (work.parent / "commands.log").write_text("")
    return subprocess.run(
        ["make", "--no-print-directory", *args, f"PYTHON={work.parent / 'python3'}"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def log(work: Path) -> str:
    return (work.parent / "commands.log").read_text()


def test_a_changed_torch_spec_rebuilds_the_cpu_venv_and_defaults_keep_what_is_there(checkout):
    venv = checkout / ".venv"
    first = make(checkout, "setup")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "-m pip install -q torch==2.13.0" in log(checkout)  # pip's own indexes: the CPU wheel here
    assert (venv / ".setup-stamp").read_text().strip() == (
        "torch=torch==2.13.0|index=|extras=dev,k8s,serve,eval,tensorboard,mlflow,wandb,fp8"
    )
    assert make(checkout, "-q", "setup").returncode == 0  # up to date: nothing to do
    (venv / "left-by-the-cpu-setup").write_text("")
    # another torch on the command line: the CPU venv is removed and built again with it
    changed = make(checkout, "setup", "TORCH_SPEC=torch==9.9.9")
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert "rebuilding it for 'torch=torch==9.9.9" in changed.stdout
    assert not (venv / "left-by-the-cpu-setup").exists()
    assert "-m pip install -q torch==9.9.9" in log(checkout)
    assert (venv / ".setup-stamp").read_text().startswith("torch=torch==9.9.9|index=|")
    assert make(checkout, "-q", "setup", "TORCH_SPEC=torch==9.9.9").returncode == 0  # the same: kept
    # the defaults do not undo it: `make test` after `make setup-gpu` keeps the CUDA torch
    assert make(checkout, "-q", "setup").returncode == 0
    os.utime(checkout / "pyproject.toml")  # a newer pyproject: the project is reinstalled, torch kept
    again = make(checkout, "setup")
    assert again.returncode == 0 and "rebuilding" not in again.stdout
    assert "torch==" not in log(checkout) and "-e .[dev,k8s," in log(checkout)
    assert (venv / ".setup-stamp").read_text().startswith("torch=torch==9.9.9|")


def test_a_stamp_from_before_the_key_counts_as_the_default_setup(checkout):
    (checkout / ".venv" / "bin").mkdir(parents=True)
    (checkout / ".venv" / "pyvenv.cfg").write_text("")
    (checkout / ".venv" / ".setup-stamp").write_text("")  # the old Makefile's `touch`
    assert make(checkout, "-q", "setup").returncode == 0
    assert make(checkout, "-q", "setup", "TORCH_SPEC=torch").returncode != 0  # given: it must rebuild


def test_setup_gpu_installs_the_build_for_the_driver_over_a_cpu_venv(checkout):
    """R550 driver (nvidia-smi recorded on an A100): the CUDA 12.6 build from PyTorch's index, only the fp8
    extra; the CPU venv is rebuilt; then the first check runs (here on this machine's CPU torch, which it
    names in one line, exit 2)."""
    venv = checkout / ".venv"
    assert make(checkout, "setup").returncode == 0
    (venv / "left-by-the-cpu-setup").write_text("")
    proc = make(checkout, "setup-gpu", smi_output="r550-a100")
    commands = log(checkout)
    assert "--index-url https://download.pytorch.org/whl/cu126 torch==2.13.0" in commands, commands
    assert "-e .[fp8]" in commands and "lm_eval" not in commands
    assert not (venv / "left-by-the-cpu-setup").exists()
    assert (venv / ".setup-stamp").read_text().strip() == (
        "torch=torch==2.13.0|index=https://download.pytorch.org/whl/cu126|extras=fp8"
    )
    assert "setup-gpu: driver 550.54.15 (CUDA 12.4): torch's CUDA 12.6 build" in proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("gpu setup: CPU build of torch"), (
        proc.stdout + proc.stderr
    )
    # CUDA=X.Y chooses the build; the venv built for another index is rebuilt
    proc = make(checkout, "setup-gpu", "CUDA=13.0", smi_output="r550-a100")
    assert (
        "rebuilding it for 'torch=torch==2.13.0|index=https://download.pytorch.org/whl/cu130" in proc.stdout
    )
    assert "--index-url https://download.pytorch.org/whl/cu130 torch==2.13.0" in log(checkout)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_setup_gpu_without_a_driver_says_so_and_touches_nothing(checkout):
    assert make(checkout, "setup").returncode == 0
    stamp = (checkout / ".venv" / ".setup-stamp").read_text()
    proc = make(checkout, "setup-gpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("make:")]
    assert lines == [
        "setup-gpu: no NVIDIA driver here (nvidia-smi not found): setup-gpu is for the GPU machine; make setup on a CPU"
    ]
    assert (checkout / ".venv" / ".setup-stamp").read_text() == stamp
