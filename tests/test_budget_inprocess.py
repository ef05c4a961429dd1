"""The in-process host: the watcher thread in the trainer, in real time, with its own metrics port."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from app.budget import BudgetExhausted, read_budget_state, resolve_gpus, start_in_process
from app.budget.ledger import load_ledger
from app.budget.view import ledger_path_for
from app.config.budget import BudgetConfig
from app.errors import UserError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_thread_writes_the_graceful_stop_and_close_flushes(tmp_path):
    port = free_port()
    # $36/h = $0.01/s; cap $0.03; horizon 0.2 + 0.5 = 0.7 s: graceful at about $0.023 (2.3 s)
    cfg = BudgetConfig(
        cap_usd=0.03,
        price_per_gpu_hour=36.0,
        gpus=1,
        poll_seconds=0.2,
        margin_seconds=0.5,
        metrics_port=port,
        kube="off",
    )
    stop = tmp_path / "stop.json"
    handle = start_in_process(cfg, tmp_path, stop, world_size=1)
    t0 = load_ledger(ledger_path_for(tmp_path)).sessions[-1].start_unix  # charging starts here
    assert 'pretrain_budget_state{state="ok"} 1.0' in scrape(port)
    assert "pretrain_budget_cap_usd 0.03" in scrape(port)
    wait_for(stop.exists)
    elapsed = time.time() - t0
    assert 1.5 < elapsed < 4.0
    data = json.loads(stop.read_text())
    assert (data["mode"], data["cause"]) == ("graceful", "budget") and data["reason"]
    wait_for(lambda: 'pretrain_budget_state{state="stopping"} 1.0' in scrape(port))  # same tick, just after
    text = scrape(port)
    assert 'pretrain_budget_stops_total{mode="graceful"} 1.0' in text
    state = read_budget_state(tmp_path)
    assert state["state"] == "stopping" and state["cap_usd"] == 0.03 and state["source"] == "static"
    assert set(state) >= {
        "spent_usd",
        "cap_usd",
        "rate_usd_per_hour",
        "projected_total_usd",
        "remaining_usd",
        "seconds_to_cap",
        "state",
        "source",
        "source_healthy",
        "updated_unix",
    }
    handle.close()
    handle.close()  # idempotent
    led = load_ledger(ledger_path_for(tmp_path))
    assert not led.open_session and led.stop.mode == "graceful"
    assert led.spent_usd == pytest.approx((led.sessions[-1].end_unix - t0) * 0.01)
    with pytest.raises(OSError):
        scrape(port)  # the exporter went with the thread
    with pytest.raises(BudgetExhausted, match="budget stop already reached"):
        start_in_process(cfg, tmp_path, stop, world_size=1)


def test_a_stop_due_while_the_trainer_starts_waits_for_its_first_step_then_comes_within_a_look(tmp_path):
    """5 s of budget against a 30 s poll: the first tick is already past the horizon, but the trainer (it
    holds the lease) has not reached step 1, and a stop now would save nothing. The thread asks as soon as
    status.json says training, within a look (0.1 s), not at the next poll (after the cap)."""
    cfg = BudgetConfig(
        cap_usd=0.05, price_per_gpu_hour=36.0, gpus=1, poll_seconds=30.0, margin_seconds=1.0, kube="off"
    )
    (tmp_path / "lease.json").write_text(json.dumps({"owner": "trainer", "pid": 1}))
    stop = tmp_path / "stop.json"
    handle = start_in_process(cfg, tmp_path, stop, world_size=1)
    try:
        time.sleep(1.0)
        assert not stop.exists()
        status = {"step": 0, "step_seconds": 0.0, "state": "running", "updated_unix": time.time()}
        (tmp_path / "status.json").write_text(json.dumps(status))
        t = time.monotonic()
        wait_for(stop.exists, timeout=5.0)
        assert time.monotonic() - t < 2.0
        assert json.loads(stop.read_text())["mode"] == "graceful"
    finally:
        handle.close()
    assert load_ledger(ledger_path_for(tmp_path)).spent_usd < 0.05


def test_no_cap_is_a_no_op_handle(tmp_path):
    h = start_in_process(BudgetConfig(), tmp_path, tmp_path / "stop.json", world_size=1)
    assert h.view is None
    h.close()
    assert not (tmp_path / "budget").exists()


def test_cpu_run_without_price_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="--price-per-gpu-hour"):
        start_in_process(
            BudgetConfig(cap_usd=1.0, kube="off"), tmp_path, tmp_path / "stop.json", world_size=1
        )


def test_gpus_default_to_one_on_cpu_and_the_config_wins():
    assert resolve_gpus(BudgetConfig(), world_size=4) == 1  # CPU here: the box bills as one unit
    assert resolve_gpus(BudgetConfig(gpus=8), world_size=4) == 8


def test_a_spent_ledger_refuses_before_any_thread_starts(tmp_path):
    cfg = BudgetConfig(
        cap_usd=0.01, price_per_gpu_hour=3600.0, gpus=1, poll_seconds=0.1, margin_seconds=0.0, kube="off"
    )
    h = start_in_process(cfg, tmp_path, tmp_path / "stop.json", world_size=1)
    time.sleep(0.05)
    h.close()  # $1/s for >= 50 ms: more than the cap
    with pytest.raises(BudgetExhausted, match="budget exhausted|budget stop already reached") as e:
        start_in_process(cfg, tmp_path, tmp_path / "stop.json", world_size=1)
    assert "\n" not in str(e.value) and "--budget-cap-usd" in str(e.value)
