"""`pretrain wait-data`: the trainer pods' wait for the prepare Job's output (the chart's wait-for-data
initContainer), with an end: it sees a failed or missing prepare instead of polling forever.

Why it ends in a verdict file and exit 0 rather than a failure: the training-operator reads only the
trainer container's exit code, and a failed initContainer reads as 0xbeef, retried forever, uncounted.
The launcher finds the verdict and ends the pod with its code (4 no data, 2 bad arguments, 1 a crash).

Detail: docs/kubernetes.md, "Data preparation and its ordering"; flags in docs/contracts.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import EXIT_DATA_NOT_READY, UserError, print_stderr
from app.files import atomic_write_json

READY, FAILED = "_READY", "_FAILED"  # the markers of a prepare (app/data/prepare_job.py writes them)
log = logging.getLogger("pretrain.wait")


@dataclass
class WaitSettings:
    data_dir: Path
    fingerprint: str
    job: str = ""  # the prepare Job to watch through the API ("" = markers only)
    namespace: str = ""
    poll_seconds: float = 15.0
    timeout_seconds: float = 21600.0  # 0 = no limit
    missing_grace_seconds: float = 120.0
    stop_file: Path | None = None
    log_every_seconds: float = 300.0


class JobReader:
    """The prepare Job's state through the Kubernetes API: "failed: <why>", "complete", "missing",
    "running", or "unknown" (the API cannot be asked; logged once). `uid`: the Job's, once read."""

    def __init__(self, namespace: str, name: str, api_client: Any):
        from kubernetes import client

        self.batch = client.BatchV1Api(api_client)
        self.namespace, self.name = namespace, name
        self.broken = ""
        self.uid = ""

    def state(self) -> str:
        if self.broken:
            return "unknown"
        try:
            job = self.batch.read_namespaced_job(self.name, self.namespace, _request_timeout=5.0)
        except Exception as e:
            status = getattr(e, "status", None)
            if status == 404:
                return "missing"
            self.broken = f"HTTP {status}" if status else type(e).__name__
            log.warning(f"cannot read job/{self.name} ({self.broken}); watching the data volume only")
            return "unknown"
        self.uid = (job.metadata and job.metadata.uid) or ""
        for c in (job.status and job.status.conditions) or []:
            if c.status == "True" and c.type == "Failed":
                return f"failed: {c.reason or 'Failed'}: {c.message or 'no message'}"
            if c.status == "True" and c.type == "Complete":
                return "complete"
        return "running"


def read_failed_marker(path: Path, fingerprint: str, job_uid: str = "") -> dict | None:
    """The _FAILED marker at `path` when it is this fingerprint's and final (its Job will not try again).
    With the uid of the Job that writes it, a marker an earlier Job left (before a fix and a new Job) is not
    this one's."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("fingerprint") != fingerprint or data.get("final") is not True:
        return None
    if job_uid and data.get("job_uid") not in (None, "", job_uid):
        return None
    return data


def failure_line(marker: dict) -> str:
    """A final _FAILED marker as one line: who failed, how, where, and its last stderr line."""
    who = f"share {marker['share']} of {marker['shard_count']}" if "share" in marker else "`pretrain prepare`"
    return (
        f"{who} failed for good: exit {marker.get('exit_code')} in pod {marker.get('pod', '?')} (failure "
        f"{marker.get('failures', '?')}, backoffLimit {marker.get('backoff_limit', '?')}): "
        f"{marker.get('reason') or 'no message'}"
    )


def is_ready(data_dir: Path, fingerprint: str) -> bool:
    try:
        return (Path(data_dir) / READY).read_text().strip() == fingerprint
    except OSError:
        return False


class Marker:
    """What a wait waits for (the trainer's wait step, and the release of a one-pod prepare): DIR/_READY
    holding the fingerprint; a final DIR/_FAILED of the same fingerprint ends the wait. Another wait (the
    finalizer's, for the shares of a sharded prepare) has the same four members."""

    def __init__(self, data_dir: Path, fingerprint: str) -> None:
        self.data_dir, self.fingerprint = Path(data_dir), fingerprint
        self.where = f"{data_dir}/{READY} ({fingerprint})"
        # why a Job that completed can leave it not ready
        self.complete_hint = "the data volume here is not the one the prepare Job wrote (storage.data), or the marker was removed"

    def ready(self) -> bool:
        return is_ready(self.data_dir, self.fingerprint)

    def failure(self, job_uid: str) -> str:
        """The line of a final failure of the Job `job_uid` ('' = of any Job), or ''."""
        marker = read_failed_marker(self.data_dir / FAILED, self.fingerprint, job_uid)
        return failure_line(marker) if marker else ""

    def lacking(self) -> str:
        return f"{self.where} is not there"


def wait_for_data(
    s: WaitSettings,
    job: JobReader | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = print,
    target: Marker | None = None,
) -> tuple[str, str]:
    """("ready" | "stop" | "gave-up", one line): wait for `target` (default: the marker of s.data_dir and
    s.fingerprint), giving up when its Job cannot deliver it: failed for good (its final marker, or its
    Failed condition), missing, or complete without it, these two for s.missing_grace_seconds."""
    target = target or Marker(s.data_dir, s.fingerprint)
    start = clock()
    since: dict[str, float] = {}  # when the Job entered its current state (missing, complete, ...)
    last_log = -float("inf")
    source = f" from job/{s.job}" if s.job else ""
    logs = f"; see `kubectl logs job/{s.job}`" if s.job else ""
    while True:
        now = clock()
        waited = now - start
        if target.ready():
            return "ready", f"{target.where} is ready, after {waited:.0f} s"
        if s.stop_file is not None and s.stop_file.exists():
            return "stop", f"stop file {s.stop_file} present: starting the trainer so that it stops"
        # the state first: reading the Job learns its uid, which tells its markers from an earlier Job's
        state = job.state() if job else "unknown"
        if failed := target.failure(job.uid if job else ""):
            return "gave-up", f"{failed}{logs}"
        if state.startswith("failed"):
            return "gave-up", f"prepare job/{s.job} {state}{logs}"
        since = {state: since.get(state, now)}
        grace_over = now - since[state] >= s.missing_grace_seconds
        if state == "missing" and grace_over:
            return "gave-up", (
                f"prepare job/{s.job} does not exist and {target.lacking()}: it was deleted, or never "
                f"created (kubectl users: apply its 60-job-*.yaml too); re-create it or prepare the data first"
            )
        if state == "complete" and grace_over:
            return "gave-up", f"prepare job/{s.job} completed but {target.lacking()}: {target.complete_hint}"
        if s.timeout_seconds and waited >= s.timeout_seconds:
            return "gave-up", (
                f"no {target.where}{source} after {waited:.0f} s (prepare.wait.timeoutSeconds="
                f"{s.timeout_seconds:.0f}); a longer prepare: raise it, or prepare first (job.enabled=false)"
            )
        if now - last_log >= s.log_every_seconds or waited < s.poll_seconds:
            say(f"waiting for {target.where}{source}, {waited:.0f} s (job state: {state})")
            last_log = now
        sleep(s.poll_seconds)


def _kube_client() -> Any | None:
    """The API client where this pod has a token (the chart mounts it only with prepare.wait.useKubernetesApi),
    else None: the wait then watches the data volume only, as it does when the credentials do not load."""
    from app.budget.kube import api_client, has_token

    if not has_token():
        return None
    try:
        return api_client()
    except UserError as e:
        log.warning("wait-for-data: %s; watching the data volume only", e)
        return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, help="the prepare output dir, e.g. /data/fineweb-edu-10bt")
    p.add_argument("--fingerprint", required=True, help="the prepare arguments' fingerprint _READY must hold")
    p.add_argument("--job", default="", help="the prepare Job, read through the Kubernetes API if allowed")
    p.add_argument("--namespace", default="", help="its namespace (default $POD_NAMESPACE)")
    p.add_argument("--poll", type=float, default=15.0, help="seconds between looks (default 15)")
    p.add_argument(
        "--timeout",
        type=float,
        default=21600.0,
        help="give up after this many seconds (default 6 h; 0 = never)",
    )
    p.add_argument(
        "--missing-grace",
        type=float,
        default=120.0,
        help="give up when the Job is missing, or complete without the marker, this long (default 120 s)",
    )
    p.add_argument("--stop-file", help="let the trainer start (and stop) when this file appears")
    p.add_argument("--verdict", help="on giving up write {code, reason} here and exit 0 (the launcher fails)")
    p.add_argument(
        "--event-job", default="", help="post a DataNotReady Event on this PyTorchJob when giving up"
    )
    p.add_argument(
        "--check-args",
        action="store_true",
        help="check the arguments, say what would be waited for, and exit (0, or 2 for bad ones); "
        "waits for nothing and writes no verdict (the chart's `helm test`)",
    )


def leave_verdict(path: str | None, code: int, line: str, prefix: str = "") -> int:
    """One line on stderr; with a verdict file, {code, reason} there and exit 0 (the launcher ends the pod
    with `code`), else exit `code`."""
    print_stderr(f"wait-for-data: {prefix}{line}")
    if path:
        try:
            atomic_write_json(Path(path), {"code": code, "reason": line}, durable=False)
            return 0
        except OSError as e:
            print_stderr(f"wait-for-data: cannot write the verdict {path}: {e.strerror}")
    return code


def crash_line(e: BaseException) -> str:
    """An unexpected error as one line: its type, its first line and where it was raised."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    first = (str(e).splitlines() or [""])[0]
    return f"crashed: {type(e).__name__}: {first}{where}"


def run(args: argparse.Namespace) -> int:
    """`pretrain wait-data`: every end is a verdict (with --verdict) or an exit code, never a traceback."""
    verdict = None if args.check_args else args.verdict
    try:
        return _wait(args)
    except UserError as e:
        if verdict is None:
            raise
        return leave_verdict(verdict, e.exit_code, f"bad arguments: {e}")
    except Exception as e:
        return leave_verdict(verdict, 1, crash_line(e))


def _wait(args: argparse.Namespace) -> int:
    inf = math.inf  # the comparisons below are also False for NaN
    if not (0 < args.poll < inf and 0 <= args.timeout < inf and 0 <= args.missing_grace < inf):
        raise UserError("wait-data: --poll must be > 0, --timeout and --missing-grace >= 0 (finite numbers)")
    if not args.dir or not args.fingerprint:
        raise UserError("wait-data: --dir and --fingerprint must not be empty")
    if Path(args.dir).exists() and not Path(args.dir).is_dir():
        raise UserError(f"wait-data: --dir {args.dir} is a file; pass the prepare output directory")
    namespace = args.namespace or os.environ.get("POD_NAMESPACE", "default")
    if args.check_args:
        print(
            f"wait-for-data: would wait for {args.dir}/_READY ({args.fingerprint})"
            + (f" from job/{args.job} in namespace {namespace}" if args.job else "")
            + f", polling every {args.poll:g} s, giving up after "
            + (f"{args.timeout:g} s" if args.timeout else "no time limit")
            + (f"; verdict {args.verdict}" if args.verdict else "")
            + (f"; Events on pytorchjob/{args.event_job}" if args.event_job else ""),
            flush=True,
        )
        return 0
    api = _kube_client() if args.job or args.event_job else None
    settings = WaitSettings(
        data_dir=Path(args.dir),
        fingerprint=args.fingerprint,
        job=args.job,
        namespace=namespace,
        poll_seconds=args.poll,
        timeout_seconds=args.timeout,
        missing_grace_seconds=args.missing_grace,
        stop_file=Path(args.stop_file) if args.stop_file else None,
    )
    reader = JobReader(namespace, args.job, api) if api is not None and args.job else None
    outcome, line = wait_for_data(settings, reader, say=lambda m: print(f"wait-for-data: {m}", flush=True))
    if outcome != "gave-up":
        print(f"wait-for-data: {line}", flush=True)
        return 0
    if api is not None and args.event_job:
        from app.budget.kube import KubeActions

        KubeActions(namespace, args.event_job, api, component="pretrain-wait-for-data", prefix="data").event(
            "DataNotReady", line
        )
    return leave_verdict(args.verdict, EXIT_DATA_NOT_READY, line, "gave up: ")


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `name VALUE` or `name=VALUE` in argv (last one wins), as argparse would read it."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def main(argv: list[str] | None = None) -> int:
    """`python -m app.data.wait ARGS`, the chart's wait-for-data initContainer: `pretrain wait-data` whose
    unparsable arguments end in a verdict as well (the top-level `pretrain` parser would exit 2 first)."""
    from app.command import Parser, guarded

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = Parser(prog="pretrain wait-data", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except UserError as e:
        verdict = None if "--check-args" in argv else _flag(argv, "--verdict")
        return leave_verdict(verdict, e.exit_code, f"bad arguments: {e}")
    return guarded(lambda: run(args), prefix="wait-for-data")


if __name__ == "__main__":
    sys.exit(main())
