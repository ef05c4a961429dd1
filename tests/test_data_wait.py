"""`pretrain wait-data`: the trainer pods' wait for the prepare Job ends on a failed or missing prepare.

The data volume is a real directory; the Kubernetes API is a fake server on 127.0.0.1 answering the
real `kubernetes` client (batch/v1 Job reads, core/v1 Event posts: what the chart's Role must allow);
the clock is simulated so that hours of waiting take milliseconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client

from app.data import wait
from app.data.wait import JobReader, WaitSettings, wait_for_data

pytestmark = pytest.mark.filterwarnings("ignore:HTTPResponse.getheader:DeprecationWarning")
NS, PREP, PTJ = "ml", "pretrain-prepare-0123abcd", "pretrain"
FP = "0123456789abcdef"
JOB_PATH = f"/apis/batch/v1/namespaces/{NS}/jobs/{PREP}"


class FakeApi:
    """Answers a Job read with `self.job` (None = 404, an int = that HTTP error) and records Events."""

    def __init__(self):
        self.job: dict | int | None = {"status": {}}
        self.events: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, body: dict) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                job = fake.job
                if self.path.split("?")[0] == JOB_PATH and isinstance(job, dict):
                    return self._reply(200, {"apiVersion": "batch/v1", "kind": "Job", **job})
                code = job if isinstance(job, int) else 404
                self._reply(code, {"kind": "Status", "code": code, "reason": "NotFound"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.events.append({"path": self.path, **body})
                self._reply(201, body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.client = client.ApiClient(
            client.Configuration(host=f"http://127.0.0.1:{self.server.server_port}")
        )
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def api():
    fake = FakeApi()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


class Clock:
    """Simulated time; `then` runs actions once their time has come (before each look)."""

    def __init__(self, then: dict[float, object] | None = None):
        self.t = 0.0
        self.then = dict(then or {})

    def __call__(self) -> float:
        for at in sorted(self.then):
            if at <= self.t:
                self.then.pop(at)()
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def settings(tmp_path: Path, **kw) -> WaitSettings:
    base = dict(data_dir=tmp_path / "data", fingerprint=FP, job=PREP, namespace=NS, poll_seconds=15.0)
    base.update(timeout_seconds=21600.0, missing_grace_seconds=120.0, stop_file=tmp_path / "stop.json")
    base.update(kw)
    (tmp_path / "data").mkdir(exist_ok=True)
    return WaitSettings(**base)


def run_wait(s: WaitSettings, reader=None, then=None) -> tuple[str, str, float]:
    clock = Clock(then)
    outcome, line = wait_for_data(s, reader, clock=clock, sleep=clock.sleep, say=lambda m: None)
    return outcome, line, clock.t


def write(path: Path, text: str):
    return lambda: path.write_text(text)


def test_ready_after_the_prepare_writes_the_marker(tmp_path):
    s = settings(tmp_path)
    outcome, line, t = run_wait(s, then={600: write(s.data_dir / "_READY", FP + "\n")})
    assert outcome == "ready" and 600 <= t < 620 and FP in line


def test_a_marker_of_other_arguments_is_not_ready(tmp_path):
    s = settings(tmp_path, timeout_seconds=3600)
    (s.data_dir / "_READY").write_text("ffffffffffffffff\n")
    outcome, line, t = run_wait(s)
    assert outcome == "gave-up" and t >= 3600
    assert "prepare.wait.timeoutSeconds=3600" in line and "job.enabled=false" in line


def test_a_stop_file_lets_the_trainer_through(tmp_path):
    s = settings(tmp_path)
    outcome, _, t = run_wait(s, then={90: write(tmp_path / "stop.json", "{}")})
    assert outcome == "stop" and t < 120


@pytest.mark.parametrize(
    ("marker", "gives_up"),
    [
        ({"fingerprint": FP, "exit_code": 2, "failures": 1, "backoff_limit": 3, "final": True}, True),
        ({"fingerprint": FP, "exit_code": 137, "failures": 1, "backoff_limit": 3, "final": False}, False),
        ({"fingerprint": "other", "exit_code": 2, "failures": 1, "backoff_limit": 3, "final": True}, False),
    ],
    ids=["final", "will-retry", "other-fingerprint"],
)
def test_a_failed_prepare_marker_ends_the_wait(tmp_path, marker, gives_up):
    s = settings(tmp_path, timeout_seconds=7200)
    outcome, line, t = run_wait(s, then={300: write(s.data_dir / "_FAILED", json.dumps(marker))})
    if gives_up:
        assert outcome == "gave-up" and t < 330
        assert "`pretrain prepare` failed for good: exit 2" in line and f"kubectl logs job/{PREP}" in line
    else:
        assert outcome == "gave-up" and t >= 7200  # only the timeout ends it


def test_a_final_marker_of_an_earlier_prepare_job_does_not_end_the_wait(tmp_path, api):
    """A final _FAILED that an earlier Job left (before a fix, a new Job of the same arguments) is not the
    running Job's: read through the API, the Job's uid tells them apart; its own final marker counts."""
    api.job = {"metadata": {"uid": "uid-new"}, "status": {}}
    s = settings(tmp_path)
    old = {"fingerprint": FP, "exit_code": 2, "final": True, "pod": "p-old", "job_uid": "uid-old"}
    (s.data_dir / "_FAILED").write_text(json.dumps(old))
    then = {600: write(s.data_dir / "_READY", FP)}
    outcome, _, t = run_wait(s, JobReader(NS, PREP, api.client), then=then)
    assert outcome == "ready" and t >= 600
    (s.data_dir / "_READY").unlink()
    new = {**old, "pod": "p-new", "job_uid": "uid-new", "reason": "error: bad"}
    (s.data_dir / "_FAILED").write_text(json.dumps(new))
    outcome, line, t = run_wait(s, JobReader(NS, PREP, api.client))
    assert outcome == "gave-up" and t == 0 and "in pod p-new" in line and line.count("error: bad") == 1


def test_the_prepare_job_failed(tmp_path, api):
    api.job = {
        "status": {
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "Job has reached the specified backoff limit",
                }
            ]
        }
    }
    outcome, line, t = run_wait(settings(tmp_path), JobReader(NS, PREP, api.client))
    assert outcome == "gave-up" and t == 0
    assert "BackoffLimitExceeded: Job has reached the specified backoff limit" in line


def test_a_missing_prepare_job_gives_up_after_the_grace(tmp_path, api):
    api.job = None
    outcome, line, t = run_wait(settings(tmp_path), JobReader(NS, PREP, api.client))
    assert outcome == "gave-up" and 120 <= t < 150
    assert f"prepare job/{PREP} does not exist" in line


def test_a_complete_job_without_our_marker(tmp_path, api):
    api.job = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    outcome, line, t = run_wait(settings(tmp_path), JobReader(NS, PREP, api.client))
    assert outcome == "gave-up" and 120 <= t < 150 and "completed but" in line


def test_a_running_job_is_waited_for_and_an_api_refusal_falls_back_to_markers(tmp_path, api):
    s = settings(tmp_path)
    outcome, _, t = run_wait(s, JobReader(NS, PREP, api.client), then={900: write(s.data_dir / "_READY", FP)})
    assert outcome == "ready" and t >= 900
    (s.data_dir / "_READY").unlink()
    api.job = 403  # no `get` on jobs (rbac.create=false): markers and the timeout still work
    outcome, _, t = run_wait(settings(tmp_path, timeout_seconds=600), JobReader(NS, PREP, api.client))
    assert outcome == "gave-up" and t >= 600


def _args(tmp_path: Path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    wait.add_arguments(p)
    argv = ["--dir", str(tmp_path / "data"), "--fingerprint", FP, "--poll", "0.05", "--timeout", "0.2"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_giving_up_posts_an_event_and_leaves_a_verdict(tmp_path, api, monkeypatch, capsys):
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(wait, "_kube_client", lambda: api.client)
    monkeypatch.setenv("POD_NAMESPACE", NS)
    api.job = {
        "status": {
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "PodFailurePolicy",
                    "message": "Container prepare failed with exit code 2",
                }
            ]
        }
    }
    verdict = tmp_path / "verdict.json"
    assert wait.run(_args(tmp_path, job=PREP, event_job=PTJ, verdict=verdict)) == 0
    reason = json.loads(verdict.read_text())
    assert (
        reason["code"] == 4
        and "PodFailurePolicy: Container prepare failed with exit code 2" in reason["reason"]
    )
    (ev,) = api.events
    assert ev["path"] == f"/api/v1/namespaces/{NS}/events"
    assert ev["reason"] == "DataNotReady" and ev["type"] == "Warning" and ev["message"] == reason["reason"]
    assert ev["involvedObject"]["kind"] == "PyTorchJob" and ev["involvedObject"]["name"] == PTJ
    assert ev["source"] == {"component": "pretrain-wait-for-data"}
    assert "wait-for-data: gave up: prepare job/" in capsys.readouterr().err


def test_the_cli_without_a_cluster(tmp_path):
    """As the initContainer runs it, outside a cluster: markers only; no verdict file -> exit 4."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "_FAILED").write_text(
        json.dumps({"fingerprint": FP, "exit_code": 2, "final": True, "pod": "p-1"})
    )
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "wait-data",
        "--dir",
        str(data),
        "--fingerprint",
        FP,
        "--poll",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.count("\n") == 1 and "exit 2 in pod p-1" in proc.stderr
    (data / "_FAILED").unlink()
    (data / "_READY").write_text(FP + "\n")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "is ready" in proc.stdout
    bad = subprocess.run([*cmd, "--poll", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
