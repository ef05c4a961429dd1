"""Optional Kubernetes actions: Events on the job (a PyTorchJob, or a Kubeflow Trainer v2 TrainJob) for
alerts and stops, and, as the last resort when the trainer ignores an immediate stop, suspending it. The
prepare side (app/data/prepare_job.py) uses the same door to release the job it created suspended, and
to say in the job's DataReady condition whether its data is ready.

Under Kueue (the job carries the label kueue.x-k8s.io/queue-name) a suspend would not hold, so the last
resort deactivates the job's Workload instead (why: docs/kubernetes.md, "Kueue").

A failed API call is logged and never stops the watcher: the stop file is the primary path. RBAC:
docs/budget.md, "Kubernetes actions and RBAC" (under Kueue also workloads: list, patch).
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.config.budget import BudgetConfig
from app.errors import UserError

log = logging.getLogger("pretrain.budget")

# kind -> (group, version, plural, where its suspend field is)
JOB_KINDS = {
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs", ("spec", "runPolicy", "suspend")),
    "TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs", ("spec", "suspend")),
}
DATA_READY = "DataReady"  # the job's condition: is its data ready (set by the prepare side)
READY_ANNOTATION = "pretrain/data-ready"  # the data fingerprint the job was released for (the chart reads it)
KUEUE_GROUP, KUEUE_VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta1", "workloads"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
COMPONENT = "pretrain-budget-watcher"
TIMED = {"_request_timeout": 5.0}  # every API call
MERGE_PATCH = {**TIMED, "_content_type": "application/merge-patch+json"}


def _namespace(cfg: BudgetConfig) -> str:
    if namespace := cfg.namespace or os.environ.get("POD_NAMESPACE"):
        return namespace
    try:
        return SA_NAMESPACE.read_text().strip()
    except OSError:
        return "default"


def has_token() -> bool:
    """In a pod whose service-account token is mounted (the chart mounts it only where the API is called)."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and SA_TOKEN.exists()


def api_client() -> Any | None:
    """The Kubernetes API client of every caller (the watcher, the wait step, the prepare's finalizer): in a
    pod ($KUBERNETES_SERVICE_HOST), its service-account token; elsewhere $KUBECONFIG, else ~/.kube/config.
    None outside a pod without a kubeconfig. Credentials the client cannot load (a pod without its token, a
    broken or missing kubeconfig) are a UserError: one line that names them."""
    from kubernetes import client, config

    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    # read now: the client reads $KUBECONFIG once, at its import
    kubeconfig = os.environ.get("KUBECONFIG") or "~/.kube/config"
    if not in_pod and "KUBECONFIG" not in os.environ and not Path(kubeconfig).expanduser().exists():
        return None
    try:
        if in_pod:
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kubeconfig)
    except Exception as e:  # the client raises several types for a missing or invalid configuration
        where = f"the service-account token {SA_TOKEN}" if in_pod else kubeconfig
        raise UserError(f"cannot load the Kubernetes credentials from {where}: {short_error(e)}") from None
    return client.ApiClient()


class KubeActions:
    def __init__(
        self,
        namespace: str,
        job_name: str,
        api_client: Any,
        component: str = COMPONENT,
        prefix: str = "budget",
        kind: str = "PyTorchJob",
    ):
        from kubernetes import client

        self.namespace, self.job_name, self.kind = namespace, job_name, kind
        self.ref = f"{kind} {namespace}/{job_name}"  # for log lines
        self.group, self.version, self.plural, self.suspend_path = JOB_KINDS[kind]
        self.component, self.prefix = component, prefix  # Events are named <job>-<prefix>-<random>
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._job: dict | None = None

    @classmethod
    def from_config(cls, cfg: BudgetConfig, **names: str) -> KubeActions | None:
        """None when actions are off or there is no cluster; UserError when asked for (kube=on) but impossible.
        `names`: the Events' component and prefix, when not the budget watcher's."""
        in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        if cfg.kube == "off" or (cfg.kube == "auto" and not in_cluster):
            return None
        job = cfg.job_name or os.environ.get("PRETRAIN_JOB_NAME", "")
        kind = cfg.job_kind or os.environ.get("PRETRAIN_JOB_KIND", "") or "PyTorchJob"
        if kind not in JOB_KINDS:
            raise UserError(f"job kind {kind!r} ($PRETRAIN_JOB_KIND) is not one of: {', '.join(JOB_KINDS)}")
        if not job:
            if cfg.kube == "on":
                raise UserError("budget.kube=on needs the job's name: --job-name NAME or $PRETRAIN_JOB_NAME")
            log.info("budget: in a cluster but no job name ($PRETRAIN_JOB_NAME); Kubernetes actions off")
            return None
        try:
            api = api_client()
        except UserError as e:
            if cfg.kube == "on":
                raise UserError(f"budget.kube=on but {e}") from None
            log.warning("budget: %s; Kubernetes actions off", e)
            return None
        if api is None:
            raise UserError("budget.kube=on but no Kubernetes credentials: no $KUBECONFIG, no ~/.kube/config")
        return cls(_namespace(cfg), job, api, kind=kind, **names)

    def _job_meta(self) -> dict:
        """The job's metadata (fetched once), or {} when it cannot be read: a failed read is logged
        and the caller carries on without (an Event without uid still shows; a plain suspend is tried)."""
        if self._job is None:
            try:
                job = self.custom.get_namespaced_custom_object(
                    self.group, self.version, self.namespace, self.plural, self.job_name, **TIMED
                )
                self._job = dict(job.get("metadata", {}))
            except Exception as e:  # no 'get' permission or job gone
                log.warning("budget: cannot read %s: %s", self.ref, short_error(e))
                return {}
        return self._job

    def _patch(self, group: str, version: str, plural: str, name: str, body: dict) -> None:
        self.custom.patch_namespaced_custom_object(
            group, version, self.namespace, plural, name, body, **MERGE_PATCH
        )

    def event(self, reason: str, message: str, kind: str = "Warning") -> bool:
        """An Event on the job (shows in `kubectl describe pytorchjob|trainjob`); True when posted."""
        try:
            uid = str(self._job_meta().get("uid", ""))
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            involved = {
                "apiVersion": f"{self.group}/{self.version}",
                "kind": self.kind,
                "name": self.job_name,
                "namespace": self.namespace,
                **({"uid": uid} if uid else {}),
            }
            body = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{self.job_name}-{self.prefix}-", "namespace": self.namespace},
                "involvedObject": involved,
                "reason": reason,
                "message": message[:1024],
                "type": kind,
                "source": {"component": self.component},
                "reportingComponent": self.component,
                "reportingInstance": os.environ.get("HOSTNAME", self.component),
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
            self.core.create_namespaced_event(self.namespace, body, **TIMED)
            return True
        except Exception as e:
            log.warning("budget: cannot create Event %s on %s: %s", reason, self.job_name, short_error(e))
            return False

    def suspend(self) -> bool:
        """Suspend (a merge patch): the operator deletes the pods and keeps the job. Under Kueue: deactivate
        the job's Workload instead (see the module docstring)."""
        if (self._job_meta().get("labels") or {}).get(QUEUE_LABEL):
            return self._deactivate_workload()
        try:
            self._patch(
                self.group, self.version, self.plural, self.job_name, _nested(self.suspend_path, True)
            )
            return True
        except Exception as e:
            log.error("budget: cannot suspend %s: %s", self.ref, short_error(e))
            return False

    def release(self, fingerprint: str, queue: str = "") -> None:
        """Let the job, created suspended, start; raises the client's error. Under Kueue (a queue named) add
        its queue label instead and leave `suspend` to Kueue, which owns it and clears it on admission:
        the job joins the queue only now. The annotation records the data it was released for."""
        meta: dict = {"annotations": {READY_ANNOTATION: fingerprint}}
        if queue:
            meta["labels"] = {QUEUE_LABEL: queue}
            body = {"metadata": meta}
        else:
            body = {"metadata": meta, **_nested(self.suspend_path, False)}
        self._patch(self.group, self.version, self.plural, self.job_name, body)

    def set_condition(self, ready: bool, reason: str, message: str) -> None:
        """The DataReady condition in the job's status (`kubectl describe` lists it), the operator's own
        conditions kept: read the job, replace ours, and patch with the resourceVersion read, so that a
        concurrent update of the operator is not lost (a conflict reads again). Raises the client's error."""
        from kubernetes.client.exceptions import ApiException

        status = "True" if ready else "False"
        for attempt in range(3):
            job = self.custom.get_namespaced_custom_object(
                self.group, self.version, self.namespace, self.plural, self.job_name, **TIMED
            )
            conditions = (job.get("status") or {}).get("conditions") or []
            old = next((c for c in conditions if c.get("type") == DATA_READY), {})
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            ours = {
                "type": DATA_READY,
                "status": status,
                "reason": reason,
                "message": message[:1024],
                "lastTransitionTime": old.get("lastTransitionTime", now)
                if old.get("status") == status
                else now,
            }
            # a PyTorchJob's JobCondition has one more time; a TrainJob's metav1.Condition not
            if self.kind == "PyTorchJob":
                ours["lastUpdateTime"] = now
            body = {
                "metadata": {"resourceVersion": job["metadata"]["resourceVersion"]},
                "status": {"conditions": [c for c in conditions if c.get("type") != DATA_READY] + [ours]},
            }
            try:
                self.custom.patch_namespaced_custom_object_status(
                    self.group, self.version, self.namespace, self.plural, self.job_name, body, **MERGE_PATCH
                )
                return
            except ApiException as e:
                if e.status != 409 or attempt == 2:
                    raise

    def _deactivate_workload(self) -> bool:
        """spec.active=false on the Kueue Workload owned by this job (found by Kueue's job-uid label, or
        by its owner reference on Kueue versions without that label)."""
        uid = str(self._job_meta().get("uid", ""))

        def workloads(**selector: str) -> list:
            return self.custom.list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, self.namespace, WORKLOADS, **TIMED, **selector
            ).get("items", [])

        try:
            found = workloads(label_selector=f"{JOB_UID_LABEL}={uid}") or [
                w
                for w in workloads()
                if any(o.get("uid") == uid for o in w.get("metadata", {}).get("ownerReferences", []))
            ]
            if not found:
                log.error("budget: no Kueue Workload owned by %s %s (uid %s)", self.kind, self.job_name, uid)
                return False
            name = found[0]["metadata"]["name"]
            self._patch(KUEUE_GROUP, KUEUE_VERSION, WORKLOADS, name, {"spec": {"active": False}})
            log.error("budget: deactivated Kueue Workload %s of %s %s", name, self.kind, self.job_name)
            return True
        except Exception as e:
            log.error("budget: cannot deactivate the Kueue Workload of %s: %s", self.job_name, short_error(e))
            return False


def _nested(path: tuple[str, ...], value: object) -> dict:
    """{"a": {"b": value}} for ("a", "b")."""
    for key in reversed(path):
        value = {key: value}
    return value  # type: ignore[return-value]


def short_error(e: Exception) -> str:
    if status := getattr(e, "status", None):  # the client's ApiException
        return f"HTTP {status} {getattr(e, 'reason', None) or ''}".strip()
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def post_event(cfg: BudgetConfig, reason: str, message: str, warn=log.warning) -> bool:
    """A Warning Event on the job from the trainer, when it has API access (budget.kube); True when posted.
    Never raises: the exit code and metrics.jsonl carry the same fact, and a budget watcher relays it
    from status.json where the trainer has no API token (the chart's pods)."""
    try:
        kube = KubeActions.from_config(cfg, component="pretrain-trainer", prefix="trainer")
        if kube is not None:
            return kube.event(reason, message)
    except Exception as e:  # noqa: BLE001 - an Event is an extra
        warn(f"warning: cannot post the {reason} Event: {short_error(e)}")
    return False
