"""The chart's export after training (export.enabled): `python -m app.tools.export_job`, the small pod that
waits for the training job to end and then releases the export Job, which the chart creates suspended.

Why two Jobs: the export pod mounts the checkpoint volume, which may be ReadWriteOnce, and a pod's volumes
are attached and mounted before any of its containers runs, so one pod cannot wait for the trainer pods
first and mount their volume after. The export Job is therefore created suspended (no pod: nothing
scheduled, no volume attached, no CPU node held for the days a run lasts), and this pod, which mounts no
volume and holds the export side's only API token, waits:

1. for the training job (--job PyTorchJob/NAME or TrainJob/NAME) to end: Succeeded (a PyTorchJob) or
   Complete (a TrainJob), or Failed;
2. for its pods (--pods, a label selector) to be gone: none Pending or Running, so that nothing writes a
   checkpoint any more and their volume is released (a ReadWriteOnce volume then attaches to the export
   pod's node);
3. then releases the export Job (a merge patch of spec.suspend to false) and posts an ExportStarted Event on
   the training job, which `kubectl describe` shows.

A training job that Failed is exported only with --on-failure export (its newest checkpoint, pushed too when
a repo is named). With skip (the chart's default) this pod posts an ExportSkipped Event that holds the
command which releases the export by hand, and ends: a failed run is looked at before it is published.
A training job missing for --missing-grace seconds (deleted; Helm creates it after this Job, so it may be
missing for a moment) ends the wait. This pod holds no HF token and reads nothing but API answers; the
export pod holds the HF token (for the push) and no API token.

Exit codes: 0 released, or skipped after a failed run; 2 bad arguments, the training or export Job missing,
or a call its RBAC refuses (retrying cannot help: the Job's podFailurePolicy fails it at once); 1 the API
failing for RELEASE_PATIENCE seconds (the Job's next pod tries again), or a crash.
Detail: docs/kubernetes.md, "Export and push after training".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.errors import UserError, print_stderr

DESCRIPTION = (
    "The chart's export after training: wait for the training job to end and its pods to be gone, then "
    "release the suspended export Job (or skip it after a failed run)."
)
COMPONENT = "pretrain-export"
# The condition a finished job carries, by kind; both carry Failed.
DONE = {"PyTorchJob": "Succeeded", "TrainJob": "Complete"}
# A call that retrying cannot fix: no token, or the RBAC refuses it.
PERMANENT_HTTP = (401, 403)
# Seconds of retries when releasing fails for another reason (the API server restarting).
RELEASE_PATIENCE = 120.0
TIMED = {"_request_timeout": 10.0}


def say(line: str) -> None:
    print(f"export: {line}", flush=True)


@dataclass
class Settings:
    kind: str
    name: str
    namespace: str
    export_job: str
    pods: str
    on_failure: str = "skip"
    poll_seconds: float = 30.0
    missing_grace_seconds: float = 300.0
    log_every_seconds: float = 600.0

    @property
    def ref(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"

    def release_command(self) -> str:
        """What a user runs to release the export by hand."""
        patch = json.dumps({"spec": {"suspend": False}}, separators=(",", ":"))
        return f"kubectl -n {self.namespace} patch job {self.export_job} --type merge -p '{patch}'"


def refused(s: Settings, what: str, status: int) -> UserError:
    return UserError(
        f"cannot {what} (HTTP {status}): the export's Role must allow it (rbac.create, or a Role of your own "
        f"bound to its ServiceAccount); release the export by hand: {s.release_command()}"
    )


class Cluster:
    """The calls this pod makes, each one a rule of its Role (helm/templates/export-rbac.yaml): get the
    training job, list the pods, patch the export Job (and create Events, through app/budget/kube.py)."""

    def __init__(self, s: Settings, api: Any) -> None:
        from kubernetes import client

        from app.budget.kube import JOB_KINDS

        self.s = s
        self.group, self.version, self.plural, _ = JOB_KINDS[s.kind]
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.trouble = ""  # the last transient API error, logged once per change

    def _transient(self, what: str, e: Exception) -> None:
        """Log an API error once (the caller tries again), or raise the one line of a refused call."""
        from app.budget.kube import short_error

        status = getattr(e, "status", None)
        if status in PERMANENT_HTTP:
            raise refused(self.s, what, status) from None
        trouble = f"cannot {what} ({short_error(e)}); trying again"
        if trouble != self.trouble:
            say(trouble)
        self.trouble = trouble

    def job_state(self) -> str:
        """ "succeeded", "failed: <reason>: <message>", "missing", or the job's latest true condition
        ("running", "suspended", "created", ...; "unknown" when the API cannot be read now)."""
        try:
            job = self.custom.get_namespaced_custom_object(
                self.group, self.version, self.s.namespace, self.plural, self.s.name, **TIMED
            )
        except Exception as e:  # the client raises several types
            if getattr(e, "status", None) == 404:
                return "missing"
            self._transient(f"read {self.s.ref}", e)
            return "unknown"
        true = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
        for c in true:
            if c.get("type") == "Failed":
                return f"failed: {c.get('reason') or 'Failed'}: {c.get('message') or 'no message'}"
        if any(c.get("type") == DONE[self.s.kind] for c in true):
            return "succeeded"
        return str(true[-1].get("type", "unknown")).lower() if true else "created"

    def live_pods(self) -> list[str] | None:
        """The job's pods that still run or wait to (not Succeeded or Failed); None when they cannot be read."""
        try:
            pods = self.core.list_namespaced_pod(self.s.namespace, label_selector=self.s.pods, **TIMED)
        except Exception as e:
            self._transient(f"list the pods {self.s.pods}", e)
            return None
        return [
            p.metadata.name
            for p in pods.items
            if (p.status and p.status.phase) not in ("Succeeded", "Failed")
        ]

    def release(self) -> None:
        """spec.suspend false on the export Job; raises the client's error."""
        self.batch.patch_namespaced_job(
            self.s.export_job,
            self.s.namespace,
            {"spec": {"suspend": False}},
            _content_type="application/merge-patch+json",
            **TIMED,
        )


def wait_for_training(
    s: Settings,
    cluster: Cluster,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The training job's end ("succeeded" or "failed: ..."), once its pods are gone; UserError when it is
    missing for s.missing_grace_seconds."""
    start = clock()
    missing_since: float | None = None
    last_log, last_state = -math.inf, ""
    while True:
        now = clock()
        state = cluster.job_state()
        if state == "missing":
            missing_since = now if missing_since is None else missing_since
            if now - missing_since >= s.missing_grace_seconds:
                raise UserError(
                    f"{s.ref} does not exist (for {s.missing_grace_seconds:.0f} s): it was deleted, or never "
                    f"created, so no run ends to export; to export what the volume holds: {s.release_command()}"
                )
        else:
            missing_since = None
        waiting = f"{s.ref} to end (state: {state})"
        if state == "succeeded" or state.startswith("failed"):
            live = cluster.live_pods()
            if live == []:
                return state
            waiting = (
                f"the pods of {s.ref} to be gone ({len(live)} left: {', '.join(live[:3])})"
                if live
                else f"a list of the pods of {s.ref}"
            )
        if state != last_state or now - last_log >= s.log_every_seconds:
            say(f"waiting for {waiting}, {now - start:.0f} s")
            last_log, last_state = now, state
        sleep(s.poll_seconds)


def release(s: Settings, cluster: Cluster, sleep: Callable[[float], None] = time.sleep) -> int:
    """Release the export Job: 0; UserError when retrying cannot help; 1 after RELEASE_PATIENCE of errors."""
    from app.budget.kube import short_error

    deadline = time.monotonic() + RELEASE_PATIENCE
    while True:
        try:
            cluster.release()
            return 0
        except Exception as e:  # the client raises several types
            status = getattr(e, "status", None)
            if status == 404:
                raise UserError(
                    f"the export Job {s.namespace}/{s.export_job} does not exist: it was deleted; `helm upgrade` "
                    "creates it again (or run `pretrain export` by hand)"
                ) from None
            if status in PERMANENT_HTTP:
                raise refused(s, f"release job/{s.export_job}", status) from None
            if time.monotonic() < deadline:
                sleep(2.0)
                continue
            print_stderr(f"export: job/{s.export_job} was not released: {short_error(e)}")
            return 1


def finish(s: Settings, cluster: Cluster, state: str, events: Any) -> int:
    """After the training job ended: release the export, or skip it after a failed run."""
    if state.startswith("failed") and s.on_failure == "skip":
        line = (
            f"{s.ref} {state}: the export is skipped (export.onFailure=skip); to export its newest checkpoint "
            f"anyway: {s.release_command()}"
        )
        say(line)
        if events is not None:
            events.event("ExportSkipped", line)
        return 0
    rc = release(s, cluster)
    if rc != 0:
        return rc
    how = "succeeded" if state == "succeeded" else f"{state.split(':')[0]} (export.onFailure=export)"
    line = f"{s.ref} {how} and its pods are gone: released job/{s.export_job}, which exports the run"
    say(line)
    if events is not None:
        events.event("ExportStarted", line, kind="Normal")
    return 0


def settings(args: argparse.Namespace) -> Settings:
    """The arguments, checked: one line for a bad one."""
    from app.budget.kube import JOB_KINDS

    kind, _, name = args.job.partition("/")
    if kind not in JOB_KINDS or not name:
        raise UserError(f"--job {args.job}: expected KIND/NAME with KIND one of {', '.join(JOB_KINDS)}")
    if not (0 < args.poll < math.inf and 0 <= args.missing_grace < math.inf):
        raise UserError("--poll must be > 0 and --missing-grace >= 0 (finite numbers)")
    if not args.export_job or not args.pods:
        raise UserError("--export-job and --pods must not be empty")
    return Settings(
        kind=kind,
        name=name,
        namespace=args.namespace or os.environ.get("POD_NAMESPACE", "default"),
        export_job=args.export_job,
        pods=args.pods,
        on_failure=args.on_failure,
        poll_seconds=args.poll,
        missing_grace_seconds=args.missing_grace,
    )


def run(s: Settings, api: Any) -> int:
    from app.budget.kube import KubeActions

    cluster = Cluster(s, api)
    say(f"waiting for {s.ref} to end and its pods ({s.pods}) to be gone, then releasing job/{s.export_job}")
    state = wait_for_training(s, cluster)
    events = KubeActions(s.namespace, s.name, api, component=COMPONENT, prefix="export", kind=s.kind)
    return finish(s, cluster, state, events)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--job", required=True, metavar="KIND/NAME", help="the training job: PyTorchJob/NAME or TrainJob/NAME"
    )
    p.add_argument("--export-job", required=True, metavar="NAME", help="the suspended export Job to release")
    p.add_argument(
        "--pods", required=True, metavar="SELECTOR", help="a label selector of the training job's pods"
    )
    p.add_argument(
        "--on-failure",
        choices=("skip", "export"),
        default="skip",
        help="a training job that Failed: skip the export (default) or export its newest checkpoint",
    )
    p.add_argument("--namespace", default="", help="the jobs' namespace (default $POD_NAMESPACE)")
    p.add_argument("--poll", type=float, default=30.0, help="seconds between looks (default 30)")
    p.add_argument(
        "--missing-grace",
        type=float,
        default=300.0,
        help="give up when the training job is missing this long (default 300 s)",
    )


def main(argv: list[str] | None = None) -> int:
    from app.command import Parser, guarded

    def go() -> int:
        parser = Parser(prog="python -m app.tools.export_job", description=DESCRIPTION)
        add_arguments(parser)
        s = settings(parser.parse_args(sys.argv[1:] if argv is None else argv))
        from app.budget.kube import api_client

        api = api_client()
        if api is None:
            raise UserError(
                "no Kubernetes API here (no service-account token, no kubeconfig) to watch the training job"
            )
        return run(s, api)

    return guarded(go, prefix="export")


if __name__ == "__main__":
    sys.exit(main())
