#!/usr/bin/env python3
"""`make image-smoke`: build the container image for real and check, in containers with no network,
what a Kubernetes pod relies on. Called by .ci/run after the tests.

1. Installs docker.io and debootstrap from Debian if missing, and starts its own dockerd (no bridge, no
   iptables: the host's networking is never touched; its own socket; stopped on exit). The image
   store lives in .cache/image-smoke/docker, so a second run reuses the base and the layers.
2. Builds a stand-in for the NGC PyTorch base (scripts/ngc_standin.sh: no registry needed) and the
   project image on it with `make image BASE_IMAGE=... DOCKER_BUILD_FLAGS=--network host`.
3. Checks, each container with `--network none`, as uid 1000 on a volume prepared as Kubernetes
   `fsGroup: 1000` prepares one (group 1000, setgid, group-writable):
   - `pretrain --help`, and the image runs as uid 1000;
   - train; the trainer's /metrics and the budget watcher sidecar's /metrics (a second container in
     the trainer's network namespace, like a pod) answer; `docker stop` -> 143 with a checkpoint on
     the volume; a rerun resumes -> 0;
   - the same through `python -m app.launch` with 2 processes (both ranks' files in the checkpoint);
   - `watch --dry-run-budget` passes on the volume and fails (2) on a root-owned one, and `train` on a
     root-owned volume is one line, exit 2.
Prints `image-smoke: N passed, M failed` and exits 1 on any failure. Skips (one line, exit 0) only when
dockerd cannot start on this machine (not root, no kernel support).

Environment: PRETRAIN_SMOKE_DIR (default .cache/image-smoke), DEBIAN_MIRROR, TORCH_SPEC.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = Path(os.environ.get("PRETRAIN_SMOKE_DIR", REPO / ".cache" / "image-smoke")).resolve()
IMAGE = "pretrain:smoke"
UID = FSGROUP = 1000  # the image's user and the chart's podSecurityContext.fsGroup
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
SBIN = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"
# A model whose steps take milliseconds on CPU (tests/conftest.py FAST); every behaviour is tiny's.
FAST = [
    *("--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=4"),
    *("--set", "model.n_kv_head=2", "--set", "model.seq_len=64", "--set", "train.micro_batch_size=8"),
    *("--set", "train.eval_every=0", "--set", "train.log_every=1", "--set", "checkpoint.every_minutes=0"),
    *("--set", "metrics.progress=false"),
]
LONG = ["--max-steps", "100000"]  # stopped by `docker stop` long before


def say(msg: str) -> None:
    print(f"image-smoke: {msg}", flush=True)


def sh(cmd: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# ------------------------------------------------------------------ tools and the daemon


def install_tools() -> None:
    want = {"dockerd": "docker.io", "debootstrap": "debootstrap"}
    missing = [pkg for tool, pkg in want.items() if not shutil.which(tool, path=SBIN)]
    if not missing or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    say(f"installing {' '.join(missing)} from Debian")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh(["apt-get", "update", "-q"], env=env)
    proc = sh(["apt-get", "install", "-y", "-q", *missing], env=env)
    if proc.returncode != 0:
        say(f"apt-get install {' '.join(missing)} failed: {proc.stderr.strip().splitlines()[-1:]}")


class Daemon:
    """Our own dockerd: no bridge, no iptables, its own socket and run dir; only its PID is stopped."""

    def __init__(self) -> None:
        self.run = Path(tempfile.mkdtemp(prefix="pretrain-dockerd."))  # short: socket paths are limited
        self.sock = self.run / "docker.sock"
        self.proc: subprocess.Popen | None = None
        self.docker = [shutil.which("docker") or "docker", "-H", f"unix://{self.sock}"]

    def start(self) -> str | None:
        """None when up, else why it cannot start."""
        dockerd = shutil.which("dockerd", path=SBIN)
        if os.geteuid() != 0:
            return "dockerd needs root"
        if not dockerd:
            return "no dockerd (apt-get install docker.io failed)"
        (SMOKE / "docker").mkdir(parents=True, exist_ok=True)
        cmd = [
            dockerd,
            *("--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false"),
            f"--data-root={SMOKE / 'docker'}",
            f"--exec-root={self.run / 'exec'}",
            f"--pidfile={self.run / 'dockerd.pid'}",
            f"--host=unix://{self.sock}",
        ]
        with open(self.run / "dockerd.log", "w") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if sh([*self.docker, "version"], timeout=30).returncode == 0:
                return None
            time.sleep(1)
        tail = (self.run / "dockerd.log").read_text().strip().splitlines()[-1:] or ["no output"]
        return f"dockerd did not start: {tail[0][:300]}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        netns = self.run / "exec" / "netns" / "default"  # dockerd's bind mount of its own namespace file
        if os.path.ismount(netns):
            sh(["umount", str(netns)], timeout=30)
        shutil.rmtree(self.run, ignore_errors=True)


# ------------------------------------------------------------------ the checks


class Smoke:
    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.work = Path(tempfile.mkdtemp(prefix="run-", dir=SMOKE))
        # a fresh PVC with fsGroup 1000: root-owned, group 1000, setgid so new files keep the group
        self.vol = self.work / "ckpt"
        self.vol.mkdir()
        os.chown(self.vol, 0, FSGROUP)
        self.vol.chmod(0o2775)
        self.rootvol = self.work / "root-owned"  # a PVC without fsGroup: root's, 755
        self.rootvol.mkdir()
        os.chown(self.rootvol, 0, 0)
        self.rootvol.chmod(0o755)
        self.names: list[str] = []

    def docker(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return sh([*self.d.docker, *args], timeout=timeout)

    def check(self, name: str, fn) -> bool:
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # an assertion or a timeout: report it and go on with the next check
            self.failed.append(name)
            say(f"FAIL {name} ({time.monotonic() - t0:.0f} s): {type(e).__name__}: {e}")
            return False
        self.passed.append(name)
        say(f"ok   {name} ({time.monotonic() - t0:.0f} s)")
        return True

    # -------------------------------------------------------------- build

    def build_base(self) -> str:
        script = REPO / "scripts" / "ngc_standin.sh"
        key = hashlib.sha256(script.read_bytes() + TORCH_SPEC.encode()).hexdigest()[:12]
        tag = f"pretrain-smoke/ngc-standin:{key}"
        if self.docker("image", "inspect", tag).returncode == 0:
            say(f"base {tag} is cached")
            return tag
        env = {**os.environ, "DOCKER": " ".join(self.d.docker), "TORCH_SPEC": TORCH_SPEC}
        proc = subprocess.run(["bash", str(script), tag, str(self.work / "standin")], env=env, timeout=1500)
        assert proc.returncode == 0, f"scripts/ngc_standin.sh exited {proc.returncode}"
        old = self.docker("images", "--format", "{{.Repository}}:{{.Tag}}", tag.split(":")[0]).stdout.split()
        for other in set(old) - {tag}:  # earlier versions of the stand-in: 1 GB each
            self.docker("rmi", other)
        return tag

    def build_image(self, base: str) -> None:
        proc = sh(
            [
                "make",
                "--no-print-directory",
                "image",
                f"IMAGE={IMAGE}",
                f"BASE_IMAGE={base}",
                f"DOCKER={' '.join(self.d.docker)}",
                "DOCKER_BUILD_FLAGS=--network host",
            ],
            cwd=REPO,
            timeout=1500,
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    # -------------------------------------------------------------- helpers

    def pod(self, *extra: str) -> list[str]:
        """`docker run` options of a trainer pod: no network, uid 1000 with the fsGroup, the volume."""
        opts = ["--network", "none", "--group-add", str(FSGROUP), "-v", f"{self.vol}:/ckpt"]
        return [*opts, "-e", "PRETRAIN_CACHE=/ckpt/cache", *extra]  # the embedded corpus is built once

    def start(self, name: str, *args: str) -> None:
        self.docker("rm", "-f", name)
        self.names.append(name)
        proc = self.docker("run", "-d", "--name", name, *args)
        assert proc.returncode == 0, proc.stderr

    def logs(self, name: str) -> str:
        proc = self.docker("logs", name)
        return proc.stdout + proc.stderr

    def exit_code(self, name: str) -> int:
        return int(self.docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip())

    def wait_for_steps(self, name: str, run: Path, steps: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = (
                (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
            )
            if sum('"kind": "train"' in r for r in rows) >= steps:
                return
            running = self.docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            assert running == "true", f"{name} exited early:\n{self.logs(name)[-2000:]}"
            time.sleep(0.5)
        raise AssertionError(
            f"{name}: {steps} steps not reached in {timeout:.0f} s:\n{self.logs(name)[-2000:]}"
        )

    def stop_143_with_checkpoint(self, name: str, run: Path, ranks: int) -> int:
        """`docker stop` (SIGTERM to PID 1): exit 143, a finished checkpoint on the volume; its step."""
        self.docker("stop", "-t", "120", name, timeout=200)
        out = self.logs(name)
        assert self.exit_code(name) == 143, f"exit {self.exit_code(name)}, not 143:\n{out[-2000:]}"
        assert "Traceback" not in out, out[-3000:]
        ckpts = sorted((run / "checkpoints").glob("step_*"))
        assert ckpts and (ckpts[-1] / "meta.json").is_file(), f"no checkpoint on the volume: {out[-2000:]}"
        for r in range(ranks):
            assert (ckpts[-1] / f"rng_rank{r}.json").is_file(), f"rank {r}'s file missing in {ckpts[-1]}"
        st = (ckpts[-1] / "meta.json").stat()
        assert (st.st_uid, st.st_gid) == (UID, FSGROUP), f"checkpoint owned {st.st_uid}:{st.st_gid}"
        return int(ckpts[-1].name.split("_")[1])

    def rerun_resumes(self, cmd: list[str], step: int) -> None:
        proc = self.docker("run", "--rm", *cmd, "--max-steps", str(step + 3), timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"rerun exit {proc.returncode}:\n{out[-3000:]}"
        assert "resumed from /ckpt/" in out and f"(step {step}" in out, out[-3000:]
        assert f"stopping at step {step + 3}" in out and "Traceback" not in out, out[-3000:]

    def metrics(self, container: str, port: int) -> str:
        code = f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read().decode())"
        deadline = time.monotonic() + 120
        while True:
            proc = self.docker("exec", container, "python", "-c", code)
            if proc.returncode == 0 or time.monotonic() > deadline:
                assert proc.returncode == 0, f":{port}/metrics did not answer: {proc.stderr[-500:]}"
                return proc.stdout
            time.sleep(1)

    # -------------------------------------------------------------- checks

    def help_and_user(self) -> None:
        proc = self.docker("run", "--rm", "--network", "none", IMAGE)
        assert proc.returncode == 0 and "usage: pretrain" in proc.stdout, proc.stdout + proc.stderr
        for cmd in ("train", "prepare", "watch"):
            assert cmd in proc.stdout
        uid = self.docker("run", "--rm", "--network", "none", "--entrypoint", "id", IMAGE, "-u").stdout
        assert uid.strip() == str(UID), f"runs as uid {uid.strip()}, not {UID}"

    def train_stop_resume(self) -> None:
        run = self.vol / "run1"
        cmd = [*self.pod(), IMAGE, "train", "--out", "/ckpt/run1", *FAST]
        self.start("smoke-train", *cmd, *LONG, "--metrics-port", "9400")
        self.wait_for_steps("smoke-train", run, 3)
        # the budget watcher sidecar: same network namespace (a pod), same volume
        watch = ["watch", "--run-dir", "/ckpt/run1", "--budget-cap-usd", "100", "--price-per-gpu-hour", "2"]
        opts = ["--network", "container:smoke-train", "--group-add", str(FSGROUP), "-v", f"{self.vol}:/ckpt"]
        self.start(
            "smoke-watch", *opts, IMAGE, *watch, "--gpus", "1", "--kube", "off", "--metrics-port", "9401"
        )
        trainer = self.metrics("smoke-train", 9400)
        assert "pretrain_train_loss" in trainer and "pretrain_step " in trainer, trainer[:2000]
        spend = self.metrics("smoke-train", 9401)  # the sidecar's port, seen from the trainer container
        assert "pretrain_budget_spent_usd" in spend and "pretrain_budget_cap_usd 100.0" in spend, spend[:2000]
        step = self.stop_143_with_checkpoint("smoke-train", run, ranks=1)
        self.docker("stop", "-t", "30", "smoke-watch", timeout=60)
        assert self.exit_code("smoke-watch") == 0, self.logs("smoke-watch")[-2000:]
        self.rerun_resumes(cmd, step)

    def launcher_two_processes(self) -> None:
        run = self.vol / "run2"
        launch = [
            "-m",
            "app.launch",
            "--nnodes=1",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "-m",
            "app.train",
        ]
        cmd = [
            *self.pod("--shm-size", "1g", "--entrypoint", "python"),
            IMAGE,
            *launch,
            "--out",
            "/ckpt/run2",
            *FAST,
        ]
        self.start("smoke-launch", *cmd, *LONG)
        self.wait_for_steps("smoke-launch", run, 3)
        step = self.stop_143_with_checkpoint("smoke-launch", run, ranks=2)
        self.rerun_resumes(cmd, step)

    def dry_run_budget(self) -> None:
        watch = [
            "watch",
            "--budget-cap-usd",
            "100",
            "--price-per-gpu-hour",
            "2",
            "--gpus",
            "1",
            "--dry-run-budget",
        ]
        ok = self.docker("run", "--rm", *self.pod(), IMAGE, *watch, "--run-dir", "/ckpt/run1")
        assert ok.returncode == 0 and "writable" in ok.stdout, ok.stdout + ok.stderr
        opts = ["--network", "none", "-v", f"{self.rootvol}:/ckpt"]
        bad = self.docker("run", "--rm", *opts, IMAGE, *watch, "--run-dir", "/ckpt/run")
        assert bad.returncode == 2, (
            f"exit {bad.returncode} on a root-owned run dir:\n{bad.stdout + bad.stderr}"
        )
        assert f"not writable by uid {UID}" in bad.stderr and "fsGroup" in bad.stderr, bad.stderr

    def muon_preset_starts(self) -> None:
        """A preset that trains with torch.optim.Muon (torch >= 2.9: why the base is pinned where it is),
        at toy sizes; the stand-in's torch is the CPU wheel, so the base's own torch is checked by the
        build (app/trainer/features.py) and by tests/test_dockerfile.py."""
        toy = [f"model.{k}" for k in ("d_model=64", "n_head=4", "d_ff=0", "seq_len=64", "vocab_size=0")]
        toy += ["data.vocab_size=2048", "train.batch_tokens=0", "train.micro_batch_size=8"]
        toy += ["train.eval_every=0", "metrics.progress=false", "checkpoint.every_minutes=0"]
        sets = [arg for kv in toy for arg in ("--set", kv)]
        cmd = ["train", "--preset", "looped-546m-fast", "--out", "/ckpt/muon", "--max-steps", "2", *sets]
        proc = self.docker("run", "--rm", *self.pod(), IMAGE, *cmd)
        done = "stopping at step 2: planned end" in proc.stdout  # optim.name=muon: Muon built and stepped
        assert proc.returncode == 0 and done, f"exit {proc.returncode}:\n{proc.stdout + proc.stderr}"

    def root_owned_volume(self) -> None:
        opts = ["--network", "none", "-v", f"{self.rootvol}:/ckpt"]
        proc = self.docker("run", "--rm", *opts, IMAGE, "train", "--out", "/ckpt/run", *FAST)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (
            f"exit {proc.returncode}:\n{proc.stdout + proc.stderr}"
        )
        assert "/ckpt/run" in lines[0] and f"uid {UID}" in lines[0] and "fsGroup" in lines[0], lines[0]
        assert "Traceback" not in proc.stdout + proc.stderr

    def cleanup(self) -> None:
        for name in self.names:
            self.docker("rm", "-f", name)
        self.docker("image", "prune", "-f")  # the previous builds' dangling layers
        shutil.rmtree(self.work, ignore_errors=True)


def main() -> int:
    t0 = time.monotonic()
    SMOKE.mkdir(parents=True, exist_ok=True)
    lock = open(SMOKE / "lock", "w")  # noqa: SIM115 - held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        say(
            f"FAIL: another image-smoke is running on {SMOKE} (its dockerd owns the image store); wait for it"
        )
        return 1
    install_tools()
    daemon = Daemon()
    why = daemon.start()
    if why:
        daemon.stop()
        say(f"SKIP: {why}; the image was not built or checked")
        return 0
    smoke = Smoke(daemon)
    try:
        base: list[str] = []
        built = smoke.check(
            "NGC stand-in base (debootstrap + torch)", lambda: base.append(smoke.build_base())
        )
        built = built and smoke.check("make image on the stand-in", lambda: smoke.build_image(base[0]))
        if built:
            smoke.check("pretrain --help, runs as uid 1000", smoke.help_and_user)
            smoke.check(
                "train on an fsGroup volume, /metrics of trainer and watcher sidecar, docker stop -> 143 "
                "+ checkpoint, rerun resumes -> 0",
                smoke.train_stop_resume,
            )
            smoke.check(
                "app.launch with 2 processes: docker stop -> 143 + both ranks' files, rerun resumes -> 0",
                smoke.launcher_two_processes,
            )
            smoke.check(
                "watch --dry-run-budget: 0 on the volume, 2 on a root-owned one", smoke.dry_run_budget
            )
            smoke.check("train on a root-owned volume: one line, exit 2", smoke.root_owned_volume)
            smoke.check("preset looped-546m-fast (torch.optim.Muon) trains 2 steps", smoke.muon_preset_starts)
    finally:
        with contextlib.suppress(Exception):
            smoke.cleanup()
        daemon.stop()
    say(f"{len(smoke.passed)} passed, {len(smoke.failed)} failed ({time.monotonic() - t0:.0f} s)")
    return 1 if smoke.failed else 0


if __name__ == "__main__":
    sys.exit(main())
