"""`pretrain watch` as a real subprocess (the sidecar): metrics over HTTP, the stop file, exits, dry run."""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request

import pytest

from app.budget.ledger import Ledger, load_ledger, save_ledger
from app.budget.view import ledger_path_for
from tests.conftest import pretrain
from tests.procs import Proc
from tests.test_budget_inprocess import free_port, wait_for


def watch(*args: str) -> Proc:
    """`pretrain watch ARGS` (no Kubernetes) in the background; stopped at the test's end."""
    return Proc([sys.executable, "-m", "app.cli", "watch", "--kube", "off", *args])


def metrics(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_sidecar_serves_metrics_writes_the_stop_file_and_exits_when_the_trainer_is_done(tmp_path):
    run, port = tmp_path / "run", free_port()
    # $36/h = $0.01/s against a $0.05 cap; horizon 0.2 s poll + 1 s margin: graceful at about $0.038 (3.8 s)
    proc = watch(
        "--budget-cap-usd",
        "0.05",
        "--price-per-gpu-hour",
        "36",
        "--gpus",
        "1",
        "--run-dir",
        str(run),
        "--poll-seconds",
        "0.2",
        "--margin-seconds",
        "1",
        "--metrics-port",
        str(port),
    )
    wait_for(lambda: metrics(port).get("pretrain_budget_cap_usd") == 0.05, timeout=30)
    m = metrics(port)
    assert m["pretrain_budget_rate_usd_per_hour"] == 36.0
    assert m['pretrain_budget_state{state="ok"}'] == 1.0
    assert m['pretrain_budget_source_up{source="static"}'] == 1.0
    assert m["pretrain_budget_remaining_usd"] <= 0.05
    assert m["pretrain_budget_seconds_to_cap"] <= 5.0
    for name in (
        "pretrain_budget_spent_usd",
        "pretrain_budget_projected_total_usd",
        "pretrain_budget_source_last_update_timestamp_seconds",
        "pretrain_budget_source_fallbacks_total",
        "pretrain_budget_alerts_total",
        'pretrain_budget_stops_total{mode="graceful"}',
    ):
        assert name in m, name
    stop = run / "stop.json"
    wait_for(stop.exists, timeout=15)
    assert json.loads(stop.read_text())["mode"] == "graceful"
    # same tick, just after
    wait_for(lambda: metrics(port).get('pretrain_budget_state{state="stopping"}') == 1.0)
    m = metrics(port)
    assert m['pretrain_budget_stops_total{mode="graceful"}'] == 1.0
    assert m["pretrain_budget_alerts_total"] == 0.0  # the stop came with the alert: one event, not two
    assert 0.035 < m["pretrain_budget_spent_usd"] < 0.05
    status = {
        "step": 9,
        "step_seconds": 0.1,
        "checkpoint_seconds": 0.1,
        "state": "done",
        "updated_unix": time.time(),
    }
    (run / "status.json").write_text(json.dumps(status))
    assert proc.wait(10) == 0, proc.output
    out = proc.output
    assert "the trainer is done" in out and "budget graceful stop" in out
    led = load_ledger(ledger_path_for(run))
    assert not led.open_session and led.sessions[-1].host == "sidecar" and led.sessions[-1].clean


def test_sigterm_closes_the_ledger_and_exits_0(tmp_path):
    run, port = tmp_path / "run", free_port()
    proc = watch(
        "--budget-cap-usd",
        "100",
        "--gpu-type",
        "h100-sxm",
        "--gpus",
        "8",
        "--run-dir",
        str(run),
        "--poll-seconds",
        "0.2",
        "--metrics-port",
        str(port),
    )
    wait_for(lambda: "pretrain_budget_spent_usd" in metrics(port), timeout=30)
    assert metrics(port)["pretrain_budget_rate_usd_per_hour"] == 8 * 2.99  # the built-in price table
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0, proc.output
    led = load_ledger(ledger_path_for(run))
    assert not led.open_session and led.reserved_usd == 0.0 and led.spent_usd > 0


def run_watch(capsys, *args: str) -> tuple[int, str, str]:
    """`pretrain watch` in this process (the subprocess tests above pay a torch import each)."""
    from app.budget.cli import main

    code = main(["--kube", "off", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_prints_thresholds_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "budget").mkdir(parents=True)
    status = {"step": 120, "step_seconds": 0.9, "checkpoint_seconds": 12.0, "state": "running"}
    (run / "status.json").write_text(json.dumps(status))
    code, out, err = run_watch(
        capsys,
        "--budget-cap-usd",
        "35",
        "--gpu-type",
        "a100-80gb",
        "--gpus",
        "1",
        "--run-dir",
        str(run),
        "--dry-run-budget",
    )
    assert code == 0, err
    assert "static: ok, rate $1.79/h" in out
    assert (
        "horizon 82.9 s = max(poll 10, S) + poll 10 + max(margin 60, S) with S = step 0.9 + checkpoint 12.0 = 12.9"
        in out
    )
    for what in ("alert", "LR decay (WSD)", "graceful stop", "immediate stop"):
        assert what in out
    assert "graceful stop     at $34.9588  in 19h31m" in out
    assert "state ok; the watcher would do: nothing" in out
    assert not (run / "budget" / "ledger.json").exists() and not (run / "stop.json").exists()


def test_dry_run_with_a_failing_source_says_what_it_falls_back_to(tmp_path, capsys):
    code, out, err = run_watch(
        capsys,
        "--budget-cap-usd",
        "35",
        "--price-per-gpu-hour",
        "2",
        "--gpus",
        "4",
        "--run-dir",
        str(tmp_path),
        "--source",
        "file",
        "--source-path",
        str(tmp_path / "missing.json"),
        "--dry-run-budget",
    )
    assert code == 0, err
    assert "source    file: FAILED (" in out and "would fall back to $8.00/h" in out


def test_dry_run_of_a_spent_budget_says_the_trainer_would_refuse(tmp_path, capsys):
    save_ledger(ledger_path_for(tmp_path), Ledger(spent_usd=40.0))
    code, out, _ = run_watch(
        capsys,
        "--budget-cap-usd",
        "35",
        "--gpu-type",
        "h100",
        "--gpus",
        "1",
        "--run-dir",
        str(tmp_path),
        "--dry-run-budget",
    )
    assert code == 0
    assert "state exhausted; the watcher would do: write an immediate stop" in out
    assert "would refuse to start: budget exhausted" in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--run-dir", "R"], "--budget-cap-usd"),
        (["--budget-cap-usd", "10", "--run-dir", "R"], "--price-per-gpu-hour"),
        (["--budget-cap-usd", "10", "--price-per-gpu-hour", "2", "--run-dir", "R"], "--gpus N"),
        (["--budget-cap-usd", "10", "--gpu-type", "h100", "--gpus", "1"], "--run-dir"),
        (["--budget-cap-usd", "10", "--source", "file", "--run-dir", "R"], "--source-path"),
        (
            [
                "--budget-cap-usd",
                "10",
                "--source",
                "opencost",
                "--opencost-url",
                "http://x",
                "--run-dir",
                "R",
            ],
            "selector",
        ),
        (
            ["--budget-cap-usd", "10", "--source", "bogus", "--run-dir", "R"],
            "choose from 'static', 'file', 'opencost'",
        ),
        (
            [
                "--budget-cap-usd",
                "10",
                "--gpu-type",
                "h100",
                "--gpus",
                "1",
                "--alert-fraction",
                "3",
                "--run-dir",
                "R",
            ],
            "alert_fraction",
        ),
        (
            [
                "--budget-cap-usd",
                "10",
                "--gpu-type",
                "h100",
                "--gpus",
                "1",
                "--kube",
                "maybe",
                "--run-dir",
                "R",
            ],
            "choose from 'auto', 'on', 'off'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, needle):
    args = [str(tmp_path) if a == "R" else a for a in args]
    code, _, err = run_watch(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


def test_config_file_budget_section_and_flags_override(tmp_path, capsys):
    conf = tmp_path / "config.yaml"
    conf.write_text(
        "model:\n  n_layer: 2\nbudget:\n  cap_usd: 50\n  gpu_type: h100-sxm\n  gpus: 2\n  margin_seconds: 30\n"
    )
    code, out, err = run_watch(
        capsys, "--config", str(conf), "--gpus", "4", "--run-dir", str(tmp_path), "--dry-run-budget"
    )
    assert code == 0, err
    assert "cap $50.0000" in out and "$2.99/GPU-h x 4 GPUs" in out and "margin 30" in out
    conf.write_text("budget:\n  cap_usd: 50\n  capp: 3\n")
    code, _, err = run_watch(capsys, "--config", str(conf), "--run-dir", str(tmp_path))
    assert code == 2 and "unknown key budget.capp" in err


def test_the_real_cli_exits_2_on_a_corrupt_ledger(tmp_path):
    (tmp_path / "budget").mkdir()
    (tmp_path / "budget" / "ledger.json").write_text("{half a")
    p = pretrain(
        "watch", "--budget-cap-usd", "10", "--gpu-type", "h100", "--gpus", "1", "--run-dir", str(tmp_path)
    )
    assert p.returncode == 2 and "is corrupt" in p.stderr and len(p.stderr.strip().splitlines()) == 1
