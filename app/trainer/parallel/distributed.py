"""The processes of a run and how they agree: `agree`, an all-reduce of a small host tensor over gloo (a
control group under NCCL, so a decision never waits for the GPU's queue). `PeerWatch` finds a peer lost
without a signal in bounded time (exit 144), and a rank dies with its launcher (PR_SET_PDEATHSIG): a lost
node costs a retry, not the run. Details: docs/architecture.md ("Processes") and docs/kubernetes.md
("A lost node").
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import app
from app.errors import EXIT_PEER_LOST, RestartSmaller, print_stderr
from app.trainer.stopping.lease import running

_CONTROL_GROUP = None
PULSE_SECONDS = 2.0
LOST_AFTER_SECONDS = 30.0  # far above a live thread's longest pause; a peer not yet seen gets 3x
SUSPECT_AFTER_SECONDS = 6.0
_WATCH = None  # this rank's PeerWatch
RESTART_KEY = "restart-smaller"  # in the watch's store: a rank left to restart at a smaller micro-batch


@dataclass
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node: str = "local"

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        agree([0])

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        return bool(agree([int(flag)], dist.ReduceOp.MIN)[0])


def agree(values: list[int], op=dist.ReduceOp.MAX, group=None) -> list[int]:
    """Collective: the element-wise `op` of `values` over all ranks (the control group by default)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=group or _CONTROL_GROUP)
    return t.tolist()


def init_distributed(device_type: str, timeout_minutes: float = 30.0) -> DistEnv:
    """Read torchrun's environment; join the process group (gloo on CPU, NCCL on CUDA) and, under NCCL,
    the gloo control group. The timeout bounds every collective, so it must exceed the longest wait of
    one rank for another (a checkpoint commit, the step-0 eval): train.collective_timeout_minutes."""
    global _CONTROL_GROUP, _WATCH
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: never `pretrain train`, for one
        end_with_launcher()
    env = DistEnv(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        node=os.environ.get("NODE_NAME") or os.environ.get("HOSTNAME") or "local",
    )
    if world > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and _WATCH is None:
        _WATCH = PeerWatch(env)  # before the process group: a loss during its rendezvous is found too
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        device_id = None
        if backend == "nccl":
            # this rank's GPU first: NCCL binds its communicator to the current device, and with device_id
            # it sets it up now, on that GPU, instead of lazily at the first collective (where a rank
            # still on GPU 0 would put its context, and its peers' traffic, there); NCCL only: CUDA
            # cannot run here, tests/test_fsdp.py checks the order with the calls recorded
            torch.cuda.set_device(env.local_rank)
            device_id = torch.device("cuda", env.local_rank)
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
        _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return env


def shutdown_distributed() -> None:
    global _CONTROL_GROUP
    _CONTROL_GROUP = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a device tensor over ranks (data, not a decision: it goes over the main group)."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def end_with_launcher() -> None:
    """Die with the launcher (SIGKILL when its process ends), also when it is gone already: app.launch names
    itself, torchrun is the process that started this one."""
    launcher = int(os.environ.get("PRETRAIN_LAUNCHER_PID") or app.STARTED_BY)
    with contextlib.suppress(AttributeError, OSError):  # prctl is Linux only
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    # Armed first, checked after: an end between the two is caught by one or the other. A launcher that is
    # not the parent may have a wrapper between (a shell).
    if os.getppid() != launcher and not running(launcher):
        rank = os.environ.get("RANK", "?")
        print_stderr(f"rank {rank}: its launcher (pid {launcher}) ended -> exit {EXIT_PEER_LOST} (retryable)")
        os._exit(EXIT_PEER_LOST)


class PeerWatch:
    """A thread that beats on torchrun's store (kept by node 0's launcher) and watches the next rank's beat (a
    ring: a lost node's first rank is watched from outside), posting a loss for all; a dead store: node 0."""

    def __init__(self, env: DistEnv) -> None:
        self.rank, self.world, self.step, self.suspect = env.rank, env.world_size, 0, False
        self.ended, self.peer_ended, self.answered = threading.Event(), threading.Event(), time.monotonic()
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.store_name = f"node 0 (its launcher keeps the store {addr}:{port})"
        try:  # up before any rank starts: refused means its launcher is gone (before PR_SET_PDEATHSIG was set)
            socket.create_connection((addr, port), timeout=LOST_AFTER_SECONDS).close()
        except OSError as e:
            self._exit(self.store_name, str(e))
        timeout = timedelta(seconds=LOST_AFTER_SECONDS)
        try:  # refused until the timeout: the launcher ended after the check above
            store = dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
        except dist.DistError as e:
            self._exit(self.store_name, str(e).strip().splitlines()[0])
        self.store = dist.PrefixStore(f"peers/{os.environ.get('TORCHELASTIC_RESTART_COUNT')}/", store)
        host = os.environ.get("NODE_NAME") or socket.gethostname()
        self.store.set(f"node/{self.rank}", f"node {os.environ.get('GROUP_RANK', '?')} ({host})")
        self.store.add(f"beat/{self.rank}", 1)  # seen from now on, even if stopped at once
        atexit.register(self.end)
        self.threads = [
            threading.Thread(target=self._watch, name="peer-watch", daemon=True),
            threading.Thread(target=self._deadman, name="peer-watch-store", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def end(self) -> None:  # at exit: this rank ended on purpose, it is not lost (a crash reports itself)
        with contextlib.suppress(Exception):
            self.store.set(f"done/{self.rank}", "1")
        self.ended.set()
        for t in self.threads:  # no store call in flight while the interpreter tears the store down
            t.join(timeout=2 * PULSE_SECONDS)

    def posted(self, key: str) -> str:
        """A value another rank posted for all (or "")."""
        with contextlib.suppress(Exception):
            if self.store.check([key]):
                return self.store.get(key).decode()
        return ""

    def _deadman(self) -> None:
        while not self.ended.wait(PULSE_SECONDS):  # a store call never returns: node 0 vanished silently
            if time.monotonic() - self.answered > LOST_AFTER_SECONDS:
                self._exit(self.store_name, f"its store did not answer for {LOST_AFTER_SECONDS:.0f} s")

    def _watch(self) -> None:
        peer = (self.rank + 1) % self.world
        seen, since = 0, time.monotonic()
        while not self.ended.wait(PULSE_SECONDS):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if self.store.check(["lost"]):
                    self._exit(self.store.get("lost").decode(), "found by another rank")
                beats = self.store.add(f"beat/{peer}", 0)
                if self.store.check([f"done/{peer}"]):
                    self.peer_ended.set()  # on purpose: done, or a crash its own exit code reports
                self.answered = time.monotonic()
            except Exception as e:  # noqa: BLE001 - the store's host is gone
                self._exit(self.store_name, f"{type(e).__name__}: {str(e).strip()[:200]}")
            now = time.monotonic()
            if beats != seen or self.peer_ended.is_set():
                seen, since = beats, now
            limit = SUSPECT_AFTER_SECONDS if self.suspect else LOST_AFTER_SECONDS * (1 if seen else 3)
            if now - since >= limit:
                who = f"rank {peer}"
                with contextlib.suppress(Exception):
                    if self.store.check([f"node/{peer}"]):
                        who += f" on {self.store.get(f'node/{peer}').decode()}"
                    self.store.set("lost", who)
                self._exit(who, f"no heartbeat for {now - since:.0f} s")

    def _exit(self, lost: str, why: str) -> None:
        why = f"{why} -> exit {EXIT_PEER_LOST} (retryable)"
        print_stderr(f"rank {self.rank}: lost {lost} at step {self.step}: {why}")
        os._exit(EXIT_PEER_LOST)


def at_step(step: int) -> None:
    if _WATCH is not None:
        _WATCH.step = step


def restarting_smaller(why: str) -> None:
    """This rank is about to exit 145 (RestartSmaller, `why`): posted for its peers, which its exit leaves
    in a collective that fails (exit_if_peer_lost), so that they exit 145 too, not 1 with a traceback."""
    if _WATCH is not None:
        with contextlib.suppress(Exception):  # the store's host gone: the peers find that themselves
            _WATCH.store.set(RESTART_KEY, f"rank {_WATCH.rank}: {why}")


def exit_if_peer_lost(error: BaseException) -> None:
    """A collective failed: a peer that left to restart at a smaller micro-batch raises RestartSmaller
    (exit 145, one line); a lost peer is named and this rank exits 144; returns if every peer beats."""
    chain = [error, error.__cause__, error.__context__]
    if _WATCH is None or not any(isinstance(e, dist.DistError) or "/gloo/" in str(e) for e in chain):
        return  # gloo's errors are RuntimeErrors that name its source file
    if restart := _WATCH.posted(RESTART_KEY):  # posted before that peer left: no wait needed
        raise RestartSmaller(restart) from None
    _WATCH.suspect = True
    _WATCH.peer_ended.wait(LOST_AFTER_SECONDS + 2 * PULSE_SECONDS)
