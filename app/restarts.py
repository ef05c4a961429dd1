"""The launcher's gate: a retry budget kept in the run dir, and the verdicts of the pod's init steps.

Why: under the PyTorchJob `ExitCode` policy the training-operator (v1) recreates the pod for every code
>= 128, so `runPolicy.backoffLimit` never trips (kubeflow/trainer#2045) and a repeating crash would loop
forever; the launcher counts failures without progress itself. And the init steps cannot fail the job
(the operator reads only the `pytorch` container's code), so they leave a verdict that the launcher
turns into the pod's exit code before torchrun starts.

Detail: docs/kubernetes.md, "What runs in the pods" and "Restarts, retries, cleanup"; docs/contracts.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from app.errors import EXIT_BAD_INPUT as EXIT_NOT_WRITABLE
from app.errors import EXIT_DATA_NOT_READY, EXIT_RETRIES_SPENT
from app.errors import print_stderr as _log
from app.files import atomic_write_json, create_exclusive, read_lock_file
from app.trainer.checkpoint.store import META, list_checkpoints, step_of
from app.trainer.stopping.lease import Staleness, identity, move_aside

# Asked to stop, not failures: SIGINT, SIGTERM, 142 (the run dir's lease held by another trainer too long).
STOP_CODES = (130, 142, 143)
KEEP_ATTEMPTS = 50
LOCK_STALE_SECONDS = 30.0  # the lock is held for one read and one write of a small file


def latest_checkpoint_step(run_dir: Path) -> int:
    """The newest complete checkpoint's step, 0 when there is none. A checkpoint dir appears by an atomic
    rename of a finished temp dir (app/trainer/checkpoint/writer.py), so its meta.json is proof enough."""
    with contextlib.suppress(OSError):
        return next((step_of(p) for p in list_checkpoints(run_dir) if (p / META).exists()), 0)
    return 0


def _say(line: str) -> None:
    """On stderr and as the pod's termination message (`kubectl describe pod`) where the kubelet gave one."""
    _log(line)
    path = Path(os.environ.get("PRETRAIN_TERMINATION_LOG", "/dev/termination-log"))
    with contextlib.suppress(OSError):
        if path.is_file():
            path.write_text(line[:4000] + "\n")


def is_failure(code: int | None) -> bool:
    return code is None or (code >= 128 and code not in STOP_CODES)


class StateLock:
    """Exclusive lock file for one read-modify-write of a node's retry state (see the module doc)."""

    def __init__(self, path: Path, stale_seconds: float = LOCK_STALE_SECONDS, poll_seconds: float = 0.02):
        self.path = Path(path)
        self.stale_seconds, self.poll = stale_seconds, poll_seconds
        self.me = {**identity(), "token": uuid.uuid4().hex}

    def __enter__(self) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staleness = Staleness(self.me, self.stale_seconds)
        while not create_exclusive(self.path, json.dumps({**self.me, "unix": time.time()})):
            held = read_lock_file(self.path)
            if held is None:
                continue  # released between our create and read: try again at once
            why = staleness.why(held)
            if why and move_aside(self.path, held, self.me["token"]):
                _log(
                    f"launch: took over the lock {self.path} of pid {held.get('pid')} on "
                    f"{held.get('host', '?')}: {why}"
                )
                staleness = Staleness(self.me, self.stale_seconds)
                continue
            time.sleep(self.poll)
        return self

    def __exit__(self, *exc: object) -> None:
        held = read_lock_file(self.path)
        if held is not None and held.get("token") == self.me["token"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class RetryBudget:
    def __init__(self, run_dir: Path, max_restarts: int, node_rank: int = 0, epoch: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.max_restarts = max_restarts
        self.epoch = epoch
        self.path = self.run_dir / "restarts" / f"node-{node_rank}.json"
        self.lock = StateLock(self.path.with_name(self.path.name + ".lock"))
        self.state: dict[str, Any] = {}
        self.attempt_id = uuid.uuid4().hex
        self.start_step = 0

    @classmethod
    def from_env(cls) -> RetryBudget | None:
        run_dir = os.environ.get("PRETRAIN_RUN_DIR", "")
        if not run_dir:
            return None
        return cls(
            Path(run_dir),
            int(os.environ.get("PRETRAIN_MAX_RESTARTS", "5")),
            int(os.environ.get("PET_NODE_RANK", "0") or 0),
            os.environ.get("PRETRAIN_RESTARTS_EPOCH", ""),
        )

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("attempts"), list):
            data = {"epoch": self.epoch, "failures": 0, "checkpoint_step": 0, "attempts": []}
        return data

    def _save(self) -> None:
        self.state["attempts"] = self.state["attempts"][-KEEP_ATTEMPTS:]
        atomic_write_json(self.path, self.state, durable=True)

    def _count(self, attempt: dict[str, Any], step_now: int) -> None:
        """Apply the rule to an attempt that has ended (its exit_code set, or None for no record)."""
        st = self.state
        progressed = step_now > int(attempt.get("checkpoint_step", 0))
        attempt["counted"] = is_failure(attempt.get("exit_code")) and not progressed
        if progressed or attempt.get("exit_code") == 0:
            st["failures"] = 0
        if attempt["counted"]:
            st["failures"] = int(st.get("failures", 0)) + 1
        st["checkpoint_step"] = max(step_now, int(st.get("checkpoint_step", 0)))

    def _refusal(self) -> str:
        st = self.state
        codes = [
            "none recorded" if a.get("exit_code") is None else str(a["exit_code"])
            for a in st["attempts"]
            if a.get("counted")
        ][-st["failures"] :]
        return (
            f"launch: {st['failures']} failed attempts in a row without a new checkpoint (exit codes "
            f"{', '.join(codes)}; newest checkpoint step {st['checkpoint_step']}) exceed "
            f"trainer.maxRestarts={self.max_restarts}: exit {EXIT_RETRIES_SPENT} (permanent) so the "
            f"PyTorchJob fails instead of restarting forever (ExitCode retries every code >= 128, "
            f"kubeflow/trainer#2045). Fix the cause (`kubectl logs --previous`), then `helm upgrade` "
            f"(a new revision restarts the count) or delete {self.path.parent}"
        )

    def begin(self) -> str:
        """Record the start of an attempt; returns the refusal line when the budget is spent, else ""."""
        with self.lock:
            self.state = self._load()
            st = self.state
            step = self.start_step = latest_checkpoint_step(self.run_dir)
            if st.get("epoch", "") != self.epoch:  # a new release revision: a new count
                st.update(epoch=self.epoch, failures=0)
            last = st["attempts"][-1] if st["attempts"] else None
            if last is not None and "end_unix" not in last:  # the previous attempt left no record
                last.update(end_unix=0.0, exit_code=None)
                self._count(last, step)
            elif step > int(st.get("checkpoint_step", 0)):
                st.update(failures=0, checkpoint_step=step)
            refusal = self._refusal() if st["failures"] > self.max_restarts else ""
            attempt = {"id": self.attempt_id, "epoch": self.epoch, "start_unix": time.time()}
            attempt.update(checkpoint_step=step, host=socket.gethostname(), pid=os.getpid())
            if refusal:
                attempt.update(refused=True, end_unix=time.time(), exit_code=EXIT_RETRIES_SPENT)
            st["attempts"].append(attempt)
            self._save()
        return refusal

    def end(self, code: int) -> tuple[int, str]:
        """Record the end: (the code to use, EXIT_RETRIES_SPENT once spent; the line why, or ""). Reads the
        file afresh: another launcher on this node rank may have written it since begin()."""
        with self.lock:
            self.state = st = self._load()
            attempt = next((a for a in reversed(st["attempts"]) if a.get("id") == self.attempt_id), None)
            if attempt is None:  # dropped meanwhile (KEEP_ATTEMPTS newer ones, a deleted file)
                attempt = {"id": self.attempt_id, "epoch": self.epoch, "checkpoint_step": self.start_step}
                st["attempts"].append(attempt)
            elif "end_unix" in attempt and attempt.get("counted"):
                # a newer launcher took it for lost ("none recorded") and counted it: replace that guess
                st["failures"] = max(0, int(st.get("failures", 0)) - 1)
            attempt.update(end_unix=time.time(), exit_code=code)
            if attempt.get("epoch", self.epoch) != st.get("epoch", ""):
                attempt["counted"] = False  # a newer release revision counts for itself
            else:
                self._count(attempt, latest_checkpoint_step(self.run_dir))
            line = ""
            if attempt["counted"] and st["failures"] > self.max_restarts:
                line = self._refusal()
                attempt["replaced_by"] = EXIT_RETRIES_SPENT
                code = EXIT_RETRIES_SPENT
            elif attempt["counted"]:
                _log(
                    f"launch: exit {attempt['exit_code']} without a new checkpoint: failure "
                    f"{st['failures']} of {self.max_restarts + 1} allowed in a row ({self.path})"
                )
            self._save()
        return code, line


# (environment variable naming the verdict file, what the launcher says, the code when the file names none)
VERDICTS = (
    ("PRETRAIN_WATCHER_VERDICT", "the budget watcher cannot run", EXIT_NOT_WRITABLE),
    ("PRETRAIN_DATA_VERDICT", "no training data", EXIT_DATA_NOT_READY),
)


def verdict_line() -> tuple[str, int] | None:
    """(the line to end with, the exit code) for the first verdict with a reason an init step left in the
    file named by its variable, or None. Its code is kept when permanent under ExitCode (1-127)."""
    for env, what, default in VERDICTS:
        try:
            verdict = json.loads(Path(os.environ[env]).read_text()) if os.environ.get(env) else None
        except (OSError, ValueError):
            continue
        if not isinstance(verdict, dict) or not verdict.get("reason"):
            continue
        code = verdict.get("code")
        code = code if type(code) is int and 1 <= code <= 127 else default
        if env == "PRETRAIN_DATA_VERDICT" and code != EXIT_DATA_NOT_READY:
            what = "the wait-for-data step failed"
        return f"launch: {what}: {verdict['reason']} -> exit {code} (permanent)", code
    return None


def before_launch() -> tuple[RetryBudget | None, int | None]:
    """(the budget to close after the run, an exit code to end with at once, or None to launch)."""
    found = verdict_line()
    if found:
        _say(found[0])
        return None, found[1]
    budget = RetryBudget.from_env()
    if budget is None:
        return None, None
    try:
        refusal = budget.begin()
    except OSError as e:
        _say(
            f"launch: cannot write {budget.path.parent} as uid {os.getuid()} gid {os.getgid()} "
            f"({e.strerror}): the checkpoint volume is not writable by the trainer. With the chart keep "
            f"volumePermissions.enabled=true (a root init step hands /ckpt to uid 1000), or make the "
            f"volume's root owned by (or group-writable for) gid {os.getgid()}; fsGroup is not applied "
            f"to ReadWriteMany volumes whose CSI driver has fsGroupPolicy ReadWriteOnceWithFSType "
            f"-> exit {EXIT_NOT_WRITABLE}"
        )
        return None, EXIT_NOT_WRITABLE
    if refusal:
        _say(refusal)
        return None, EXIT_RETRIES_SPENT
    return budget, None


def after_launch(budget: RetryBudget | None, code: int) -> int:
    if budget is None:
        return code
    try:
        new, line = budget.end(code)
    except OSError as e:  # the volume went away under us: keep the worker's code
        _log(f"launch: cannot record the attempt in {budget.path}: {e.strerror}")
        return code
    if line:
        _say(line)
    return new


def gated(main, argv: list, on_hard_exit: list | None = None) -> int:
    """main(argv) between before_launch and after_launch: the launcher's entry point in a pod.
    `on_hard_exit` (the launcher's list of hooks run before an os._exit, e.g. SIGTERM while stuck in
    rendezvous) gets the attempt's recording too, so such an exit is not taken for a lost attempt."""
    budget, code = before_launch()
    if code is not None:
        return code
    if on_hard_exit is not None:
        on_hard_exit.append(lambda exit_code: after_launch(budget, exit_code))
    return after_launch(budget, main(argv))
