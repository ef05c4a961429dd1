"""What a network plugin that enforces NetworkPolicies lets through, by the API's rules (networking.k8s.io/v1,
the NetworkPolicy reference of the Kubernetes docs), for the chart tests: no cluster here, so the rendered
policies are read the way Calico or Cilium reads them.

- A pod is isolated for ingress (egress) when a policy of its namespace selects it with Ingress (Egress)
  in policyTypes (unset: Ingress, plus Egress when the policy has egress rules). An isolated pod accepts
  (opens) a connection only when a rule of one of those policies allows it; a connection needs both ends.
- A rule without `from`/`to` matches every peer, one without `ports` every port. A peer's podSelector
  alone means pods of the policy's namespace; with a namespaceSelector, pods of the namespaces selected;
  a namespaceSelector alone, every pod of those namespaces; an ipBlock, addresses (outside the cluster).
- Traffic from the pod's own node (the kubelet's probes) is always allowed: not modelled here.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Endpoint:
    """A pod (namespace and labels) or an address outside the cluster (ip alone)."""

    namespace: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    ip: str | None = None
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.namespace is not None:
            self.namespace_labels = {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector ({} selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict[str, Any], policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.ip is None:
            return False
        ip = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        net = ipaddress.ip_network(block["cidr"])
        if ip.version != net.version or ip not in net:
            return False
        return not any(
            ip in ipaddress.ip_network(e)
            for e in block.get("except", [])
            if ip.version == ipaddress.ip_network(e).version
        )
    if other.namespace is None:  # an address outside the cluster matches no pod selector
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.namespace_labels):
            return False
    elif other.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], other.labels)


def port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        assert isinstance(p["port"], int), "named ports are not modelled (the chart uses numbers)"
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def _types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])


def _side_allows(
    policies: list[dict], pod: Endpoint, other: Endpoint, port: int, protocol: str, kind: str
) -> bool:
    """Does `pod` accept (Ingress) or open (Egress) this connection with `other`?"""
    if pod.namespace is None:  # outside the cluster: no policy applies
        return True
    mine = [
        p
        for p in policies
        if p["metadata"].get("namespace", "default") == pod.namespace
        and selects(p["spec"]["podSelector"], pod.labels)
        and kind in _types(p)
    ]
    if not mine:
        return True
    key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    for p in mine:
        ns = p["metadata"].get("namespace", "default")
        for rule in p["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if (not peers or any(peer_matches(peer, ns, other) for peer in peers)) and port_matches(
                rule.get("ports"), port, protocol
            ):
                return True
    return False


def allowed(policies: list[dict], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """May `src` connect to `dst` on `port`? Both the source's egress and the destination's ingress."""
    return _side_allows(policies, src, dst, port, protocol, "Egress") and _side_allows(
        policies, dst, src, port, protocol, "Ingress"
    )


def isolated(policies: list[dict], pod: Endpoint, kind: str = "Ingress") -> bool:
    return any(
        p["metadata"].get("namespace", "default") == pod.namespace
        and selects(p["spec"]["podSelector"], pod.labels)
        and kind in _types(p)
        for p in policies
    )
