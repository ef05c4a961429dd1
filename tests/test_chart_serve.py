"""The chart's inference server (serve.enabled): a Deployment + Service that mount the checkpoint PVC
read-only and run `pretrain serve` on the run's best checkpoint; rendered by the real helm binary,
validated strictly, its arguments parsed by the real CLI, its wait script executed."""

from __future__ import annotations

import os
import subprocess
import time

import k8s_helpers as h
import pytest

from app.cli import build_parser
from tests.procs import Proc

ON = {"serve.enabled": True}


def serve_objects(values: dict) -> tuple[dict, dict, list[dict]]:
    docs = h.render(values)
    dep = h.one(docs, "Deployment")
    svc = [d for d in h.by_kind(docs, "Service") if d["metadata"]["name"].endswith("-serve")]
    assert len(svc) == 1
    return dep, svc[0], docs


def test_off_by_default():
    docs = h.render()
    assert not h.by_kind(docs, "Deployment")
    assert not [d for d in h.by_kind(docs, "Service") if d["metadata"]["name"].endswith("-serve")]


def test_deployment_serves_the_best_checkpoint_from_the_read_only_claim():
    dep, svc, docs = serve_objects(ON)
    h.validate_all(docs)
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    assert args[0] == "serve"
    parsed = build_parser("serve").parse_args(args)  # the chart speaks the CLI's language
    assert parsed.checkpoint == "/ckpt/pretrain" and parsed.which == "best" and parsed.host == "0.0.0.0"
    assert parsed.device == "cpu" and parsed.port == 8000 and parsed.model_name == "pretrain"
    (vol,) = pod["volumes"]
    pvc = {d["metadata"]["name"] for d in h.by_kind(docs, "PersistentVolumeClaim")}
    assert vol["persistentVolumeClaim"] == {"claimName": "pretrain-ckpt", "readOnly": True}
    assert "pretrain-ckpt" in pvc  # the training run's checkpoint claim, not a new one
    for container in [c, *pod["initContainers"]]:
        assert container["volumeMounts"] == [{"name": "ckpt", "mountPath": "/ckpt", "readOnly": True}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    # the Service reaches the server pods and nothing else
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "serve"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_gpu_named_checkpoint_and_existing_claim():
    dep, _, docs = serve_objects(
        {
            **ON,
            "serve.gpus": 1,
            "serve.checkpoint": "older-run/checkpoints/step_001000",
            "serve.which": "latest",
            "serve.modelName": "tiny-chat",
            "storage.checkpoints.existingClaim": "team-ckpt",
            "serve.extraArgs": ["--max-body-bytes", "65536"],
        }
    )
    h.validate_all(docs)
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    parsed = build_parser("serve").parse_args(c["args"])
    assert parsed.checkpoint == "/ckpt/older-run/checkpoints/step_001000" and parsed.which == "latest"
    assert parsed.device == "cuda" and parsed.model_name == "tiny-chat" and parsed.max_body_bytes == 65536
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "team-ckpt"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"serve.which": "worst"}, "which"),
        ({"serve.checkpoint": "/etc"}, "checkpoint"),
        ({"serve.checkpoint": "../other-namespace"}, "without '..'"),
        ({"serve.port": 0}, "port"),
        ({"serve.gpus": -1}, "gpus"),
        ({"serve.service.type": "ExternalName"}, "type"),
    ],
)
def test_bad_values_are_refused(values, message):
    assert message in h.render_error({**ON, **values})


def test_the_wait_script_waits_for_a_checkpoint(tmp_path):
    dep, _, _ = serve_objects(ON)
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][:2] == ["bash", "-c"]
    script = init["command"][2].replace("/ckpt/", f"{tmp_path}/")
    proc = Proc(["bash", "-c", script], env=dict(os.environ))
    time.sleep(1)
    assert proc.poll() is None  # no checkpoint yet: still waiting
    proc.stop()
    step = tmp_path / "pretrain" / "checkpoints" / "step_000100"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    assert subprocess.run(["bash", "-c", script], timeout=10).returncode == 0


def test_notes_say_how_to_reach_the_server(tmp_path):
    import os

    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run(
        [
            h.helm_binary(),
            "install",
            "pretrain",
            str(h.CHART),
            "--dry-run=client",
            "--set",
            "serve.enabled=true",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "Deployment pretrain-serve serves the best checkpoint of /ckpt/pretrain" in notes
    assert "port-forward svc/pretrain-serve 8000:8000" in notes


@pytest.mark.parametrize("kind", ["PodMonitor", "ServiceMonitor"])
def test_the_opt_in_monitor_scrapes_the_server(kind):
    """serve.enabled exposes pretrain_serve_* on /metrics of its http port: the opt-in monitor scrapes it
    (its own object, selecting the server pods or Service only), also with no training job."""
    key = "podMonitor" if kind == "PodMonitor" else "serviceMonitor"
    values = {**ON, f"metrics.{key}.enabled": True, f"metrics.{key}.labels": {"release": "kps"}}
    dep, svc, docs = serve_objects(values)
    h.validate_all(docs)
    monitors = {m["metadata"]["name"]: m for m in h.by_kind(docs, kind)}
    assert set(monitors) == {"pretrain", "pretrain-serve"}
    mon = monitors["pretrain-serve"]
    assert mon["metadata"]["labels"]["release"] == "kps"
    assert mon["spec"]["jobLabel"] == "app.kubernetes.io/instance"
    assert mon["spec"]["namespaceSelector"] == {"matchNames": ["default"]}
    (endpoint,) = mon["spec"]["podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    selector = mon["spec"]["selector"]["matchLabels"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    if kind == "PodMonitor":
        target_labels, ports = dep["spec"]["template"]["metadata"]["labels"], c["ports"]
    else:
        target_labels, ports = svc["metadata"]["labels"], svc["spec"]["ports"]
        assert svc["spec"]["ports"][0]["targetPort"] == endpoint["port"]
    assert selector.items() <= target_labels.items(), "the monitor selects the server"
    assert endpoint["port"] in [p["name"] for p in ports]
    (http,) = [p for p in c["ports"] if p["name"] == "http"]
    assert c["args"][c["args"].index("--port") + 1] == str(http["containerPort"])  # the app's port
    # the trainer's monitor does not select the server, nor the server's the trainer pods
    job = h.one(docs, "PyTorchJob")
    trainer_labels = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]
    assert not selector.items() <= trainer_labels.items()
    assert not monitors["pretrain"]["spec"]["selector"]["matchLabels"].items() <= target_labels.items()
    # serving a finished run, no training job: the server is still scraped
    alone = h.render({**values, "job.enabled": False})
    assert [m["metadata"]["name"] for m in h.by_kind(alone, kind)] == ["pretrain-serve"]
    assert [m["metadata"]["name"] for m in h.by_kind(h.render({f"metrics.{key}.enabled": True}), kind)] == [
        "pretrain"
    ]


# ---------------------------------------------------------------- the API key from a Secret

KEYED = {**ON, "serve.apiKey.existingSecret": "pretrain-api-key"}


def kubelet_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: secretKeyRef values from `secrets`
    (name -> data), then $(NAME) references to variables defined earlier expanded ($$ escapes)."""
    import re

    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            env[var["name"]] = re.sub(
                r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                var["value"],
            )
    return env


def test_the_key_comes_from_the_secret_and_prometheus_sends_it():
    values = {**KEYED, "metrics.podMonitor.enabled": True}
    dep, _, docs = serve_objects(values)
    h.validate_all(docs)
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["env"] == [
        {
            "name": "PRETRAIN_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "pretrain-api-key", "key": "api-key"}},
        }
    ]
    assert not build_parser("serve").parse_args(c["args"]).api_key, "never in the arguments"
    mon = [m for m in h.by_kind(docs, "PodMonitor") if m["metadata"]["name"] == "pretrain-serve"][0]
    (endpoint,) = mon["spec"]["podMetricsEndpoints"]
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "pretrain-api-key", "key": "api-key"},
    }
    svc_values = {
        **KEYED,
        "metrics.serviceMonitor.enabled": True,
        "serve.apiKey.metricsSecretKey": "prometheus",
    }
    docs = h.render(svc_values)
    mon = [m for m in h.by_kind(docs, "ServiceMonitor") if m["metadata"]["name"] == "pretrain-serve"][0]
    assert mon["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": "pretrain-api-key",
        "key": "prometheus",
    }
    trainer_mon = [m for m in h.by_kind(docs, "ServiceMonitor") if m["metadata"]["name"] == "pretrain"][0]
    assert all("authorization" not in e for e in trainer_mon["spec"]["endpoints"])
    (c,) = h.one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    got = kubelet_env(c, {"pretrain-api-key": {"api-key": "k-1,k-2", "prometheus": "k-prom"}})
    assert got["PRETRAIN_API_KEY"] == "k-1,k-2,k-prom"
    # the Secret is read by the server's environment and the monitor, and by nothing else
    assert {d["kind"] for d in docs if "pretrain-api-key" in str(d)} == {"Deployment", "ServiceMonitor"}
    # without a Secret: no key, no authorization
    dep, _, docs = serve_objects({**ON, "metrics.podMonitor.enabled": True})
    assert "env" not in dep["spec"]["template"]["spec"]["containers"][0]
    assert "authorization" not in str(h.by_kind(docs, "PodMonitor"))


@pytest.mark.parametrize("kind", ["LoadBalancer", "NodePort"])
def test_an_exposed_service_without_a_key_fails_the_render_in_one_line(kind):
    err = h.render_error({**ON, "serve.service.type": kind})
    (line,) = [x for x in err.splitlines() if f"serve.service.type={kind}" in x]
    assert "serve.apiKey.existingSecret" in line and "serve.allowUnauthenticated=true" in line
    for values in (KEYED, {**ON, "serve.allowUnauthenticated": True}):
        _, svc, docs = serve_objects({**values, "serve.service.type": kind})
        h.validate_all(docs)
        assert svc["spec"]["type"] == kind
    _, svc, _ = serve_objects(ON)  # ClusterIP without a key: in the cluster only
    assert svc["spec"]["type"] == "ClusterIP"


def test_notes_show_the_client_call_with_the_key(tmp_path):
    notes = install_notes(tmp_path, KEYED)
    assert "get secret pretrain-api-key -o go-template='{{index .data \"api-key\" | base64decode}}'" in notes
    assert 'curl localhost:8000/v1/completions -H "Authorization: Bearer $OPENAI_API_KEY"' in notes
    assert 'OpenAI(base_url="http://localhost:8000/v1")' in notes
    assert "No API key" in install_notes(tmp_path, ON)


def install_notes(tmp_path, values: dict) -> str:
    import os

    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    sets = [a for k, v in values.items() for a in ("--set", f"{k}={str(v).lower() if v is True else v}")]
    proc = subprocess.run(
        [h.helm_binary(), "install", "pretrain", str(h.CHART), "--dry-run=client", *sets],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


@pytest.mark.slow  # a server (~10 s on 2 cores)
def test_the_rendered_environment_serves_with_the_secrets_keys(tmp_path):
    """The real server, started with the environment the chart renders (a Secret's values filled in,
    $(...) expanded as the kubelet does): the clients' keys call the model, Prometheus's key (the one the
    monitor names) scrapes /metrics, a wrong key gets 401; the NOTES' python call works with the key."""
    import os
    import shlex
    import sys
    import urllib.error
    import urllib.request

    from tests.inference_helpers import trained_run
    from tests.test_serve import start_server, stop_server

    pytest.importorskip("openai", reason="the serve tests need the serve extra (make setup)")
    values = {**KEYED, "serve.apiKey.metricsSecretKey": "prometheus", "metrics.podMonitor.enabled": True}
    docs = h.render(values)
    (c,) = h.one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    secret = {"api-key": "sk-client-a, sk-client-b", "prometheus": "sk-prometheus"}
    env = kubelet_env(c, {"pretrain-api-key": secret})
    mon = [m for m in h.by_kind(docs, "PodMonitor") if m["metadata"]["name"] == "pretrain-serve"][0]
    scrape_key = secret[mon["spec"]["podMetricsEndpoints"][0]["authorization"]["credentials"]["key"]]

    def status(url: str, key: str) -> int:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    url, proc = start_server("--checkpoint", str(trained_run()), "--model-name", "pretrain", env=env)
    try:
        assert status(f"{url}/metrics", scrape_key) == 200
        for key in ("sk-client-a", "sk-client-b"):
            assert status(f"{url}/v1/models", key) == 200
        assert status(f"{url}/v1/models", "sk-client-c") == 401 and status(f"{url}/metrics", "") == 401
        notes = install_notes(tmp_path, values)
        (line,) = [x.strip() for x in notes.splitlines() if x.strip().startswith("python -c")]
        argv = shlex.split(line.replace("http://localhost:8000", url))
        out = subprocess.run(
            [sys.executable, *argv[1:]],
            env={**os.environ, "OPENAI_API_KEY": "sk-client-b"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
    finally:
        stop_server(proc)
