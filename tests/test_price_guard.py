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
from app.budget.config import BudgetConfig
from app.budget.ledger import load_ledger
from app.budget.view import ledger_path_for
from app.cli import main as cli_main
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
    code = cli_main(["train", "--out", str(run), *FAST, "--price-per-gpu-hour", "2.0", "--gpus", "4",
                     "--max-price-per-gpu-hour", "1.40"])  # fmt: skip
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
    args = ["train", "--out", str(run), *FAST, "--max-steps", "2", "--gpus", "8", "--max-price-per-gpu-hour", "1.4",
            *sets("budget.source=file", f"budget.source_path={bill}")]  # fmt: skip
    assert cli_main(args) == 0
    assert "price $1.5000/GPU-h (file)" in capsys.readouterr().out
    assert guard(run)["state"] == "not_started"
    billing(bill, 8.0)
    proc = pretrain(*args, check=True)
    assert "price guard" not in proc.stdout and (run / "checkpoints" / "step_000002").is_dir()
    assert guard(run)["state"] == "ok" and guard(run)["price_per_gpu_hour"] == 1.0


def test_a_price_rise_at_a_poll_stops_gracefully_with_event_and_metrics(tmp_path):
    bill = billing(tmp_path / "bill.json", 8.0)  # 8 GPUs: $1.00/GPU-h
    cfg = BudgetConfig(cap_usd=1000, gpus=8, source="file", source_path=str(bill), poll_seconds=60,
                       max_price_per_gpu_hour=1.4, kube="off")  # fmt: skip
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
    args = ["--out", str(run), *FAST, "--gpus", "1", "--budget-cap-usd", "1000", "--max-price-per-gpu-hour", "1.4",
            *sets("budget.source=file", f"budget.source_path={bill}", "budget.poll_seconds=0.5",
                  "budget.stale_seconds=600", "budget.kube='off'", "train.max_steps=100000")]  # fmt: skip
    proc = spawn_train(*args)
    wait_for_step(run, 3, proc)
    billing(bill, 3.0)
    assert proc.wait(timeout=120) == 0
    out = proc.stdout.read()
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
