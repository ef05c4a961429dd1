#!/usr/bin/env python3
"""The GPU machine's setup, decided before any GPU minute is spent: `make setup-gpu` and `make gpu-check`.

    python3 scripts/gpu_setup.py index [--cuda 12.6]   # the PyTorch wheel index for this machine's driver
    .venv/bin/python scripts/gpu_setup.py check         # one line: what stops the GPU path, or what it found

PyPI's torch is built for CUDA 13 (since torch 2.11), which needs an R580 driver; many rented H100/H200
hosts run 535-570 drivers, on which that torch sees no GPU. `index` reads the driver's CUDA version from
nvidia-smi and names the newest CUDA build of the pinned torch that driver runs (a CUDA 12 build runs on any
R525+ driver: CUDA's minor-version compatibility), or the one `--cuda X.Y` asks for. `check` says in one line
(exit 2) what would make the first compiled step fail: no driver, a CPU build of torch, a driver too old for
the installed wheel, a torch that sees no device or has no kernels for it, no C compiler or no Python headers
for Triton (compiled and FP8 runs build Triton's launcher with them). The decisions are pure functions of
what nvidia-smi printed and what torch reports (tests/test_gpu_setup.py feeds them recorded outputs); only
`read_host` touches the machine. Standard library only at import: `index` runs before torch is installed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

INDEX_URL = "https://download.pytorch.org/whl/cu{}"
# The CUDA builds of the pinned torch (the Makefile's TORCH_SPEC, torch 2.13: 12.6 and 13.0; 13.2 is
# experimental), newest first. Update with TORCH_SPEC: a torch minor's builds are in pytorch's RELEASE.md.
CUDA_BUILDS = ("13.0", "12.6")
# The oldest driver branch each CUDA major runs on (CUDA's minor-version compatibility within a major).
DRIVER_FOR_CUDA = {13: 580, 12: 525, 11: 450}


@dataclass(frozen=True)
class Driver:
    """What nvidia-smi's header says: the driver's version and the newest CUDA it runs."""

    version: str  # "550.54.15"
    cuda: tuple[int, int]  # (12, 4)
    gpus: tuple[str, ...]  # the GPU names of its table

    @property
    def branch(self) -> int:
        return int(self.version.split(".")[0])


def parse_smi(text: str) -> Driver | None:
    """nvidia-smi's default output -> Driver, or None when it holds no driver header (it failed)."""
    version = re.search(r"Driver Version:\s*([\d.]+)", text)
    cuda = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", text)
    if not (version and cuda):
        return None
    # the table's first row per GPU: "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:..."
    gpus = re.findall(r"^\|\s+\d+\s+(.+?)\s{2,}(?:On|Off|WDDM|TCC)\s+\|", text, re.MULTILINE)
    return Driver(version.group(1), (int(cuda.group(1)), int(cuda.group(2))), tuple(gpus))


def _version(text: str) -> tuple[int, int]:
    major, minor = (int(x) for x in text.split(".")[:2])
    return major, minor


def cuda_build_for(driver: Driver, builds: tuple[str, ...] = CUDA_BUILDS) -> str | None:
    """The newest CUDA build of torch this driver runs (its CUDA major at most the driver's), or None."""
    for build in builds:
        major, _ = _version(build)
        if major <= driver.cuda[0] and driver.branch >= DRIVER_FOR_CUDA.get(major, 0):
            return build
    return None


def index_for(cuda: str) -> str:
    """ "12.6" -> PyTorch's wheel index for that CUDA build."""
    major, minor = _version(cuda)
    return INDEX_URL.format(f"{major}{minor}")


def choose_index(smi: str | None, requested: str = "") -> tuple[str | None, str]:
    """(the index URL, a line saying why) for `make setup-gpu`; (None, what is wrong) when there is none."""
    if requested:
        if not re.fullmatch(r"\d+\.\d+", requested):
            return None, f"CUDA={requested} is not a CUDA version; give one like CUDA=12.6"
        return index_for(requested), f"CUDA={requested} as asked"
    if smi is None:
        return (
            None,
            "no NVIDIA driver here (nvidia-smi not found): setup-gpu is for the GPU machine; make setup on a CPU",
        )
    driver = parse_smi(smi)
    if driver is None:
        return None, f"nvidia-smi failed: {first_line(smi)}"
    build = cuda_build_for(driver)
    if build is None:
        return None, (
            f"driver {driver.version} runs CUDA {driver.cuda[0]}.{driver.cuda[1]}, older than every CUDA build "
            f"of the pinned torch ({', '.join(CUDA_BUILDS)}): upgrade the NVIDIA driver to R{DRIVER_FOR_CUDA[12]} or newer"
        )
    return index_for(
        build
    ), f"driver {driver.version} (CUDA {driver.cuda[0]}.{driver.cuda[1]}): torch's CUDA {build} build"


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "(no output)")


@dataclass(frozen=True)
class Host:
    """What the first check reads from the machine (read_host) or a test gives it."""

    smi: str | None  # nvidia-smi's output; None: not on PATH
    torch: str | None  # torch.__version__; None: torch does not import
    torch_cuda: str | None = None  # torch.version.cuda; None: a CPU build
    cuda_available: bool = False
    capability: tuple[int, int] | None = None  # of device 0
    arch_list: tuple[str, ...] = ()  # torch.cuda.get_arch_list(): "sm_90", "compute_90"
    compiler: str | None = None  # the C compiler Triton would use
    python_h: bool = True  # Python.h where Triton looks for it
    python: str = "3"


def diagnose(host: Host) -> str | None:
    """The first thing that stops the GPU path, as one line with its fix; None when nothing does."""
    if host.smi is None:
        return "no NVIDIA driver here (nvidia-smi not found): run this on the GPU machine"
    driver = parse_smi(host.smi)
    if driver is None:
        return f"nvidia-smi failed: {first_line(host.smi)}"
    suggestion = cuda_build_for(driver)
    fix = f"make setup-gpu CUDA={suggestion}" if suggestion else "upgrade the NVIDIA driver"
    if host.torch is None:
        return "torch is not installed in this venv: make setup-gpu"
    if host.torch_cuda is None:
        return f"CPU build of torch ({host.torch}): make setup-gpu (it replaces the CPU venv)"
    wheel = _version(host.torch_cuda)
    needs = DRIVER_FOR_CUDA.get(wheel[0], 0)
    if wheel[0] > driver.cuda[0] or driver.branch < needs:
        return f"driver too old for this wheel (needs R{needs}, found {driver.branch}; torch {host.torch}): {fix}"
    if not host.cuda_available:
        return (
            f"torch {host.torch} sees no CUDA device although nvidia-smi lists {len(driver.gpus)}: "
            "check CUDA_VISIBLE_DEVICES and the container's GPU access (docker --gpus all)"
        )
    if host.capability and not runs_on(host.capability, host.arch_list):
        sm = f"sm_{host.capability[0]}{host.capability[1]}"
        return f"torch {host.torch} has no kernels for this GPU ({sm}; it has {', '.join(host.arch_list)}): {fix}"
    if host.compiler is None:
        return "no C compiler for Triton: apt-get install build-essential python3-dev"
    if not host.python_h:
        return f"no Python headers for Triton (Python.h of Python {host.python}): apt-get install python3-dev"
    return None


def runs_on(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """Whether a build with these archs runs on a GPU of this capability: its own sm_XY, or PTX (compute_XY)
    of the same major and an older minor, which the driver compiles."""
    major, minor = capability
    if f"sm_{major}{minor}" in arch_list:
        return True
    ptx = [_arch(a) for a in arch_list if a.startswith("compute_")]
    return any(m == major and n <= minor for m, n in ptx)


def _arch(name: str) -> tuple[int, int]:
    digits = name.split("_")[1]
    return int(digits[:-1]), int(digits[-1])


def describe(host: Host) -> str:
    """The line a passing check prints."""
    driver = parse_smi(host.smi or "")
    gpus = f"{len(driver.gpus)} x {driver.gpus[0]}" if driver and driver.gpus else "GPU"
    sm = f" (sm_{host.capability[0]}{host.capability[1]})" if host.capability else ""
    return (
        f"torch {host.torch} (CUDA {host.torch_cuda}), driver {driver.version if driver else '?'}, "
        f"{gpus}{sm}, Triton's compiler {host.compiler}"
    )


# ---------------------------------------------------------------- the machine (the only impure part)


def read_smi() -> str | None:
    """nvidia-smi's output (its error text when it fails), or None when it is not on PATH."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi did not answer: {e}"
    return proc.stdout if proc.returncode == 0 else (proc.stdout + proc.stderr)


def c_compiler() -> str | None:
    """The compiler Triton builds its launcher with: $CC, else gcc, else clang (triton's build.py)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def read_host(smi: str | None) -> Host:
    include = Path(sysconfig.get_paths()["include"])
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    machine = {"compiler": c_compiler(), "python_h": (include / "Python.h").exists(), "python": python}
    try:
        import torch
    except ImportError:
        return Host(smi, None, **machine)
    available = torch.version.cuda is not None and torch.cuda.is_available()
    return Host(
        smi,
        torch.__version__,
        torch.version.cuda,
        available,
        tuple(torch.cuda.get_device_capability(0)) if available else None,
        tuple(torch.cuda.get_arch_list()) if available else (),
        **machine,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    index = sub.add_parser("index", help="print the PyTorch wheel index for this machine's driver")
    index.add_argument("--cuda", default="", help="a CUDA build to use instead (e.g. 12.6)")
    sub.add_parser("check", help="one line: what stops the GPU path (exit 2), or what was found (exit 0)")
    args = parser.parse_args(argv)
    if args.command == "index":
        url, why = choose_index(read_smi(), args.cuda)
        if url is None:
            print(f"setup-gpu: {why}", file=sys.stderr)
            return 2
        print(f"setup-gpu: {why}: {url}", file=sys.stderr)
        print(url)
        return 0
    host = read_host(read_smi())
    problem = diagnose(host)
    if problem:
        print(f"gpu setup: {problem}")
        return 2
    print(f"gpu setup: ok: {describe(host)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
