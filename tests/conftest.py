"""Shared fixtures: the embedded corpus prepared once per session, and helpers that run the real CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# 2 workers per core already keep every core busy, so each process computes on one thread: a second
# thread per torch op only adds OpenMP's spinning, and inductor's pool of compile workers (one per core,
# each importing torch) costs more than it saves. Set before anything imports torch; the workers' own
# tensor work follows it, and every process the tests start inherits it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from tests.procs import LIVE, Proc, Procs  # noqa: E402
from tests.warm import WARM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Prepared data is cached across test sessions in the repo (gitignored); CI starts empty.
CACHE = Path(os.environ.get("PRETRAIN_TEST_CACHE", REPO / ".cache" / "test"))

# A model small enough that a step takes milliseconds on CPU; every behaviour is the same as tiny's.
FAST = [
    "--set",
    "model.n_layer=2",
    "--set",
    "model.d_model=64",
    "--set",
    "model.n_head=4",
    "--set",
    "model.n_kv_head=2",
    "--set",
    "model.seq_len=64",
    "--set",
    "train.micro_batch_size=8",
    "--set",
    "train.eval_every=0",
    "--set",
    "train.log_every=1",
    "--set",
    "checkpoint.every_minutes=0",
    "--set",
    "metrics.progress=false",
]

# tiny on the AdamW recipe (AdamW, cosine, tied head, none of the model switches): the tests whose
# thresholds were set on it (a loss that must fall by a given step, a divergence at a given LR, an exact
# layer count) pin it, so a change of the default recipe does not move what they check
CLASSIC = [
    *("--set", "optim.name=adamw"),
    *("--set", "optim.matrix_lr=0"),
    *("--set", "optim.embedding_lr=0"),
    *("--set", "optim.head_lr=0"),
    *("--set", "model.tie_embeddings=true"),
    *("--set", "model.mlp=swiglu"),
    *("--set", "model.qk_norm=false"),
    *("--set", "model.embed_norm=false"),
    *("--set", "model.zero_init=false"),
    *("--set", "model.logit_softcap=0"),
    *("--set", "model.value_embeds=0"),
    *("--set", "model.x0_skip=false"),
    *("--set", "model.unet_skips=false"),
    *("--set", "schedule.name=cosine"),
    *("--set", "schedule.warmup_steps=30"),
    *("--set", "data.align_to_documents=false"),
]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PRETRAIN_CACHE"] = str(CACHE)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


WARM.env = cli_env()


def pytest_xdist_auto_num_workers(config) -> int | None:
    """`make test` (`-n auto`): 2 workers per core this machine gives the tests, which is its CPU affinity
    capped by a cgroup CPU quota (a container allowed 2 CPUs of a 64-CPU host sees 64 with either of the
    counts xdist uses on its own), and at most one per 2 GiB of memory available. With one worker per
    core, a core stood idle about a seventh of the time while its test waited on processes that wait
    themselves (a lost peer's bound, a clock-bound run, a scrape); with two, none did.
    PYTEST_XDIST_AUTO_NUM_WORKERS still decides if set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = max(1, min(cores, round(int(quota) / int(period))))
    return max(1, min(2 * cores, available_memory() // WORKER_MEMORY))


# what one worker may hold at its peak: its warm process and a run of up to 4 ranks it starts
WORKER_MEMORY = 2 * 2**30


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable), capped by a cgroup memory limit."""
    meminfo = Path("/proc/meminfo").read_text()
    available = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit))
    return available


@pytest.fixture(scope="session", autouse=True)
def embedded_data() -> Path:
    """Prepare the embedded corpus once, so no test pays for it (or races to build it)."""
    from app.data.corpus import embedded_dataset

    os.environ["PRETRAIN_CACHE"] = str(CACHE)
    return embedded_dataset(cache_dir=str(CACHE), log=lambda m: None)


def pretrain(
    *args: str, timeout: float = 300, env: dict | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """Run the real `pretrain` CLI in a process of its own, started warm (tests/warm.py: the imports done
    once per worker; a fresh interpreter where the environment needs one), and return it as subprocess.run
    would; past `timeout` it is ended and the test fails with its output's tail."""
    cmd = [sys.executable, "-m", "app.cli", *args]
    proc = Proc(cmd, env=env or cli_env(), separate_stderr=True).finished(timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"pretrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def pretrain_meanwhile(*args: str, env: dict | None = None) -> Proc:
    """`pretrain ARGS` started in the background, for a run that does not depend on what the test does
    next (a straight reference beside the interrupted run it is compared with): a test runs one process
    at a time, so on 2 cores the other core trains it meanwhile. `.finished()` waits for it and returns
    what `pretrain` returns."""
    return Proc([sys.executable, "-m", "app.cli", *args], env=env or cli_env(), separate_stderr=True)


def torchrun(
    *args: str, nproc: int = 2, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """A real torchrun with `nproc` gloo processes running the trainer: `args` are its flags. A worker
    script (`path.py ARGS`) or another module (`-m MODULE ARGS`) goes first in `args` instead."""
    target = ["-m", "app.train", *args]
    if args and (args[0] == "-m" or str(args[0]).endswith(".py")):
        target = [str(a) for a in args]
    if args and str(args[0]).endswith(".py") and env is None:
        env = cli_env(PYTHONPATH=str(REPO))  # a script outside the repository imports the project
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *target,
    ]
    return Proc(cmd, env=env or cli_env(), separate_stderr=True).finished(timeout)


@pytest.fixture(scope="session", autouse=True)
def _stop_every_process_at_the_end():
    """What a module's fixture started and did not stop ends with the session."""
    yield
    for proc in list(LIVE):
        proc.stop()
    WARM.stop()


@pytest.fixture(autouse=True)
def _stop_what_the_test_started():
    """Every process a test started (tests/procs.py) ends with it, passed or failed: a trainer left
    running would load the machine for the tests after it. A Procs of a module's fixture stops its own
    at the module's end."""
    before = list(LIVE)
    yield
    for proc in [p for p in LIVE if p not in before and p.owner is None]:
        proc.stop()


@pytest.fixture(autouse=True)
def _a_clean_dynamo_cache():
    """Each test compiles in-process from an empty dynamo cache: what earlier tests in the same worker
    compiled (GPT.loss of another model, say) would otherwise count towards dynamo's recompile limit of 8
    per function, and which tests share a worker changes from run to run."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


@pytest.fixture
def procs(tmp_path) -> Procs:
    """Start the project's processes for this test (logs in tmp_path/logs); all are stopped at its end."""
    with Procs(tmp_path / "logs") as started:
        yield started


def spawn_train(*args: str, env: dict | None = None) -> Proc:
    """`pretrain train ARGS` in the background (stopped at the test's end if it is still running)."""
    return Proc([sys.executable, "-m", "app.cli", "train", *args], env=env or cli_env())


def train_rows(run_dir: Path, kind: str = "train") -> list[dict]:
    from app.tools.export import read_rows  # the same reader export uses: lines cut by a kill are skipped

    path = Path(run_dir) / "metrics.jsonl"
    return [r for r in read_rows(path) if r.get("kind") == kind] if path.exists() else []


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """Per-step train loss; a step logged twice (before a kill and after the resume) keeps the last."""
    return {r["step"]: r["loss"] for r in train_rows(run_dir)}


def kill_inside_a_write(procs, run_dir: Path, args: list[str], marks: Path, nth: int) -> None:
    """`pretrain train --out RUN_DIR ARGS`, killed (SIGKILL) inside the checkpoint writer's `nth` file: it
    stops itself there (tests/pause_at.py, marker in `marks`), so the kill lands in the write at the first
    try. Each save writes a model file, then an optimizer file: an even `nth` leaves the model's on disk."""
    env = cli_env(
        PRETRAIN_TEST_PAUSE=f"app.trainer.checkpoint.writer:write_safetensors:{nth}",
        PRETRAIN_TEST_PAUSE_DIR=str(marks),
    )
    proc = procs.python("-m", "tests.pause_at", "app.cli", "train", "--out", str(run_dir), *args, env=env)
    proc.wait_for_file(lambda: list(marks.glob("paused-*")))
    proc.signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


def wait_for_step(run_dir: Path, step: int, proc: Proc, timeout: float = 120) -> None:
    proc.wait_for_step(run_dir, step, timeout)


def full_optimizer_state(info) -> dict | None:
    """A checkpoint's whole optimizer state keyed by parameter name: {"state": {name: {state: value}},
    "param_groups": [...]} (training loads its own shards instead)."""
    from app.trainer.checkpoint import store as ckpt

    if not info.has_optimizer:
        return None
    with ckpt.open_reader(info, "optimizer") as r:
        state: dict = {}
        for name in r.names():
            pname, key = name.split("/", 1)
            state.setdefault(pname, {})[key] = r.full(name)
        for pname, entry in r.scalars.items():
            state.setdefault(pname, {}).update(entry)
        return {"state": state, "param_groups": r.param_groups}
