"""Dashboards against a real Prometheus: a short local training (trainer + in-process budget watcher, both
exporters) is scraped by a private Prometheus on 127.0.0.1, then every PromQL query of every dashboard panel
must return data. The DCGM panels are the exception: there is no GPU (and no dcgm-exporter) here, so their
queries only have to be valid PromQL.

The fast tests check the dashboard JSON itself: importable, variables, filters, metric names, docs.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request

import pytest
import yaml

from tests.conftest import FAST, REPO, train_rows
from tests.procs import Proc
from tests.prom_helpers import (
    DASHBOARDS,
    RULES,
    Prometheus,
    alert_rules,
    dashboard_targets,
    exported_metric_names,
    free_port,
    metric_names,
    prometheus_missing,
    sets,
    substitute,
)

DOCS = REPO / "docs" / "observability.md"
FILTER = 'namespace=~"$namespace", job=~"$job"'


# ---------------------------------------------------------------- the dashboard JSON (fast)


def test_dashboards_are_importable_grafana_json():
    assert {p.name for p in DASHBOARDS} >= {
        "pretrain-training.json",
        "pretrain-spend.json",
        "pretrain-gpu.json",
    }
    uids = set()
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        assert dash["uid"] and len(dash["uid"]) <= 40 and dash["uid"] not in uids, path
        uids.add(dash["uid"])
        assert dash["title"] and isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
        assert "id" not in dash or dash["id"] is None, (
            f"{path.name}: a fixed id breaks import into another Grafana"
        )
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert (
            variables["datasource"]["type"] == "datasource"
            and variables["datasource"]["query"] == "prometheus"
        )
        for name in ("namespace", "job"):
            v = variables[name]
            assert v["type"] == "query" and v["includeAll"] and v["allValue"] == ".*", (path.name, name)
            assert v["datasource"]["uid"] == "${datasource}"
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for p in dash["panels"]:
            pos = p["gridPos"]
            assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, (path.name, p["title"])
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}", (path.name, p["title"])
                assert p["targets"] and p.get("description"), (path.name, p["title"])


def test_required_panels_are_there():
    titles = {(name, title) for name, title, _ in dashboard_targets()}
    training = {t for n, t in titles if n == "pretrain-training.json"}
    for want in (
        "Loss",
        "Validation bits per byte",
        "Learning rate",
        "Gradient norm",
        "Tokens per second",
        "MFU",
        "Step time breakdown",
        "Checkpoint age",
    ):
        assert want in training, want
    spend = {t for n, t in titles if n == "pretrain-spend.json"}
    for want in (
        "Spent vs cap",
        "Burn rate",
        "Time to cap and to the budget stop",
        "Planned end vs budget end",
    ):
        assert want in spend, want
    gpu = " ".join(e for n, _, e in dashboard_targets() if n == "pretrain-gpu.json")
    for metric in (
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_POWER_USAGE",
    ):
        assert metric in gpu, metric


def test_every_query_filters_on_namespace_and_job():
    for name, title, expr in dashboard_targets():
        for m in re.finditer(r"\b(pretrain_[a-z0-9_]+)(\{[^}]*\})?", expr):
            assert m.group(2) and m.group(2).startswith("{" + FILTER), (
                f"{name} / {title}: {m.group(0)} is unfiltered"
            )
        for m in re.finditer(r"\b(DCGM_[A-Z0-9_]+)(\{[^}]*\})?", expr):
            # DCGM series carry the pod's namespace; the job filter comes from the join on the job's pods.
            assert m.group(2) and 'namespace=~"$namespace"' in m.group(2), f"{name} / {title}: {m.group(0)}"
            assert 'job=~"$job"' in expr and "on (namespace, pod)" in expr, f"{name} / {title}"


def test_dashboards_and_rules_use_only_served_metrics_and_show_them_all():
    served = exported_metric_names()
    on_dashboards = set().union(*(metric_names(e) for _, _, e in dashboard_targets()))
    in_rules = set().union(*(metric_names(r["expr"]) for r in alert_rules()))
    unknown = {m for m in on_dashboards | in_rules if not m.startswith("DCGM_")} - served
    assert not unknown, f"dashboards/rules use metrics no exporter serves: {sorted(unknown)}"
    hidden = served - on_dashboards
    assert not hidden, f"metrics served but on no dashboard: {sorted(hidden)}"


def test_docs_list_every_metric_and_every_alert():
    text = DOCS.read_text()
    missing = sorted(m for m in exported_metric_names() if f"`{m}`" not in text)
    assert not missing, f"docs/observability.md's metric tables do not list {missing}"
    alerts = sorted({r["alert"] for r in alert_rules() if r["alert"] not in text})
    assert not alerts, f"docs/observability.md does not describe {alerts}"


def test_every_query_is_valid_promql(tmp_path):
    if reason := prometheus_missing():
        pytest.skip(reason)
    rules = [
        {"record": f"dashboard:query_{i}", "expr": substitute(e)}
        for i, (_, _, e) in enumerate(dashboard_targets())
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- end to end (slow)


def _wait_for(prom: Prometheus, exprs: list[str], trainer: Proc, timeout: float) -> None:
    pending = list(exprs)

    def all_there() -> bool:
        pending[:] = [e for e in pending if not prom.has_data(e)]
        return not pending

    trainer.wait_until(all_there, f"data in Prometheus for {pending}", timeout, poll=0.5)


def _served_names(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {re.split(r"[{ ]", ln, maxsplit=1)[0] for ln in text.splitlines() if ln and not ln.startswith("#")}


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_scrape(tmp_path, procs):
    if reason := prometheus_missing():
        pytest.skip(reason)
    run = tmp_path / "run"
    trainer_port, budget_port = free_port(), free_port()
    # A looped model with deep supervision, so the per-loop loss panels have data too; a peak for the CPU, so
    # MFU is reported; the in-process budget guard with a cap far above what a minute costs at $1/h; a
    # tracker, so its error counter has a series (0) for the tracker-errors panel.
    looped = (
        "model.loop.prelude=1",
        "model.loop.recurrent=1",
        "model.loop.coda=1",
        "model.loop.recurrence=2",
    )
    args = [
        "train",
        "--out",
        str(run),
        "--max-steps",
        "1000000",
        *FAST,
        *sets(
            *looped,
            "model.loop.deep_supervision=true",
            "train.eval_every=100",
            "train.eval_batches=2",
            "checkpoint.every_steps=150",
            "metrics.peak_tflops=1",
            "metrics.trackers=tensorboard",
        ),
        "--metrics-port",
        str(trainer_port),
        "--budget-cap-usd",
        "1000",
        "--price-per-gpu-hour",
        "1",
        "--gpus",
        "1",
        *sets(f"budget.metrics_port={budget_port}", "budget.poll_seconds=1", "budget.stale_seconds=5"),
    ]
    scrape = [
        {
            "job_name": "pretrain-e2e",
            "static_configs": [
                {
                    "targets": [f"127.0.0.1:{trainer_port}", f"127.0.0.1:{budget_port}"],
                    "labels": {"namespace": "e2e", "job": "pretrain-e2e", "pod": "pretrain-e2e-master-0"},
                }
            ],
        }
    ]
    prom = Prometheus(tmp_path / "prom", scrape, rule_files=[RULES])
    try:
        prom.start()
        trainer = procs.pretrain(*args)
        sel = '{namespace="e2e", job="pretrain-e2e"}'
        _wait_for(
            prom,
            [
                f"pretrain_step{sel} > 0",
                f"pretrain_val_loss{sel} > 0",
                f"pretrain_last_checkpoint_timestamp_seconds{sel} > 0",
                f"pretrain_loop_loss{sel}",
                f"pretrain_budget_spent_usd{sel} > 0",
                f"count_over_time(pretrain_step{sel}[1m]) >= 8",
                f"count_over_time(pretrain_budget_spent_usd{sel}[1m]) >= 8",
            ],
            trainer,
            timeout=180,
        )

        targets = prom.api("targets")["data"]["activeTargets"]
        assert len(targets) == 2 and all(t["health"] == "up" for t in targets), targets

        # the serving dashboard reads `pretrain serve`, which this run does not start: tests/test_serve.py
        # checks its metrics against a live server
        training = [t for t in dashboard_targets() if t[0] != "pretrain-serve.json"]
        served = _served_names(trainer_port) | _served_names(budget_port)
        used = {m for _, _, e in training for m in metric_names(e) if not m.startswith("DCGM_")}
        assert not used - served, f"dashboards use metrics the live endpoints do not serve: {used - served}"
        failures, checked, excused = [], 0, []
        for name, title, expr in training:
            query = substitute(expr)
            ans = prom.query(query)
            if ans.get("status") != "success":
                failures.append(f"{name} / {title}: {query}: {ans.get('error')}")
                continue
            if ans["data"]["result"]:
                checked += 1
                continue
            used = metric_names(expr)
            if any(m.startswith("DCGM_") for m in used):
                excused.append(f"{title} (DCGM: no GPU here)")
            else:
                failures.append(f"{name} / {title}: no data for {query}")
        assert not failures, "\n".join(failures)
        assert checked >= 40, (checked, excused)
        print(f"{checked} dashboard queries returned data; excused: {excused}")

        # The alert rules load and evaluate cleanly on a real scrape, and a healthy run fires none.
        groups = prom.api("rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) == len(alert_rules())
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        firing = [a for a in prom.api("alerts")["data"]["alerts"] if a["state"] == "firing"]
        assert not firing, firing

        # Graceful stop through the stop file: checkpoint, exit 0.
        (run / "stop.json").write_text(
            json.dumps(
                {
                    "mode": "graceful",
                    "cause": "user",
                    "reason": "observability e2e done",
                    "written_unix": time.time(),
                }
            )
        )
        assert trainer.wait(timeout=120) == 0, trainer.tail()
    finally:
        prom.stop()


def test_token_counter_counts_every_step_not_only_the_logged_ones(tmp_path, procs):
    run, port = tmp_path / "run", free_port()
    trainer = procs.pretrain(
        *("train", "--out", str(run), "--max-steps", "1000000", *FAST),
        *("--set", "train.log_every=5", "--metrics-port", str(port)),
    )
    trainer.wait_until(lambda: any(r.get("step", 0) >= 20 for r in train_rows(run)), "step 20")
    pairs = []
    for _ in range(5):  # a scrape may land between the two updates of one record: any consistent one
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            values = dict(
                ln.rsplit(" ", 1) for ln in r.read().decode().splitlines() if ln and not ln.startswith("#")
            )
        pairs.append((float(values["pretrain_step"]), float(values["pretrain_tokens_total"])))
        time.sleep(0.05)
    assert any(tokens == step * 8 * 64 for step, tokens in pairs), pairs  # FAST: 8 x 64 tokens per step


@pytest.mark.parametrize("in_pod, want", [(False, "127.0.0.1"), (True, "0.0.0.0")])
def test_metrics_listen_on_loopback_outside_a_pod_and_on_every_interface_in_one(monkeypatch, in_pod, want):
    from app.budget.metrics import BudgetMetrics
    from app.trainer.reporting.metrics import TrainerMetrics

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    if in_pod:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    trainer = TrainerMetrics(0, "node0", serve_global=True, with_mfu=False)
    watcher = BudgetMetrics()
    try:
        watcher.serve(0)
        assert trainer.server.server_address[0] == want
        assert watcher._server.server_address[0] == want
    finally:
        trainer.close()
        watcher.shutdown()
    explicit = TrainerMetrics(0, "node0", serve_global=True, with_mfu=False, addr="127.0.0.1")
    try:
        assert explicit.server.server_address[0] == "127.0.0.1"  # metrics.addr wins
    finally:
        explicit.close()
