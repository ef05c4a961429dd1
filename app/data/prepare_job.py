"""The chart's prepare pods (`python -m app.data.prepare_job`): run `pretrain prepare`, record how it ended on
the data volume, and tell the training job, which the chart creates suspended (no trainer pod exists, so no
GPU is billed) and which stays so until its data is ready.

    python -m app.data.prepare_job run OPTIONS -- PREPARE_ARGS       a prepare pod: the whole input, or with
                                                                    --shard-count N share $JOB_COMPLETION_INDEX
    python -m app.data.prepare_job finalize OPTIONS -- PREPARE_ARGS  the finalizer: waits for the prepare (with
                                                                    --shard-count N joins its shares), releases

run: DIR/_READY holding --fingerprint means this exact output exists: nothing to do. Else it runs `pretrain
prepare PREPARE_ARGS`. Success writes DIR/_READY (atomically). A failure writes DIR/_FAILED ({fingerprint,
exit_code, failures, backoff_limit, final, pod, reason, job_uid}), final when the Job will not try again:
exit 2 (bad arguments: the Job's podFailurePolicy fails it at once) or more failures than --backoff-limit;
SIGTERM/SIGINT (130/143: preemption, eviction) are not counted, as the podFailurePolicy ignores disruptions.
A share keeps its markers in DIR/shares/N/ (_FAILED.I). The run step holds no API token and calls no API:
it parses downloaded files (parquet, a tokenizer.json), so it must not be able to rewrite the training job.

finalize: the only step with the token. It waits for the prepare with the trainer's wait state machine
(app/data/wait.py): DIR/_READY, or with --shard-count N every share finished for these inputs and settings.
It gives up on a final _FAILED marker, the prepare Job's Failed condition, the Job missing or Complete
without the data for --missing-grace seconds, and on its own bad arguments or unwritable volume. Then, when
sharded, it joins the shares (`pretrain prepare ... --finalize`) and writes DIR/_READY; it releases the job.
Every final failure posts a PrepareFailed Event and the condition DataReady=False on the job, which stays
suspended (exit 4; 2 for bad arguments).

Releasing is a patch of the job's suspend field (under Kueue: its queue label; app/budget/kube.py) with
the prepare's own ServiceAccount, allowed that patch on this release's job alone. Detail:
docs/kubernetes.md, "Data preparation and its ordering".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from app.data.wait import (
    FAILED,
    READY,
    JobReader,
    Marker,
    WaitSettings,
    failure_line,
    is_ready,
    read_failed_marker,
    wait_for_data,
)
from app.errors import EXIT_DATA_NOT_READY, UserError, print_stderr
from app.files import atomic_write_json, fsync_dir

DESCRIPTION = (
    "The chart's prepare pods: run `pretrain prepare` (or join the shares), record how it ended on the data "
    "volume, and release the suspended training job, or report a failed prepare on it."
)
FAILURES = "_FAILURES"
COMPONENT = "pretrain-prepare"
LOG_EVERY_SECONDS = 60.0
# a release that retrying cannot fix (RBAC, refused)
PERMANENT_HTTP = (401, 403, 422)
# seconds of retries: the job may not exist yet (kubectl and Helm create it after the Job)
RELEASE_PATIENCE = 120.0


def say(line: str) -> None:
    print(line, flush=True)


def write_ready(out: Path, fingerprint: str) -> None:
    tmp = out / f"{READY}.tmp"
    tmp.write_text(f"{fingerprint}\n")
    os.replace(tmp, out / READY)
    fsync_dir(out)
    say(f"prepare: wrote {out / READY} ({fingerprint})")


def unwritable(out: Path) -> str:
    """'' when files can be made in `out` (created if needed), else the one line that says how to fix it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test.{socket.gethostname()}.{os.getpid()}"  # several pods may probe at once
        probe.touch()
        probe.unlink()
        return ""
    except OSError:
        return (
            f"prepare: {out} is not writable as uid {os.getuid()} gid {os.getgid()}: keep "
            "volumePermissions.enabled=true, or give the data volume's root to that uid/gid (fsGroup is not "
            "applied to ReadWriteMany volumes of most CSI drivers)"
        )


# ---- the training job ----------------------------------------------------------------------------------


class TrainingJob:
    """The suspended training job, told about its data: Preparing, released, or failed."""

    def __init__(self, spec: str, namespace: str, queue: str, api: Any) -> None:
        from app.budget.kube import JOB_KINDS, KubeActions

        kind, _, name = spec.partition("/")
        if kind not in JOB_KINDS or not name:
            raise UserError(f"--job {spec}: expected KIND/NAME with KIND one of {', '.join(JOB_KINDS)}")
        self.kind, self.name, self.namespace, self.queue = kind, name, namespace, queue
        self.kube = KubeActions(namespace, name, api, component=COMPONENT, prefix="data", kind=kind)

    def release_command(self) -> str:
        """What a user runs to release the job by hand."""
        where = f"kubectl -n {self.namespace}"
        if self.queue:
            return f"{where} label {self.kind.lower()} {self.name} kueue.x-k8s.io/queue-name={self.queue}"
        patch = (
            {"spec": {"runPolicy": {"suspend": False}}}
            if self.kind == "PyTorchJob"
            else {"spec": {"suspend": False}}
        )
        return f"{where} patch {self.kind.lower()} {self.name} --type merge -p '{json.dumps(patch, separators=(',', ':'))}'"

    def _condition(self, ready: bool, reason: str, message: str) -> None:
        """The DataReady condition: what `kubectl describe` shows; a failure to set it is only logged."""
        from app.budget.kube import short_error

        try:
            self.kube.set_condition(ready, reason, message)
        except Exception as e:  # noqa: BLE001 - the Event and the logs carry the same fact
            print_stderr(
                f"prepare: cannot set the DataReady condition of {self.kind} {self.name}: {short_error(e)}"
            )

    def preparing(self, what: str) -> None:
        self._condition(False, "Preparing", f"{what}; the job starts when the data is ready")

    def release(self, out: Path, fingerprint: str) -> int:
        """Release the job: 0; 2 when retrying cannot help (RBAC, the job missing for RELEASE_PATIENCE);
        1 after RELEASE_PATIENCE of other errors (the Job's next pod tries again)."""
        from app.budget.kube import short_error

        deadline = time.monotonic() + RELEASE_PATIENCE
        while True:
            try:
                self.kube.release(fingerprint, self.queue)
                break
            except Exception as e:  # noqa: BLE001 - the client raises several types
                status = getattr(e, "status", None)
                if status not in PERMANENT_HTTP and time.monotonic() < deadline:
                    time.sleep(2.0)
                    continue
                print_stderr(
                    f"prepare: the data is ready but {self.kind} {self.namespace}/{self.name} was not released: "
                    f"{short_error(e)}; release it by hand: {self.release_command()}"
                )
                return 2 if status in (*PERMANENT_HTTP, 404) else 1
        done = f"handed to Kueue queue {self.queue}" if self.queue else "released"
        line = f"the data in {out} is ready ({fingerprint}): {done}"
        say(f"prepare: {self.kind} {self.name} {done}")
        self._condition(True, "DataPrepared", line)
        self.kube.event("DataReady", line, kind="Normal")
        return 0

    def failed(self, line: str) -> None:
        message = f"{line}; the job stays suspended until a prepare succeeds"
        self.kube.event("PrepareFailed", message)
        self._condition(False, "PrepareFailed", message)


def release(job: TrainingJob | None, out: Path, fingerprint: str) -> int:
    return job.release(out, fingerprint) if job is not None else 0


# ---- how a prepare ended -------------------------------------------------------------------------------


def run_prepare(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd`, its stdout passed through and its stderr echoed line by line: (exit code, last stderr
    line). SIGTERM and SIGINT to this process (the pod's PID 1) go on to it, so it stops as it would alone."""
    try:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
    except OSError as e:
        return 127, f"cannot run {cmd[0]}: {e.strerror}"
    previous = {
        s: signal.signal(s, lambda signum, _: proc.send_signal(signum))
        for s in (signal.SIGTERM, signal.SIGINT)
    }
    last = ""
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            last = line.strip() or last
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return (128 - rc if rc < 0 else rc), last[-500:]


def record_failure(
    failed: Path, failures: Path, fingerprint: str, rc: int, backoff_limit: int, reason: str, **extra: Any
) -> None:
    """The _FAILED marker of a failed attempt; final when the Job will not try again. Failures are counted
    per arguments and per Job ($PRETRAIN_JOB_UID): a new Job after a fix has its whole backoff limit."""
    uid = os.environ.get("PRETRAIN_JOB_UID", "")
    n = 0
    try:
        seen, count, *seen_uid = failures.read_text().split()
        n = int(count) if [seen, *seen_uid] == [fingerprint, *([uid] if uid else [])] else 0
    except (OSError, ValueError):
        pass
    final = False
    if rc not in (130, 143):  # a disruption: the podFailurePolicy does not count it either
        n += 1
        failures.write_text(f"{fingerprint} {n} {uid}".strip() + "\n")
        final = rc == 2 or n > backoff_limit
    marker = {
        "fingerprint": fingerprint,
        "exit_code": rc,
        "failures": n,
        "backoff_limit": backoff_limit,
        "final": final,
        "pod": socket.gethostname(),
        "reason": reason,
        "job_uid": uid,
        **extra,
    }
    atomic_write_json(failed, marker, durable=False)
    print_stderr(
        f"prepare: pretrain prepare exited {rc} (failure {n}, backoffLimit {backoff_limit}, final: {str(final).lower()})"
    )


def _share_markers(out: Path, count: int, index: int) -> tuple[Path, Path]:
    root = out / "shares" / str(count)
    root.mkdir(parents=True, exist_ok=True)
    return root / f"{FAILED}.{index}", root / f"{FAILURES}.{index}"


def run(args: argparse.Namespace, prepare_args: list[str]) -> int:
    out, fp = Path(args.dir), args.fingerprint
    index = None
    if args.shard_count > 1:
        completion = os.environ.get("JOB_COMPLETION_INDEX", "")
        if not completion.isdigit():
            raise UserError(
                f"--shard-count {args.shard_count}: this pod has no $JOB_COMPLETION_INDEX (not an Indexed Job)"
            )
        index = int(completion)
    if is_ready(out, fp):
        say(f"prepare: {out} is ready ({fp}), nothing to do")
        return 0
    # Exit 2 fails the Job at once (podFailurePolicy); the finalizer reads that and tells the training job.
    if why := unwritable(out):
        print_stderr(why)
        return 2
    cmd = ["pretrain", "prepare", *prepare_args]
    if index is None:
        (out / READY).unlink(missing_ok=True)
        failed, failures = out / FAILED, out / FAILURES
    else:
        cmd += ["--shard-count", str(args.shard_count), "--shard-index", str(index)]
        failed, failures = _share_markers(out, args.shard_count, index)
    rc, reason = run_prepare(cmd)
    if rc != 0:
        extra = {} if index is None else {"share": index, "shard_count": args.shard_count}
        record_failure(failed, failures, fp, rc, args.backoff_limit, reason, **extra)
        return rc
    failed.unlink(missing_ok=True)
    failures.unlink(missing_ok=True)
    if index is not None:
        say(f"prepare: share {index} of {args.shard_count} is done")
        return 0
    write_ready(out, fp)
    return 0


# ---- the finalizer -------------------------------------------------------------------------------------


class SharesDone:
    """What the finalizer of a sharded prepare waits for: every share finished for these inputs and settings
    (app/data/wait.py's wait_for_data runs the wait, as it does the trainer's for the marker)."""

    def __init__(self, shares: Any, fingerprint: str) -> None:
        self.shares, self.fingerprint = shares, fingerprint
        self.pending: dict[int, str] = dict.fromkeys(range(shares.count), "not started")
        self.complete_hint = (
            "an input changed after the shares were planned (a file on the volume, a new revision of an "
            "hf:// dataset), or a share's pod ended without its state; delete the prepare Jobs and run them again"
        )

    @property
    def where(self) -> str:
        if not self.pending:
            return f"the {self.shares.count} shares in {self.shares.root}"
        waiting = ", ".join(f"{i} ({why})" for i, why in self.pending.items())
        return f"shares {waiting} of {self.shares.count}"

    def ready(self) -> bool:
        self.pending = self.shares.pending()
        return not self.pending

    def failure(self, job_uid: str) -> str:
        """The line of the first share whose failure is final, or ''."""
        root = self.shares.root
        for i in range(self.shares.count):
            if marker := read_failed_marker(root / f"{FAILED}.{i}", self.fingerprint, job_uid):
                return failure_line(marker)
        return ""

    def lacking(self) -> str:
        return f"{self.where} are not finished for these inputs and settings"


def _shares(out: Path, count: int, prepare_args: list[str]) -> Any:
    """The finalizer's view of the shares, from the prepare arguments; UserError for bad ones (an unknown
    flag, a missing input) or an unwritable volume."""
    from app.command import Parser
    from app.data import cli
    from app.data.shares import Shares

    if why := unwritable(out):
        raise UserError(why.removeprefix("prepare: "))
    parser = Parser(prog="pretrain prepare")
    cli.add_arguments(parser)
    cfg = cli.config_from_args(parser.parse_args([*prepare_args, "--shard-count", str(count), "--finalize"]))
    return Shares(cfg)


def finalize(args: argparse.Namespace, prepare_args: list[str], job: TrainingJob | None, api: Any) -> int:
    """Wait for the prepare (a one-pod prepare's marker, or every share), join the shares, release the job."""
    out, fp, count = Path(args.dir), args.fingerprint, args.shard_count
    if count > 1 and is_ready(out, fp):
        say(f"prepare: {out} is ready ({fp}), nothing to join")
        return release(job, out, fp)
    target: Marker | SharesDone = Marker(out, fp)
    if count > 1:
        try:
            shares = _shares(out, count, prepare_args)
        except UserError as e:
            return give_up(out, fp, str(e), job, count, code=e.exit_code)
        target = SharesDone(shares, fp)
    if job is not None and not target.ready():
        what = f"{count} prepare pods are" if count > 1 else "`pretrain prepare` is"
        job.preparing(f"{what} writing {out}")
    settings = WaitSettings(
        data_dir=out,
        fingerprint=fp,
        job=args.prepare_job,
        namespace=args.namespace,
        poll_seconds=args.poll,
        timeout_seconds=0.0,  # the prepare Job's activeDeadlineSeconds is the limit
        missing_grace_seconds=args.missing_grace,
        log_every_seconds=LOG_EVERY_SECONDS,
    )
    reader = (
        JobReader(args.namespace, args.prepare_job, api) if api is not None and args.prepare_job else None
    )
    outcome, line = wait_for_data(settings, reader, say=lambda m: say(f"prepare: {m}"), target=target)
    if outcome != "ready":
        return give_up(out, fp, line, job, count)
    if count > 1:
        try:
            shares.join(say)
        except UserError as e:
            return give_up(out, fp, str(e), job, count)
        write_ready(out, fp)
        # a final failure of an earlier finalizer of these arguments is over
        (out / FAILED).unlink(missing_ok=True)
    return release(job, out, fp)


def give_up(
    out: Path,
    fingerprint: str,
    line: str,
    job: TrainingJob | None,
    count: int,
    code: int = EXIT_DATA_NOT_READY,
) -> int:
    """Every final failure of the finalizer: one line, and on the job the PrepareFailed Event and the
    condition DataReady=False. Sharded, also a final DIR/_FAILED for the trainer's wait step (which watches
    this Job) where the volume takes it; a one-pod prepare's marker is its own pod's."""
    print_stderr(f"prepare: {line}")
    if count > 1:
        marker = {
            "fingerprint": fingerprint,
            "exit_code": code,
            "failures": 1,
            "backoff_limit": 0,
            "final": True,
            "pod": socket.gethostname(),
            "reason": line,
            "job_uid": os.environ.get("PRETRAIN_JOB_UID", ""),
        }
        # on an unwritable volume the Event, the condition and this Job's failure say it
        with contextlib.suppress(OSError):
            atomic_write_json(out / FAILED, marker, durable=False)
    if job is not None:
        job.failed(line)
    return code


# ---- the command ---------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "step",
        choices=("run", "finalize"),
        help="run: a prepare pod; finalize: wait for it (join the shares) and release the job",
    )
    p.add_argument("--dir", required=True, help="the prepare output dir, e.g. /data/fineweb-edu-10bt")
    p.add_argument(
        "--fingerprint", required=True, help="the prepare arguments' fingerprint (_READY holds it)"
    )
    p.add_argument(
        "--backoff-limit", type=int, default=3, help="failures after which one is final (default 3)"
    )
    p.add_argument(
        "--job",
        default="",
        metavar="KIND/NAME",
        help="finalize: the suspended training job to release (PyTorchJob/NAME or TrainJob/NAME)",
    )
    p.add_argument("--queue", default="", help="its Kueue LocalQueue: releasing adds the queue label instead")
    p.add_argument("--namespace", default="", help="the jobs' namespace (default $POD_NAMESPACE)")
    p.add_argument(
        "--shard-count",
        type=int,
        default=1,
        help="N > 1: a sharded prepare (run: share $JOB_COMPLETION_INDEX; finalize: join the N shares)",
    )
    p.add_argument(
        "--prepare-job",
        default="",
        metavar="NAME",
        help="finalize: the prepare's Job (the shares' Indexed Job), whose status is read through the API",
    )
    p.add_argument("--poll", type=float, default=10.0, help="finalize: seconds between looks (default 10)")
    p.add_argument(
        "--missing-grace",
        type=float,
        default=120.0,
        help="finalize: give up when the prepare Job is missing, or complete without the data, this long "
        "(default 120 s)",
    )


def main(argv: list[str] | None = None) -> int:
    from app.command import Parser, guarded

    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, prepare_args = argv[:split], argv[split + 1 :]

    def go() -> int:
        parser = Parser(prog="python -m app.data.prepare_job", description=DESCRIPTION)
        add_arguments(parser)
        args = parser.parse_args(own)
        numbers = (args.poll, args.missing_grace)
        if args.shard_count < 1 or args.backoff_limit < 0 or not all(math.isfinite(x) for x in numbers):
            raise UserError(
                "--shard-count must be >= 1, --backoff-limit >= 0, --poll and --missing-grace finite"
            )
        if not args.poll > 0 or args.missing_grace < 0:
            raise UserError("--poll must be > 0 and --missing-grace >= 0")
        args.namespace = args.namespace or os.environ.get("POD_NAMESPACE", "default")
        if args.step == "run":
            if args.job or args.prepare_job:
                raise UserError(
                    "run: --job and --prepare-job are the finalize step's (the run step holds no API token); "
                    "use the chart of this image, which renders a finalizer Job"
                )
            return run(args, prepare_args)
        from app.budget.kube import api_client

        api = api_client() if args.job or args.prepare_job else None
        job = None
        if args.job:
            if api is None:
                raise UserError(
                    f"--job {args.job}: no Kubernetes API here (no service-account token, no kubeconfig) to "
                    "release the job when the data is ready"
                )
            job = TrainingJob(args.job, args.namespace, args.queue, api)
        return finalize(args, prepare_args, job, api)

    return guarded(go, prefix="prepare")


if __name__ == "__main__":
    sys.exit(main())
