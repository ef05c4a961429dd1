"""The spend ledger: atomic, accumulates across restarts, charges killed sessions, refuses corrupt files."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import pytest

from app.budget import BudgetExhausted, check_not_exhausted
from app.budget.ledger import Ledger, LedgerError, load_ledger, save_ledger
from app.budget.view import ledger_path_for
from app.budget.watcher import Watcher
from app.config.budget import BudgetConfig
from app.errors import UserError
from app.files import atomic_write_json

T = 1_700_000_000.0


def cfg(**kw) -> BudgetConfig:
    base = dict(
        cap_usd=100.0, price_per_gpu_hour=36.0, gpus=1, poll_seconds=10.0, margin_seconds=60.0, kube="off"
    )
    base.update(kw)
    return BudgetConfig(**base)


def watcher(run, c: BudgetConfig, now: float, **kw) -> Watcher:
    return Watcher(c, run_dir=run, stop_file=run / "stop.json", static_rate_usd_per_hour=36.0, now=now, **kw)


def test_a_missing_ledger_is_a_fresh_one(tmp_path):
    assert load_ledger(tmp_path / "nope.json").spent_usd == 0.0


def test_spend_accumulates_across_restarts_and_downtime_is_free(tmp_path):
    run = tmp_path / "run"
    w = watcher(run, cfg(), T)
    w.tick(T + 50)
    w.close(T + 100)  # 100 s at $36/h = $1
    assert load_ledger(ledger_path_for(run)).spent_usd == pytest.approx(1.0)
    w = watcher(run, cfg(), T + 1000)  # 900 s down: not charged
    w.tick(T + 1100)
    w.close(T + 1200)
    led = load_ledger(ledger_path_for(run))
    assert led.spent_usd == pytest.approx(3.0)
    assert led.running_seconds == pytest.approx(300.0)
    assert [s.clean for s in led.sessions] == [True, True]
    assert [round(s.spent_usd, 6) for s in led.sessions] == [1.0, 2.0]
    assert led.created_unix == T and not led.open_session


def test_a_killed_session_is_charged_its_reserve(tmp_path):
    run = tmp_path / "run"
    w = watcher(run, cfg(), T, lock=False)
    w.tick(T + 100)  # $1 so far; the reserve covers two more polls: 20 s = $0.20
    del w  # SIGKILL: no close
    led = load_ledger(ledger_path_for(run))
    assert led.open_session and led.effective_spent() == pytest.approx(1.2)
    w = watcher(run, cfg(), T + 500)
    led = w.ledger
    assert led.spent_usd == pytest.approx(1.2) and led.crashes == 1
    assert led.sessions[0].end_unix == T + 100 and not led.sessions[0].clean
    w.close(T + 500)


def test_atomic_write_keeps_the_old_ledger_when_the_rename_fails(tmp_path, monkeypatch):
    path = tmp_path / "budget" / "ledger.json"
    save_ledger(path, Ledger(spent_usd=5.0))

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        save_ledger(path, Ledger(spent_usd=6.0))
    monkeypatch.undo()
    assert load_ledger(path).spent_usd == 5.0
    assert sorted(p.name for p in path.parent.iterdir()) == ["ledger.json"]  # no temp file left behind


@pytest.mark.parametrize(
    "content, what",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"spent_usd": -3}', "'spent_usd' must be a number >= 0"),
        ('{"spent_usd": "12"}', "'spent_usd' must be a number >= 0"),
        ('{"spent_usd": NaN}', "'spent_usd' must be a number >= 0"),
        ('{"version": 99}', "version 99"),
        ('{"stop": {"mode": "sometimes"}}', "'stop' must be null or a stop record"),
    ],
)
def test_a_corrupt_ledger_is_a_user_error_that_names_the_file(tmp_path, content, what):
    path = ledger_path_for(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(LedgerError) as e:
        load_ledger(path)
    assert what in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, UserError)
    with pytest.raises(UserError):
        check_not_exhausted(cfg(), tmp_path)


def test_one_watcher_per_ledger(tmp_path):
    w = watcher(tmp_path, cfg(), T)
    with pytest.raises(UserError, match="another budget watcher"):
        watcher(tmp_path, cfg(), T)
    w.close(T + 1)
    watcher(tmp_path, cfg(), T + 2).close(T + 3)


def test_exhausted_when_spent_reaches_the_cap(tmp_path):
    save_ledger(ledger_path_for(tmp_path), Ledger(spent_usd=100.0))
    with pytest.raises(BudgetExhausted, match=r"\$100.0000 spent of the \$100.0000 cap"):
        check_not_exhausted(cfg(), tmp_path)
    check_not_exhausted(cfg(cap_usd=0.0), tmp_path)  # no cap: no guard
    check_not_exhausted(cfg(cap_usd=150.0), tmp_path)


def test_a_budget_stop_is_final_for_its_cap_and_lifted_by_a_raised_cap(tmp_path):
    c = cfg(cap_usd=1.0)
    w = watcher(tmp_path, c, T)
    w.tick(T + 10)
    view = w.tick(T + 40)  # $0.40 + horizon 70 s ($0.70) >= $1: graceful
    assert view.state == "stopping"
    assert json.loads((tmp_path / "stop.json").read_text())["mode"] == "graceful"
    w.close(T + 45)
    with pytest.raises(BudgetExhausted, match="budget stop already reached"):
        check_not_exhausted(c, tmp_path)
    # a higher cap trains on: the stop is lifted and the stale budget stop file removed
    check_not_exhausted(cfg(cap_usd=2.0), tmp_path)
    w = watcher(tmp_path, cfg(cap_usd=2.0), T + 100)
    assert w.ledger.stop is None and not (tmp_path / "stop.json").exists()
    w.close(T + 101)


def test_a_user_stop_file_is_never_removed(tmp_path):
    atomic_write_json(tmp_path / "stop.json", {"mode": "graceful", "cause": "user", "reason": "enough"})
    watcher(tmp_path, cfg(), T).close(T + 1)
    assert json.loads((tmp_path / "stop.json").read_text())["cause"] == "user"


def test_a_stale_budget_stop_file_from_an_earlier_run_is_removed(tmp_path):
    atomic_write_json(tmp_path / "stop.json", {"mode": "immediate", "cause": "budget", "reason": "old"})
    watcher(tmp_path, cfg(), T).close(T + 1)  # the ledger records no stop: the file is a leftover
    assert not (tmp_path / "stop.json").exists()


def test_a_restarted_sidecar_repeats_the_stop_on_a_fresh_stop_volume(tmp_path):
    c = cfg(cap_usd=1.0)
    w = watcher(tmp_path, c, T)
    w.tick(T + 40)
    w.close(T + 41)
    (tmp_path / "stop.json").unlink()  # a new pod: emptyDir is empty
    watcher(tmp_path, c, T + 100).close(T + 101)
    assert json.loads((tmp_path / "stop.json").read_text())["mode"] == "graceful"


def test_an_unusable_run_dir_is_a_user_error(tmp_path):
    (tmp_path / "file").write_text("not a dir")
    with pytest.raises(UserError, match="file is a file, not a directory; pick another path"):
        watcher(tmp_path / "file" / "run", cfg(), T)


def _beat(run, now: float, state: str = "running") -> None:
    atomic_write_json(run / "status.json", {"step": 1, "state": state, "updated_unix": now})


def test_a_run_that_never_trains_is_billed_only_its_idle_allowance(tmp_path, caplog):
    """A failed prepare: the pods wait, the trainer never starts. $36/h with a 600 s allowance: 2 h of
    waiting cost $6 of the cap, the other $66 are recorded as unbilled; no stop is asked for."""
    run = tmp_path / "run"
    w = watcher(run, cfg(idle_allowance_seconds=600.0), T)
    for t in range(60, 7201, 60):
        view = w.tick(T + t)
    assert view.spent_usd == pytest.approx(6.0) and view.state == "ok" and not (run / "stop.json").exists()
    w.close(T + 7200)
    led = load_ledger(ledger_path_for(run))
    assert led.spent_usd == pytest.approx(6.0) and led.trained_unix == 0
    assert led.unbilled_usd == pytest.approx(66.0) and led.unbilled_seconds == pytest.approx(6600.0)
    assert led.idle_seconds == pytest.approx(7200.0)
    assert caplog.text.count("further waiting is not charged") == 1
    # the data arrives in a new pod: the first heartbeat starts the billing for good
    w = watcher(run, cfg(idle_allowance_seconds=600.0), T + 8000)
    w.tick(T + 8060)
    _beat(run, T + 8100)
    w.tick(T + 8160)
    w.close(T + 8200)
    led = load_ledger(ledger_path_for(run))
    assert led.trained_unix == T + 8160 and led.unbilled_usd == pytest.approx(66.0 + 0.6)
    assert led.spent_usd == pytest.approx(6.0 + 1.4)
    # later waits (a restart after training began) are ordinary spend
    w = watcher(run, cfg(idle_allowance_seconds=600.0), T + 9000)
    w.tick(T + 10000)
    w.close(T + 10000)
    assert load_ledger(ledger_path_for(run)).spent_usd == pytest.approx(7.4 + 10.0)


def test_unbilled_idle_spend_with_a_billing_file(tmp_path):
    """A billing source reports the job's whole spend, idle part included: the ledger keeps its own
    unbilled part apart, so training is charged what it costs, not the idle hours again."""
    run = tmp_path / "run"
    bill = tmp_path / "billing.json"

    def billed(t: float) -> None:  # the billing system: $36/h from T on, updated now
        stamp = datetime.fromtimestamp(T + t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        bill.write_text(
            json.dumps(
                {
                    "spent_usd": t * 0.01,
                    "rate_usd_per_hr": 36.0,
                    "hours_elapsed": t / 3600,
                    "projected_total_usd": 0.0,
                    "last_update_utc": stamp,
                }
            )
        )

    c = cfg(source="file", source_path=str(bill), idle_allowance_seconds=300.0, stale_seconds=600.0)
    w = watcher(run, c, T)
    for t in range(60, 3601, 60):
        billed(t)
        w.tick(T + t)
    assert w.ledger.spent_usd == pytest.approx(3.0) and w.ledger.unbilled_usd == pytest.approx(33.0)
    _beat(run, T + 3601)
    for t in range(3660, 4201, 60):
        billed(t)
        w.tick(T + t)
    assert w.ledger.spent_usd == pytest.approx(3.0 + 6.0)
    w.close(T + 4200)
