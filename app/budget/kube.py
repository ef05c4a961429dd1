"""Optional Kubernetes actions: Events on the PyTorchJob for alerts and stops, and, as the last resort when
the trainer ignores an immediate stop, suspending the PyTorchJob (spec.runPolicy.suspend: true).

Only inside a cluster (KUBERNETES_SERVICE_HOST set) or with budget.kube=on. A failed API call is logged and
never stops the watcher: the stop file is the primary path, these are extras.

RBAC (namespaced Role for the pod's service account):
  - apiGroups [""], resources [events], verbs [create]
  - apiGroups [kubeflow.org], resources [pytorchjobs], verbs [get, patch]
"""

from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.budget.config import BudgetConfig
from app.errors import UserError

log = logging.getLogger("pretrain.budget")

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
COMPONENT = "pretrain-budget-watcher"
TIMEOUT = 5.0


def _namespace(cfg: BudgetConfig) -> str:
    if cfg.namespace:
        return cfg.namespace
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return SA_NAMESPACE.read_text().strip()
    except OSError:
        return "default"


class KubeActions:
    def __init__(self, namespace: str, job_name: str, api_client: Any):
        from kubernetes import client

        self.namespace = namespace
        self.job_name = job_name
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._uid: str | None = None

    @classmethod
    def from_config(cls, cfg: BudgetConfig) -> KubeActions | None:
        """None when actions are off or there is no cluster; UserError when asked for (kube=on) but impossible."""
        in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        if cfg.kube == "off" or (cfg.kube == "auto" and not in_cluster):
            return None
        job = cfg.job_name or os.environ.get("PRETRAIN_JOB_NAME", "")
        if not job:
            if cfg.kube == "on":
                raise UserError(
                    "budget.kube=on needs the PyTorchJob name: --job-name NAME or $PRETRAIN_JOB_NAME"
                )
            log.info(
                "budget: in a cluster but no PyTorchJob name ($PRETRAIN_JOB_NAME); Kubernetes actions off"
            )
            return None
        from kubernetes import client, config

        try:
            if in_cluster:
                config.load_incluster_config()
            else:
                config.load_kube_config()
        except Exception as e:  # the client raises several types for a missing/invalid config
            if cfg.kube == "on":
                raise UserError(f"budget.kube=on but no Kubernetes credentials: {e}") from None
            log.warning("budget: cannot load Kubernetes credentials (%s); Kubernetes actions off", e)
            return None
        return cls(_namespace(cfg), job, client.ApiClient())

    def _job_uid(self) -> str:
        if self._uid is None:
            job = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.job_name, _request_timeout=TIMEOUT
            )
            self._uid = str(job.get("metadata", {}).get("uid", ""))
        return self._uid

    def event(self, reason: str, message: str, warning: bool = True) -> bool:
        """A core/v1 Event on the PyTorchJob (shows in `kubectl describe pytorchjob`)."""
        try:
            try:
                uid = self._job_uid()
            except Exception as e:  # no 'get' permission or job gone: an Event without uid still shows
                log.warning(
                    "budget: cannot read PyTorchJob %s/%s: %s", self.namespace, self.job_name, _short(e)
                )
                uid = ""
            now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            involved = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": self.job_name,
                "namespace": self.namespace,
            }
            if uid:
                involved["uid"] = uid
            body = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{self.job_name}-budget-", "namespace": self.namespace},
                "involvedObject": involved,
                "reason": reason,
                "message": message[:1024],
                "type": "Warning" if warning else "Normal",
                "source": {"component": COMPONENT},
                "reportingComponent": COMPONENT,
                "reportingInstance": os.environ.get("HOSTNAME", COMPONENT),
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
            self.core.create_namespaced_event(self.namespace, body, _request_timeout=TIMEOUT)
            return True
        except Exception as e:
            log.warning("budget: cannot create Event %s on %s: %s", reason, self.job_name, _short(e))
            return False

    def suspend(self) -> bool:
        """spec.runPolicy.suspend=true (merge patch): the operator deletes the pods and keeps the job."""
        try:
            self.custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                self.job_name,
                {"spec": {"runPolicy": {"suspend": True}}},
                _request_timeout=TIMEOUT,
                _content_type="application/merge-patch+json",
            )
            return True
        except Exception as e:
            log.error("budget: cannot suspend PyTorchJob %s/%s: %s", self.namespace, self.job_name, _short(e))
            return False


def _short(e: Exception) -> str:
    status = getattr(e, "status", None)
    reason = getattr(e, "reason", None)
    if status:
        return f"HTTP {status} {reason or ''}".strip()
    return str(e).splitlines()[0] if str(e) else type(e).__name__
