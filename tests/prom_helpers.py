"""Shared helpers of the observability tests: Prometheus from Debian, a private Prometheus server on
127.0.0.1, the metric names the exporters serve, and the PromQL of the dashboards and rules."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.procs import Proc

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "helm" / "rules" / "pretrain-rules.yaml"
RULE_TESTS = sorted((REPO / "tests" / "rules").glob("*.test.yaml"))
DASHBOARDS = sorted((REPO / "helm" / "dashboards").glob("*.json"))
INSTALL_SCRIPT = REPO / ".ci" / "install-prometheus.sh"

_METRIC = re.compile(r"\b(pretrain_[a-z0-9_]+|DCGM_[A-Z0-9_]+)\b")
_install_result: str | None | bool = False  # False = not tried yet


def prometheus_missing() -> str | None:
    """None when prometheus and promtool are on PATH (installing them from Debian if needed), else why not."""
    global _install_result
    if shutil.which("prometheus") and shutil.which("promtool"):
        return None
    if _install_result is False:
        if os.geteuid() != 0 and not shutil.which("sudo"):
            _install_result = (
                "prometheus/promtool are not installed and this user cannot apt-get install them"
            )
        else:
            try:
                proc = subprocess.run(
                    ["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=600
                )
                _install_result = (
                    None
                    if proc.returncode == 0
                    else f"installing Prometheus from Debian failed: {proc.stderr.strip().splitlines()[-1:]}"
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                _install_result = f"installing Prometheus from Debian failed: {e}"
    if _install_result is None and shutil.which("prometheus") and shutil.which("promtool"):
        return None
    return _install_result or "prometheus/promtool not found after the install script ran"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- metric names


def exported_metric_names() -> set[str]:
    """Names of every series the trainer's, the watcher's and the inference server's exporters can serve
    (labelled families with no child yet included; `_created` excluded)."""
    from app.budget.metrics import BudgetMetrics
    from app.tools.generation import ServeMetrics
    from app.trainer.reporting.metrics import TrainerMetrics

    suffix = {"counter": "_total", "info": "_info"}
    trainer = TrainerMetrics(
        0, "node0", serve_global=True, with_mfu=True, addr="127.0.0.1"
    )  # port 0: any free port
    try:
        families = [
            *trainer.registry.collect(),
            *BudgetMetrics().registry.collect(),
            *ServeMetrics().registry.collect(),
        ]
    finally:
        trainer.close()
    names = set()
    for fam in families:
        if fam.type == "histogram":  # queried through its buckets; _sum and _count follow them
            names.add(fam.name + "_bucket")
            continue
        names.add(fam.name + suffix.get(fam.type, ""))
        names |= {s.name for s in fam.samples if not s.name.endswith("_created")}
    return names


def metric_names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


# ---------------------------------------------------------------- dashboards and rules


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every query of every panel (rows' nested panels too)."""
    out = []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        panels = list(dash["panels"])
        for p in dash["panels"]:
            panels += p.get("panels", [])
        for p in panels:
            for t in p.get("targets", []):
                out.append((path.name, p["title"], t["expr"]))
    return out


def substitute(expr: str, rate_interval: str = "1m") -> str:
    """Grafana's variables -> what Prometheus accepts: every namespace and job, a fixed rate window."""
    for var in ("$namespace", "${namespace}", "$job", "${job}"):
        expr = expr.replace(var, ".*")
    for var in ("$__rate_interval", "${__rate_interval}", "$__interval", "${__interval}"):
        expr = expr.replace(var, rate_interval)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


# ---------------------------------------------------------------- a private Prometheus


class Prometheus:
    """`prometheus` on 127.0.0.1:<free port> with a temp config and storage; stopped by its PID."""

    def __init__(
        self,
        workdir: Path,
        scrape_configs: list[dict],
        rule_files: list[Path] = (),
        scrape_interval: str = "1s",
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "evaluation_interval": scrape_interval,
            },
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": scrape_configs,
        }
        self.config = self.workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = self.workdir / "prometheus.log"
        self.proc: Proc | None = None

    def start(self, timeout: float = 60) -> Prometheus:
        cmd = [
            "prometheus",
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        self.proc = Proc(cmd, self.log, env=dict(os.environ), cwd=self.workdir)

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        self.proc.wait_until(ready, "prometheus ready", timeout, poll=0.2)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.running():
            self.proc.signal(signal.SIGTERM)
            with contextlib.suppress(AssertionError):  # not gone in 20 s: wait ended it (SIGKILL)
                self.proc.wait(timeout=20)

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422 carry the PromQL error as JSON
            return json.loads(e.read())

    def query(self, expr: str) -> dict:
        """The /api/v1/query answer: {"status", "data": {"resultType", "result"}} or {"status": "error", ...}."""
        return self.api("query", query=expr)

    def has_data(self, expr: str) -> bool:
        ans = self.query(expr)
        return ans.get("status") == "success" and bool(ans["data"]["result"])


def sets(*pairs: str) -> list[str]:
    """`--set` overrides for the CLI: sets("a=1", "b=2") -> ["--set", "a=1", "--set", "b=2"]."""
    return [arg for kv in pairs for arg in ("--set", kv)]
