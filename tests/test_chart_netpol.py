"""The chart's NetworkPolicies (networkPolicy.*), rendered by the real helm binary, validated strictly
against the Kubernetes NetworkPolicy schema (kubernetes-validate, oldest and newest supported version), and
read by tests/netpol.py the way an enforcing network plugin reads them: who may connect to the trainer pods
of both operators (gpus 1 and 16), the prepare pods and the inference server, and where they may connect to
under networkPolicy.restrictEgress. What a real plugin does is checked on a cluster (docs/kubernetes.md)."""

from __future__ import annotations

import k8s_helpers as h
import pytest
from netpol import Endpoint, allowed, isolated

NS = "default"
PROMETHEUS = Endpoint("monitoring", {"app.kubernetes.io/name": "prometheus", "prometheus": "kps"})
NEIGHBOUR = Endpoint(NS, {"app": "notebook"})  # another workload of the release's namespace
STRANGER = Endpoint("other-team", {"app": "batch"})
INTERNET = Endpoint(ip="203.0.113.7")
KUBE_DNS = Endpoint("kube-system", {"k8s-app": "kube-dns"})
API_SERVER = Endpoint(ip="10.0.0.5")
HF_HUB = Endpoint(ip="18.164.174.17")  # a public address (a CDN's)
METADATA = Endpoint(ip="169.254.169.254")
PRIVATE = Endpoint(ip="10.20.30.40")
NCCL = 45113  # NCCL and gloo listen on ports picked at run time
SERVE = {"serve.enabled": True}
API = {"networkPolicy.egress.apiServer": [{"ipBlock": {"cidr": "10.0.0.5/32"}}]}


def render(scheduler: str, values: dict | None = None) -> list[dict]:
    docs = h.render({"scheduler": scheduler, **SERVE, **(values or {})})
    h.validate_all(docs)  # NetworkPolicy against the Kubernetes schema, strict
    return docs


def policies(docs: list[dict]) -> list[dict]:
    return h.by_kind(docs, "NetworkPolicy")


def pods(docs: list[dict]) -> dict[str, list[tuple[Endpoint, dict]]]:
    """The release's pods by component (trainer, bench, prepare, serve, test): (endpoint, pod spec). A
    replica template stands for each of its pods; a TrainJob's one `node` template for numNodes pods."""
    out: dict[str, list[tuple[Endpoint, dict]]] = {}
    found = [
        (meta, spec) for (_, meta), (_, spec) in zip(h.pod_templates(docs), h.pod_specs(docs), strict=True)
    ]
    for dep in h.by_kind(docs, "Deployment"):
        found.append((dep["spec"]["template"]["metadata"], dep["spec"]["template"]["spec"]))
    for meta, spec in found:
        component = meta["labels"]["app.kubernetes.io/component"]
        out.setdefault(component, []).append((Endpoint(NS, dict(meta["labels"])), spec))
    return out


def container_ports(spec: dict) -> set[int]:
    return {
        p["containerPort"]
        for c in spec["containers"] + spec.get("initContainers", [])
        for p in c.get("ports", [])
    }


def other_release(pod: Endpoint) -> Endpoint:
    return Endpoint(NS, {**pod.labels, "app.kubernetes.io/instance": "other"})


@pytest.mark.parametrize("scheduler", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("gpus", [1, 16])
def test_policies_render_validate_and_let_only_the_job_and_prometheus_in(scheduler, gpus):
    docs = render(scheduler, {"gpus": gpus})
    nps = policies(docs)
    assert sorted(p["metadata"]["name"] for p in nps) == [
        "pretrain-prepare",
        "pretrain-serve",
        "pretrain-trainer",
    ]
    by = pods(docs)
    trainers = by["trainer"]
    assert len(trainers) == (1 if gpus == 1 or scheduler == "trainjob" else 2)  # Master (+ Worker)
    (prepare, _), (serve, serve_spec) = by["prepare"][0], by["serve"][0]
    for pod, _ in [*trainers, *by["prepare"], (serve, None)]:  # the prepare pods and their finalizer
        assert isolated(nps, pod), pod.labels
        assert not isolated(nps, pod, "Egress"), "egress stays open by default"
    rendezvous = 23456 if scheduler == "pytorchjob" else 29400  # the operators' MASTER_PORT
    for dst, spec in trainers:
        for src, _ in trainers:  # every node reaches every node: the rendezvous and the collectives
            assert allowed(nps, src, dst, rendezvous) and allowed(nps, src, dst, NCCL)
        declared = container_ports(spec)
        metrics = {9400, 9401} & declared
        assert 9400 in metrics and (9401 in metrics) == (
            dst.labels["pretrain/replica-type"] in ("master", "node")
        )
        for port in metrics:  # Prometheus scrapes the metrics ports, and nothing else
            assert allowed(nps, PROMETHEUS, dst, port)
        for port in (rendezvous, NCCL, 22):
            assert not allowed(nps, PROMETHEUS, dst, port)
        for outsider in (NEIGHBOUR, STRANGER, INTERNET, prepare, serve, other_release(dst)):
            for port in (rendezvous, NCCL, 9400, 9401):
                assert not allowed(nps, outsider, dst, port), (outsider, port)
        assert allowed(nps, dst, INTERNET, 443), "egress is open"
    for src in (NEIGHBOUR, PROMETHEUS, trainers[0][0], serve, STRANGER):
        assert not allowed(nps, src, prepare, 8080)
    assert allowed(nps, prepare, HF_HUB, 443)
    # the inference server: its port from the namespace's pods and Prometheus, nothing else
    (port,) = container_ports(serve_spec)
    assert port == 8000
    for src in (NEIGHBOUR, trainers[0][0], PROMETHEUS):
        assert allowed(nps, src, serve, port)
    assert not allowed(nps, NEIGHBOUR, serve, 9000)
    for src in (STRANGER, INTERNET):
        assert not allowed(nps, src, serve, port)


@pytest.mark.parametrize("scheduler", ["pytorchjob", "trainjob"])
def test_restricted_egress_dns_peers_api_server_and_downloads_only(scheduler):
    docs = render(scheduler, {"gpus": 16, "networkPolicy.restrictEgress": True, **API})
    nps = policies(docs)
    by = pods(docs)
    (prepare, _), (serve, _) = by["prepare"][0], by["serve"][0]
    for trainer, _ in by["trainer"]:
        assert isolated(nps, trainer, "Egress")
        assert allowed(nps, trainer, KUBE_DNS, 53, "UDP") and allowed(nps, trainer, KUBE_DNS, 53, "TCP")
        for peer, _ in by["trainer"]:
            assert allowed(nps, trainer, peer, NCCL)
        assert allowed(nps, trainer, API_SERVER, 443) and allowed(nps, trainer, API_SERVER, 6443)
        for dst, port in ((HF_HUB, 443), (METADATA, 80), (PRIVATE, 443), (API_SERVER, 22), (serve, 8000)):
            assert not allowed(nps, trainer, dst, port), (dst, port)
        assert not allowed(nps, trainer, other_release(trainer), NCCL)
    assert allowed(nps, prepare, HF_HUB, 443) and allowed(nps, prepare, KUBE_DNS, 53, "UDP")
    # the pods that parse the downloads reach no API server; their finalizer, which releases the job, does
    (fin, _) = by["prepare"][1]
    assert fin.labels["pretrain/prepare-role"] == "finalizer"
    assert not allowed(nps, prepare, API_SERVER, 443) and allowed(nps, fin, API_SERVER, 443)
    assert allowed(nps, fin, KUBE_DNS, 53, "UDP") and allowed(
        nps, fin, HF_HUB, 443
    )  # sharded: hf:// listings
    for dst, port in (
        (HF_HUB, 80),
        (METADATA, 80),
        (PRIVATE, 443),
        (API_SERVER, 22),
        (by["trainer"][0][0], NCCL),
    ):
        assert not allowed(nps, prepare, dst, port), (dst, port)
    assert allowed(nps, serve, KUBE_DNS, 53, "UDP")
    for dst in (HF_HUB, API_SERVER, PRIVATE):
        assert not allowed(nps, serve, dst, 443)
    # a tracker (networkPolicy.egress.extraRules) and a narrowed DNS
    tracker = [{"to": [{"ipBlock": {"cidr": "35.186.0.0/16"}}], "ports": [{"port": 443, "protocol": "TCP"}]}]
    dns = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    docs = render(
        scheduler,
        {
            "networkPolicy.restrictEgress": True,
            **API,
            "networkPolicy.egress.extraRules": tracker,
            "networkPolicy.egress.dnsTo": dns,
        },
    )
    nps = policies(docs)
    trainer = pods(docs)["trainer"][0][0]
    assert allowed(nps, trainer, Endpoint(ip="35.186.1.2"), 443)
    assert allowed(nps, trainer, KUBE_DNS, 53, "UDP") and not allowed(nps, trainer, PRIVATE, 53, "UDP")


def test_restricted_egress_needs_the_api_servers_address_while_pods_call_it():
    err = h.render_error({"networkPolicy.restrictEgress": True})
    (line,) = [x for x in err.splitlines() if "networkPolicy.restrictEgress" in x]
    assert "networkPolicy.egress.apiServer" in line and "budget.watcher.kubernetesActions=false" in line
    quiet = {"budget.watcher.kubernetesActions": False, "prepare.wait.useKubernetesApi": False}
    err = h.render_error({"networkPolicy.restrictEgress": True, **quiet})
    assert "the prepare releases the training job (created suspended) through the API server" in err
    docs = render("pytorchjob", {"networkPolicy.restrictEgress": True, **quiet, **API})
    trainer = pods(docs)["trainer"][0][0]
    assert not allowed(policies(docs), trainer, API_SERVER, 443)
    (prepare, _), (fin, _) = pods(docs)["prepare"]
    assert allowed(policies(docs), fin, API_SERVER, 443)
    assert not allowed(policies(docs), prepare, API_SERVER, 443)
    own_data = {"prepare.enabled": False, "config": {"data": {"dataset": "/data/x"}}}
    docs = render("pytorchjob", {"networkPolicy.restrictEgress": True, **quiet, **own_data})
    assert not allowed(policies(docs), pods(docs)["trainer"][0][0], API_SERVER, 443)


def test_who_may_call_the_server_follows_the_service_type_and_values():
    key = {"serve.apiKey.existingSecret": "pretrain-api-key"}
    docs = render("pytorchjob", {"serve.service.type": "LoadBalancer", **key})
    serve = pods(docs)["serve"][0][0]
    assert allowed(policies(docs), INTERNET, serve, 8000) and allowed(policies(docs), STRANGER, serve, 8000)
    assert not allowed(policies(docs), INTERNET, serve, 8001)
    ingress_nginx = Endpoint("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"})
    only = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]
    docs = render("pytorchjob", {"networkPolicy.serveFrom": only, "serve.port": 8080})
    nps = policies(docs)
    assert allowed(nps, ingress_nginx, serve, 8080) and allowed(nps, PROMETHEUS, serve, 8080)
    assert not allowed(nps, NEIGHBOUR, serve, 8080)
    nps = policies(render("pytorchjob", {"networkPolicy.serveFrom": []}))
    assert not allowed(nps, NEIGHBOUR, serve, 8000) and allowed(nps, PROMETHEUS, serve, 8000)
    nps = policies(render("pytorchjob", {"networkPolicy.serveFrom": [], "networkPolicy.metricsFrom": []}))
    assert isolated(nps, serve) and not allowed(nps, PROMETHEUS, serve, 8000)


def test_metrics_from_and_off():
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    docs = render("trainjob", {"networkPolicy.metricsFrom": monitoring})
    trainer = pods(docs)["trainer"][0][0]
    assert allowed(policies(docs), Endpoint("monitoring", {"app": "vmagent"}), trainer, 9400)
    assert not allowed(policies(docs), Endpoint("observability", PROMETHEUS.labels), trainer, 9400)
    assert not policies(h.render({"networkPolicy.enabled": False, **SERVE}))


@pytest.mark.parametrize("scheduler", ["pytorchjob", "trainjob"])
def test_the_benchmark_pods_reach_each_other_only(scheduler):
    docs = h.render({"scheduler": scheduler, "bench.enabled": True, "gpus": 16})
    h.validate_all(docs)
    nps = policies(docs)
    assert [p["metadata"]["name"] for p in nps] == ["pretrain-bench"]
    bench = [pod for pod, _ in pods(docs)["bench"]]
    for pod in bench:
        assert isolated(nps, pod)
        assert all(allowed(nps, peer, pod, NCCL) for peer in bench)
        for outsider in (PROMETHEUS, NEIGHBOUR, other_release(pod)):
            assert not allowed(nps, outsider, pod, NCCL)
