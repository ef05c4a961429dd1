"""`pretrain wait-data`: the trainer pods' wait for the prepare Job's output (the chart's wait-for-data
initContainer), with an end: it sees a failed or missing prepare instead of polling forever.

    pretrain wait-data --dir /data/OUT --fingerprint FP [--job PREPARE_JOB] [--timeout 21600]
                       [--stop-file /run/pretrain/stop.json] [--verdict /run/pretrain/data-verdict.json]
                       [--event-job PYTORCHJOB]

Every --poll seconds, in this order:
- ready: DIR/_READY holds FP (written by the prepare Job after `pretrain prepare` succeeded) -> exit 0;
- a stop file (a budget or user stop during the wait) -> exit 0: the trainer starts and stops at once;
- DIR/_FAILED (written by the prepare Job's script when `pretrain prepare` failed) for FP marked final
  (exit 2, a bad argument, or more failures than the Job's backoffLimit) -> give up;
- with Kubernetes API access (in a pod with a token and --job): the prepare Job's Failed condition ->
  give up; the Job not found for --missing-grace seconds -> give up (deleted, or never created); the
  Job Complete but no _READY for FP after the grace -> give up;
- no _READY after --timeout seconds -> give up.

Giving up: one line on stderr, a Warning Event `DataNotReady` on the PyTorchJob (--event-job), and the
verdict file {"code": 4, "reason": ...}; then exit 0, because the training-operator reads the exit code
of the trainer container only and an initContainer's failure reads as 0xbeef (48879), which it retries
forever. The launcher finds the verdict and ends the pod with exit 4, permanent (app/restarts.py).
Without --verdict it exits 4 itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.files import atomic_write_json

EXIT_DATA_NOT_READY = 4  # the same code as app.restarts.EXIT_DATA_NOT_READY
TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
LOG_EVERY_SECONDS = 300.0
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


class JobReader:
    """The prepare Job's state through the Kubernetes API: "failed: <why>", "complete", "missing",
    "running", or "unknown" (the API cannot be asked; logged once)."""

    def __init__(self, namespace: str, name: str, api_client: Any):
        from kubernetes import client

        self.batch = client.BatchV1Api(api_client)
        self.namespace, self.name = namespace, name
        self.broken = ""

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
            log.warning(
                "wait-for-data: cannot read job/%s (%s); watching the data volume only",
                self.name,
                self.broken,
            )
            return "unknown"
        for c in (job.status and job.status.conditions) or []:
            if c.status == "True" and c.type == "Failed":
                return f"failed: {c.reason or 'Failed'}: {c.message or 'no message'}"
            if c.status == "True" and c.type == "Complete":
                return "complete"
        return "running"


def read_failed_marker(data_dir: Path, fingerprint: str) -> dict | None:
    """DIR/_FAILED of this fingerprint when it is final (the prepare Job will not try again)."""
    try:
        data = json.loads((Path(data_dir) / "_FAILED").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("fingerprint") != fingerprint or data.get("final") is not True:
        return None
    return data


def is_ready(data_dir: Path, fingerprint: str) -> bool:
    try:
        return (Path(data_dir) / "_READY").read_text().strip() == fingerprint
    except OSError:
        return False


def wait_for_data(
    s: WaitSettings,
    job: JobReader | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = print,
) -> tuple[str, str]:
    """("ready" | "stop" | "gave-up", one line)."""
    start = clock()
    missing_since: float | None = None
    complete_since: float | None = None
    last_log = -float("inf")
    where = f"{s.data_dir}/_READY ({s.fingerprint})"
    source = f" from job/{s.job}" if s.job else ""
    while True:
        now = clock()
        waited = now - start
        if is_ready(s.data_dir, s.fingerprint):
            return "ready", f"{s.data_dir} is ready ({s.fingerprint}), after {waited:.0f} s"
        if s.stop_file is not None and s.stop_file.exists():
            return "stop", f"stop file {s.stop_file} present: starting the trainer so that it stops"
        failed = read_failed_marker(s.data_dir, s.fingerprint)
        if failed:
            return "gave-up", (
                f"the prepare Job failed for good: `pretrain prepare` exited {failed.get('exit_code')} in pod "
                f"{failed.get('pod', '?')} (failure {failed.get('failures', '?')}, backoffLimit "
                f"{failed.get('backoff_limit', '?')}); see `kubectl logs job/{s.job or '<prepare job>'}`"
            )
        state = job.state() if job else "unknown"
        if state.startswith("failed"):
            return "gave-up", f"prepare job/{s.job} {state}; see `kubectl logs job/{s.job}`"
        missing_since = (missing_since if missing_since is not None else now) if state == "missing" else None
        if missing_since is not None and now - missing_since >= s.missing_grace_seconds:
            return "gave-up", (
                f"prepare job/{s.job} does not exist and {where} is not there: it was deleted, or never "
                f"created (kubectl users: apply its 60-job-*.yaml too); re-create it or prepare the data first"
            )
        complete_since = (
            (complete_since if complete_since is not None else now) if state == "complete" else None
        )
        if complete_since is not None and now - complete_since >= s.missing_grace_seconds:
            return "gave-up", (
                f"prepare job/{s.job} completed but {where} is not there: the data volume of the trainer "
                f"is not the one the prepare Job wrote (storage.data), or the marker was removed"
            )
        if s.timeout_seconds and waited >= s.timeout_seconds:
            return "gave-up", (
                f"no {where}{source} after {waited:.0f} s (prepare.wait.timeoutSeconds="
                f"{s.timeout_seconds:.0f}); a longer prepare: raise it, or prepare first (job.enabled=false)"
            )
        if now - last_log >= LOG_EVERY_SECONDS or waited < s.poll_seconds:
            say(f"wait-for-data: waiting for {where}{source}, {waited:.0f} s (job state: {state})")
            last_log = now
        sleep(s.poll_seconds)


def _kube_client():
    """The in-cluster API client, or None outside a pod with a service-account token."""
    if not os.environ.get("KUBERNETES_SERVICE_HOST") or not TOKEN.exists():
        return None
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except Exception as e:  # the client raises several types for a broken service account
        log.warning("wait-for-data: no Kubernetes credentials (%s); watching the data volume only", e)
        return None
    return client.ApiClient()


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
    p.add_argument(
        "--stop-file", default=None, help="let the trainer start (and stop) when this file appears"
    )
    p.add_argument(
        "--verdict",
        default=None,
        help="on giving up write {code, reason} here and exit 0 (the launcher fails)",
    )
    p.add_argument(
        "--event-job", default="", help="post a DataNotReady Event on this PyTorchJob when giving up"
    )


def run(args: argparse.Namespace) -> int:
    from app.errors import UserError

    if args.poll <= 0 or args.timeout < 0 or args.missing_grace < 0:
        raise UserError("wait-data: --poll must be > 0, --timeout and --missing-grace >= 0")
    namespace = args.namespace or os.environ.get("POD_NAMESPACE", "default")
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
    outcome, line = wait_for_data(settings, reader, say=lambda m: print(m, flush=True))
    if outcome != "gave-up":
        print(f"wait-for-data: {line}", flush=True)
        return 0
    print(f"wait-for-data: gave up: {line}", file=sys.stderr, flush=True)
    if api is not None and args.event_job:
        from app.budget.kube import KubeActions

        KubeActions(namespace, args.event_job, api, component="pretrain-wait-for-data", prefix="data").event(
            "DataNotReady", line
        )
    if args.verdict:
        atomic_write_json(Path(args.verdict), {"code": EXIT_DATA_NOT_READY, "reason": line}, durable=False)
        return 0
    return EXIT_DATA_NOT_READY
