"""The launch price guard (budget.max_price_per_gpu_hour) with the static and the file sources: above the
ceiling the trainer does not start (exit 0) or stops gracefully at a poll; the ledger, a Kubernetes Event
and the watcher's metrics say why; a later launch at a lower price trains again."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from app.budget import PriceAboveMax, start_in_process
from app.budget.ledger import load_ledger
from app.budget.view import ledger_path_for
from app.cli import main as cli_main
from app.config.budget import BudgetConfig
from tests.conftest import FAST, pretrain, spawn_train, train_rows, wait_for_step
from tests.prom_helpers import sets
from tests.test_budget_kube import EVENTS_PATH, FakeApiServer, actions

# the kubernetes client still calls urllib3's deprecated getheader(s); not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:HTTPResponse.getheader:DeprecationWarning")


def billing(path: Path, rate_per_hour: float, spent: float = 0.0) -> Path:
    """The billing poller's file (budget.source=file)."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    path.write_text(
        json.dumps({"spent_usd": spent, "rate_usd_per_hr": rate_per_hour, "last_update_utc": now})
    )
    return path


def guard(run: Path) -> dict | None:
    return load_ledger(ledger_path_for(run)).price_guard


def test_static_price_above_the_ceiling_does_not_start(tmp_path, capsys):
    run = tmp_path / "run"
    code = cli_main(
        [
            "train",
            "--out",
            str(run),
            *FAST,
            "--price-per-gpu-hour",
            "2.0",
            "--gpus",
            "4",
            "--max-price-per-gpu-hour",
            "1.40",
        ]
    )
    assert code == 0  # a deliberate wait, not a failure
    out = capsys.readouterr().out
    assert "price guard: price $2.0000/GPU-h (static) is above budget.max_price_per_gpu_hour $1.4000" in out
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    g = guard(run)
    assert (
        g["state"] == "not_started" and g["price_per_gpu_hour"] == 2.0 and g["max_price_per_gpu_hour"] == 1.4
    )
    assert json.loads((run / "status.json").read_text())["state"] == "done"  # a sidecar watcher may exit


def test_file_source_price_is_its_rate_per_gpu(tmp_path, capsys):
    """$12/h over 8 GPUs is $1.50/GPU-h: above 1.40; at $8/h ($1.00) the run trains."""
    run, bill = tmp_path / "run", billing(tmp_path / "bill.json", 12.0)
    args = [
        "train",
        "--out",
        str(run),
        *FAST,
        "--max-steps",
        "2",
        "--gpus",
        "8",
        "--max-price-per-gpu-hour",
        "1.4",
        *sets("budget.source=file", f"budget.source_path={bill}"),
    ]
    assert cli_main(args) == 0
    assert "price $1.5000/GPU-h (file)" in capsys.readouterr().out
    assert guard(run)["state"] == "not_started"
    billing(bill, 8.0)
    proc = pretrain(*args, check=True)
    assert "price guard" not in proc.stdout and (run / "checkpoints" / "step_000002").is_dir()
    assert guard(run)["state"] == "ok" and guard(run)["price_per_gpu_hour"] == 1.0


def test_a_price_rise_at_a_poll_stops_gracefully_with_event_and_metrics(tmp_path):
    bill = billing(tmp_path / "bill.json", 8.0)  # 8 GPUs: $1.00/GPU-h
    cfg = BudgetConfig(
        cap_usd=1000,
        gpus=8,
        source="file",
        source_path=str(bill),
        poll_seconds=60,
        max_price_per_gpu_hour=1.4,
        kube="off",
    )
    stop = tmp_path / "stop.json"
    handle = start_in_process(cfg, tmp_path, stop, world_size=1)
    api = FakeApiServer()
    try:
        w = handle.watcher
        w.kube = actions(api)
        m = w.metrics.registry.get_sample_value
        assert m("pretrain_budget_price_per_gpu_hour") == 1.0 and m("pretrain_budget_price_above_max") == 0
        assert m("pretrain_budget_max_price_per_gpu_hour") == 1.4
        assert not stop.exists()
        billing(bill, 16.0)  # the spot price doubles: $2.00/GPU-h
        w.tick(time.time())
        data = json.loads(stop.read_text())
        assert data["mode"] == "graceful" and "$2.0000/GPU-h (file) is above" in data["reason"]
        assert m("pretrain_budget_price_above_max") == 1 and m("pretrain_budget_price_stops_total") == 1
        (event,) = [r["body"] for r in api.calls("POST") if r["path"] == EVENTS_PATH]
        assert event["reason"] == "PriceAboveMax" and event["message"] == data["reason"]
        w.tick(time.time())  # asked once, not at every poll
        assert m("pretrain_budget_price_stops_total") == 1
    finally:
        handle.close()
        api.close()
    led = load_ledger(ledger_path_for(tmp_path))
    assert led.price_guard["state"] == "stopped" and led.price_guard["reason"] == data["reason"]
    assert led.stop is None  # not a budget stop: a later launch at a lower price may train
    billing(bill, 8.0)
    start_in_process(cfg, tmp_path, stop, world_size=1).close()  # no BudgetExhausted
    billing(bill, 16.0)
    with pytest.raises(PriceAboveMax):
        from app.budget import check_price_at_launch

        check_price_at_launch(cfg, tmp_path, 1, True)


@pytest.mark.slow  # a real trainer stopped by a real price rise, then relaunched twice (~20 s)
def test_trainer_stops_on_a_price_rise_waits_and_resumes(tmp_path):
    run, bill = tmp_path / "run", billing(tmp_path / "bill.json", 1.0)
    args = [
        "--out",
        str(run),
        *FAST,
        "--gpus",
        "1",
        "--budget-cap-usd",
        "1000",
        "--max-price-per-gpu-hour",
        "1.4",
        *sets(
            "budget.source=file",
            f"budget.source_path={bill}",
            "budget.poll_seconds=0.5",
            "budget.stale_seconds=600",
            "budget.kube='off'",
            "train.max_steps=100000",
        ),
    ]
    proc = spawn_train(*args)
    wait_for_step(run, 3, proc)
    billing(bill, 3.0)
    assert proc.wait(timeout=120) == 0
    out = proc.output
    (stop,) = [r for r in train_rows(run, "event") if r.get("event") == "stop"]
    assert stop["cause"] == "budget" and "max_price_per_gpu_hour" in stop["reason"] and stop["exit_code"] == 0
    assert f"checkpoint step {stop['step']}" in out  # stopped gracefully: saved
    again = pretrain("train", *args)
    assert again.returncode == 0 and "price guard:" in again.stdout and "not starting" in again.stdout
    billing(bill, 1.0)
    proc = spawn_train(*args)
    wait_for_step(run, stop["step"] + 2, proc)  # resumed and training again
    (run / "stop.json").write_text(json.dumps({"mode": "immediate", "reason": "test over"}))
    assert proc.wait(timeout=60) == 0


def _wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_without_a_cap_the_watcher_thread_checks_the_price_alone(tmp_path):
    """budget.cap_usd=0 with a ceiling: the in-process thread still polls the source for the price (and only
    that: no spend is charged), stops gracefully once, posts the Event and counts the stop."""
    bill = billing(tmp_path / "bill.json", 8.0)  # 8 GPUs: $1.00/GPU-h
    cfg = BudgetConfig(
        cap_usd=0,
        gpus=8,
        source="file",
        source_path=str(bill),
        poll_seconds=0.1,
        stale_seconds=600,
        max_price_per_gpu_hour=1.4,
        kube="off",
    )
    stop = tmp_path / "stop.json"
    stop.write_text(json.dumps({"mode": "graceful", "cause": "budget", "reason": "an earlier run's"}))
    handle = start_in_process(cfg, tmp_path, stop, world_size=1)
    api = FakeApiServer()
    try:
        w = handle.watcher
        assert w is not None and not stop.exists()  # a leftover budget stop must not stop this run
        w.kube = actions(api)
        m = w.metrics.registry.get_sample_value
        assert m("pretrain_budget_price_per_gpu_hour") == 1.0 and m("pretrain_budget_price_above_max") == 0
        billing(bill, 16.0)  # $2.00/GPU-h: the thread notices at its next poll, with no tick from us
        _wait_for(stop.exists)
        data = json.loads(stop.read_text())
        assert data["mode"] == "graceful" and data["cause"] == "budget"
        assert "$2.0000/GPU-h (file) is above budget.max_price_per_gpu_hour $1.4000" in data["reason"]
        _wait_for(lambda: m("pretrain_budget_price_stops_total") == 1)
        assert m("pretrain_budget_price_above_max") == 1 and m("pretrain_budget_price_per_gpu_hour") == 2.0
        _wait_for(lambda: any(r["path"] == EVENTS_PATH for r in api.calls("POST")))
        time.sleep(0.5)  # several more polls: asked once
        assert m("pretrain_budget_price_stops_total") == 1
        (event,) = [r["body"] for r in api.calls("POST") if r["path"] == EVENTS_PATH]
        assert event["reason"] == "PriceAboveMax" and event["message"] == data["reason"]
    finally:
        handle.close()
        api.close()
    led = load_ledger(ledger_path_for(tmp_path))
    assert led.price_guard["state"] == "stopped" and led.price_guard["reason"] == data["reason"]
    assert led.spent_usd == 0 and not led.sessions and led.stop is None  # no budget: nothing charged


@pytest.mark.slow  # a real trainer stopped by a price rise with no cap (~10 s)
def test_trainer_without_a_cap_stops_on_a_price_rise(tmp_path):
    from tests.prom_helpers import free_port

    run, bill, port = tmp_path / "run", billing(tmp_path / "bill.json", 1.0), free_port()
    args = [
        "--out",
        str(run),
        *FAST,
        "--gpus",
        "1",
        "--max-price-per-gpu-hour",
        "1.4",
        *sets(
            "budget.source=file",
            f"budget.source_path={bill}",
            "budget.poll_seconds=0.5",
            "budget.stale_seconds=600",
            "budget.kube='off'",
            f"budget.metrics_port={port}",
            "train.max_steps=100000",
        ),
    ]
    proc = spawn_train(*args)
    wait_for_step(run, 3, proc)
    import urllib.request

    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "pretrain_budget_price_per_gpu_hour 1.0" in page and "pretrain_budget_price_above_max 0.0" in page
    billing(bill, 3.0)
    assert proc.wait(timeout=120) == 0
    out = proc.output
    (stop,) = [r for r in train_rows(run, "event") if r.get("event") == "stop"]
    assert stop["cause"] == "budget" and stop["exit_code"] == 0
    assert "$3.0000/GPU-h (file) is above budget.max_price_per_gpu_hour $1.4000" in stop["reason"]
    assert (
        f"checkpoint step {stop['step']}" in out
        and (run / "checkpoints" / f"step_{stop['step']:06d}").is_dir()
    )
    assert guard(run)["state"] == "stopped" and stop["reason"].endswith(guard(run)["reason"])


def test_launch_above_the_ceiling_posts_a_price_above_max_event(tmp_path, monkeypatch, capsys):
    """`pretrain train` with budget.kube=on: the launch check posts PriceAboveMax on the PyTorchJob (the
    recorded-API fake server, reached through a real kubeconfig and the real client)."""
    from tests.test_budget_kube import JOB, JOB_PATH, NS

    api = FakeApiServer()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                "users": [{"name": "fake", "user": {"token": "unused"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NS}}
                ],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))  # read when the client is loaded (app.budget.kube)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    run = tmp_path / "run"
    try:
        code = cli_main(
            [
                "train",
                "--out",
                str(run),
                *FAST,
                "--price-per-gpu-hour",
                "2.0",
                "--gpus",
                "1",
                "--max-price-per-gpu-hour",
                "1.40",
                *sets("budget.kube='on'", f"budget.job_name={JOB}", f"budget.namespace={NS}"),
            ]
        )
    finally:
        api.close()
    assert code == 0 and "price guard:" in capsys.readouterr().out
    assert [(r["method"], r["path"]) for r in api.requests] == [("GET", JOB_PATH), ("POST", EVENTS_PATH)]
    event = api.requests[-1]["body"]
    assert event["reason"] == "PriceAboveMax" and event["type"] == "Warning"
    assert event["message"] == guard(run)["reason"]
    assert (
        "$2.0000/GPU-h (static) is above budget.max_price_per_gpu_hour $1.4000; not starting"
        in event["message"]
    )
    assert event["involvedObject"]["kind"] == "PyTorchJob" and event["involvedObject"]["uid"] == "uid-42"


def test_without_a_cap_under_a_sidecar_the_trainer_says_the_price_is_checked_at_launch_only(tmp_path, caplog):
    """budget.in_process=false (Kubernetes) and no cap: `pretrain watch` does not run, so nothing checks
    the price after launch; one warning says so (the in-process case runs the thread, above)."""
    from app.config import load_config
    from app.trainer.stopping.budget_link import BudgetLink

    cfg = load_config(
        "tiny",
        overrides=[
            "budget.max_price_per_gpu_hour=1.4",
            "budget.price_per_gpu_hour=1.0",
            "budget.gpus=1",
            "budget.in_process=false",
        ],
    )
    link = BudgetLink(cfg, tmp_path, tmp_path / "stop.json", is_rank0=True, world_size=1)
    assert link.watcher is None and guard(tmp_path)["state"] == "ok"  # the launch check ran
    (line,) = [r.getMessage() for r in caplog.records if "checked at launch only" in r.getMessage()]
    assert "set budget.cap_usd" in line
    cfg.budget.in_process = True
    link = BudgetLink(cfg, tmp_path, tmp_path / "stop.json", is_rank0=True, world_size=1)
    try:
        assert link.watcher is not None and link.watcher.view is None  # the price thread alone
    finally:
        link.close()
