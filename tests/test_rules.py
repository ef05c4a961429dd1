"""The alert rules (helm/rules/pretrain-rules.yaml): `promtool check rules`, `promtool test rules`, and a unit
test that fires and one that stays quiet for every alert."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.prom_helpers import RULE_TESTS, RULES, alert_rules, prometheus_missing


@pytest.fixture(scope="module")
def promtool() -> str:
    if reason := prometheus_missing():
        pytest.skip(reason)
    return "promtool"


def test_promtool_check_rules(promtool):
    proc = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in proc.stdout


def test_promtool_rule_unit_tests(promtool):
    assert RULE_TESTS, "no tests/rules/*.test.yaml"
    proc = subprocess.run(
        [promtool, "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    fires, quiet = set(), set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - fires == set(), f"alerts never seen firing in a unit test: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts never checked quiet in a unit test: {sorted(names - quiet)}"


def test_rules_are_well_formed_for_the_chart():
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}, "a plain rules file: the chart wraps `groups:` into a PrometheusRule"
    required = {
        "PretrainBudgetAlertLevel",
        "PretrainBudgetProjectedOverCap",
        "PretrainBudgetSourceStale",
        "PretrainTrainingStalled",
        "PretrainLowMFU",
        "PretrainLossNaN",
        "PretrainLossSpike",
        "PretrainCheckpointOverdue",
    }
    rules = alert_rules()
    assert required <= {r["alert"] for r in rules}
    for r in rules:
        assert r["labels"]["severity"] in ("info", "warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
    mfu = next(r for r in rules if r["alert"] == "PretrainLowMFU")
    assert "< 0.30" in mfu["expr"], "the seed's rule: MFU below 0.30 after warm-up"
