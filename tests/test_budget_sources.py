"""Cost sources: static, the billing JSON file (good, bad, malformed, stale), OpenCost over real HTTP, and the
watcher's fallback to the static rate when a source fails."""

from __future__ import annotations

import json
import threading
import urllib.parse
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.budget.metrics import BudgetMetrics
from app.budget.sources import FileSource, OpenCostSource, StaticSource, parse_utc
from app.budget.watcher import Watcher
from app.config.budget import BudgetConfig

T = 1_700_000_000.0


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def billing(spent=5.0, rate=12.0, updated=T, **extra) -> dict:
    data = {
        "spent_usd": spent,
        "rate_usd_per_hr": rate,
        "hours_elapsed": 1.5,
        "projected_total_usd": 30.0,
        "last_update_utc": iso(updated),
    }
    data.update(extra)
    return data


def test_static_reports_its_rate():
    r = StaticSource(14.32).read(T)
    assert r.ok and r.spent_usd is None and r.rate_usd_per_hour == 14.32


def test_parse_utc_forms():
    assert parse_utc("2023-11-14T22:13:20Z") == T
    assert parse_utc("2023-11-14T22:13:20") == T  # no offset: UTC
    assert parse_utc("2023-11-15T00:13:20+02:00") == T
    for bad in ("yesterday", "", 1700000000, None):
        with pytest.raises(ValueError):
            parse_utc(bad)


def test_file_source_reads_the_seed_shape(tmp_path):
    path = tmp_path / "spend.json"
    path.write_text(json.dumps(billing(updated=T - 30)))
    r = FileSource(str(path), stale_seconds=300).read(T)
    assert r.ok and r.spent_usd == 5.0 and r.rate_usd_per_hour == 12.0 and r.updated_unix == T - 30


@pytest.mark.parametrize(
    "content, error",
    [
        (None, "does not exist"),
        ("{oops", "not valid JSON"),
        ("[]", "must hold a JSON object"),
        (json.dumps({k: v for k, v in billing().items() if k != "spent_usd"}), "missing 'spent_usd'"),
        (
            json.dumps({k: v for k, v in billing().items() if k != "rate_usd_per_hr"}),
            "missing 'rate_usd_per_hr'",
        ),
        (
            json.dumps({k: v for k, v in billing().items() if k != "last_update_utc"}),
            "missing 'last_update_utc'",
        ),
        (json.dumps(billing(spent=-1)), "'spent_usd' must be a number >= 0"),
        (json.dumps(billing(spent="5")), "'spent_usd' must be a number >= 0"),
        (json.dumps(billing(rate=True)), "'rate_usd_per_hr' must be a number >= 0"),
        (json.dumps(billing()).replace("5.0", "NaN", 1), "'spent_usd' must be a number >= 0"),
        (json.dumps(billing(hours_elapsed=-2)), "'hours_elapsed' must be a number >= 0"),
        (json.dumps(billing(last_update_utc="last tuesday")), "Invalid isoformat"),
        (json.dumps(billing(last_update_utc=12345)), "expected an ISO-8601 time"),
    ],
)
def test_bad_and_malformed_files_fail_with_one_line(tmp_path, content, error):
    path = tmp_path / "spend.json"
    if content is not None:
        path.write_text(content)
    r = FileSource(str(path), stale_seconds=300).read(T)
    assert not r.ok and error in r.error and "\n" not in r.error


def test_a_stale_file_fails_but_keeps_its_spend_as_a_lower_bound(tmp_path):
    path = tmp_path / "spend.json"
    path.write_text(json.dumps(billing(spent=7.0, updated=T - 301)))
    r = FileSource(str(path), stale_seconds=300).read(T)
    assert not r.ok and r.error.startswith("stale: last update 301 s ago") and r.spent_usd == 7.0


def test_a_file_from_the_future_fails(tmp_path):
    path = tmp_path / "spend.json"
    path.write_text(json.dumps(billing(updated=T + 3600)))
    r = FileSource(str(path), stale_seconds=300).read(T)
    assert not r.ok and "in the future" in r.error


def test_watcher_extrapolates_then_falls_back_to_the_static_rate_and_recovers(tmp_path):
    path = tmp_path / "spend.json"
    c = BudgetConfig(
        cap_usd=100.0, source="file", source_path=str(path), poll_seconds=10, stale_seconds=300, kube="off"
    )
    metrics = BudgetMetrics()
    path.write_text(json.dumps(billing(spent=5.0, rate=36.0, updated=T - 100)))
    w = Watcher(
        c,
        run_dir=tmp_path,
        stop_file=tmp_path / "stop.json",
        static_rate_usd_per_hour=18.0,
        metrics=metrics,
        now=T,
    )
    v = w.tick(T)
    assert v.source_healthy and v.spent_usd == pytest.approx(6.0)  # $5 + 100 s at $36/h
    path.write_text("{garbage")
    v = w.tick(T + 100)
    # the fallback is the larger of the static rate and the source's last good rate: never under-count
    assert not v.source_healthy and v.rate_usd_per_hour == 36.0 and v.spent_usd == pytest.approx(7.0)
    assert "not valid JSON" in v.source_error
    w.tick(T + 200)
    assert metrics.registry.get_sample_value("pretrain_budget_source_fallbacks_total") == 1.0
    assert metrics.registry.get_sample_value("pretrain_budget_source_up", {"source": "file"}) == 0.0
    state = json.loads((tmp_path / "budget" / "state.json").read_text())
    assert state["source_healthy"] is False and state["source"] == "file"
    path.write_text(json.dumps(billing(spent=9.5, rate=36.0, updated=T + 300)))
    v = w.tick(T + 300)
    assert v.source_healthy and v.spent_usd == pytest.approx(9.5)  # the source's figure wins when higher
    assert metrics.registry.get_sample_value("pretrain_budget_source_up", {"source": "file"}) == 1.0
    path.write_text(json.dumps(billing(spent=1.0, rate=36.0, updated=T + 400)))
    assert w.tick(T + 400).spent_usd == pytest.approx(9.5)  # spend never goes down
    w.close(T + 400)


# ---------------------------------------------------------------- OpenCost over real HTTP

JOB = "pretrain-demo"


def allocation(name: str, total: float, start: float, end: float, gpu: float = 0.0) -> dict:
    """One allocation in OpenCost's /allocation/compute shape (trimmed to the fields that matter plus a few)."""
    return {
        "name": name,
        "properties": {"cluster": "cluster-one", "namespace": "ml", "controllerKind": "pytorchjob"},
        "window": {"start": iso(start - start % 86400), "end": iso(start - start % 86400 + 86400)},
        "start": iso(start),
        "end": iso(end),
        "minutes": (end - start) / 60,
        "cpuCores": 8.0,
        "cpuCost": total - gpu,
        "gpuCount": 1.0,
        "gpuHours": (end - start) / 3600,
        "gpuCost": gpu,
        "ramCost": 0.0,
        "pvCost": 0.0,
        "networkCost": 0.0,
        "sharedCost": 0.0,
        "externalCost": 0.0,
        "totalCost": total,
        "totalEfficiency": 0.5,
    }


class FakeOpenCost:
    """A real HTTP server on 127.0.0.1 answering GET /allocation/compute like OpenCost does."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []
        self.body: object = {"code": 200, "status": "success", "data": []}
        self.status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urllib.parse.urlsplit(self.path)
                fake.requests.append((url.path, dict(urllib.parse.parse_qsl(url.query))))
                payload = json.dumps(fake.body).encode() if not isinstance(fake.body, bytes) else fake.body
                self.send_response(fake.status if url.path == "/allocation/compute" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def opencost():
    server = FakeOpenCost()
    yield server
    server.close()


def test_opencost_query_and_total(opencost):
    opencost.body = {
        "code": 200,
        "status": "success",
        "data": [
            {
                f"training.kubeflow.org/job-name={JOB}": allocation(
                    f"x={JOB}", 4.0, T - 3600, T - 60, gpu=3.5
                ),
                "__idle__": allocation("__idle__", 50.0, T - 3600, T - 60),
                "other-job": allocation("other-job", 9.0, T - 3600, T - 60),
            }
        ],
    }
    src = OpenCostSource(opencost.url, f"label:training.kubeflow.org/job-name:{JOB}", T - 7200, 300)
    r = src.read(T)
    assert r.ok and r.spent_usd == 4.0 and r.updated_unix == T - 60
    assert r.rate_usd_per_hour == pytest.approx(4.0 / (3540 / 3600))  # average since the allocation started
    path, q = opencost.requests[-1]
    assert path == "/allocation/compute"
    assert q == {
        "window": f"{int(T - 7200)},{int(T)}",
        "aggregate": "label:training_kubeflow_org_job_name",  # Prometheus form of the label name
        "accumulate": "true",
    }


def test_opencost_rate_from_successive_reads_and_plain_value_names(opencost):
    src = OpenCostSource(opencost.url, "namespace:ml", T - 7200, 300)
    opencost.body = {"code": 200, "data": [{"ml": allocation("ml", 10.0, T - 3600, T - 600)}]}
    assert src.read(T).spent_usd == 10.0
    opencost.body = {"code": 200, "data": [{"ml": allocation("ml", 12.0, T - 3600, T)}]}
    r = src.read(T + 60)
    assert r.ok and r.spent_usd == 12.0 and r.rate_usd_per_hour == pytest.approx(12.0)  # $2 in 600 s


def test_opencost_sums_step_sets(opencost):
    opencost.body = {
        "code": 200,
        "data": [
            {"ml": allocation("ml", 1.5, T - 7000, T - 3600)},
            {"ml": allocation("ml", 2.5, T - 3600, T - 30)},
        ],
    }
    r = OpenCostSource(opencost.url, "namespace:ml", T - 7200, 300).read(T)
    assert r.ok and r.spent_usd == 4.0


@pytest.mark.parametrize(
    "status, body, error",
    [
        (
            200,
            {"code": 200, "data": [{"someone-else": allocation("x", 1, T - 100, T)}]},
            "no allocation named",
        ),
        (200, {"code": 400, "message": "invalid window"}, "code 400: invalid window"),
        (200, {"code": 200, "data": "nope"}, "'data' must be a list"),
        (200, b"<html>proxy error</html>", "unexpected OpenCost response"),
        (200, {"code": 200, "data": [{"ml": {"name": "ml", "totalCost": -1, "end": iso(T)}}]}, "totalCost"),
        (500, {"code": 500}, "HTTP 500"),
    ],
)
def test_opencost_failures_are_one_line(opencost, status, body, error):
    opencost.status, opencost.body = status, body
    r = OpenCostSource(opencost.url, "namespace:ml", T - 7200, 300).read(T)
    assert not r.ok and error in r.error and "\n" not in r.error


def test_opencost_stale_data_falls_back(opencost):
    opencost.body = {"code": 200, "data": [{"ml": allocation("ml", 3.0, T - 3600, T - 900)}]}
    r = OpenCostSource(opencost.url, "namespace:ml", T - 7200, 300).read(T)
    assert not r.ok and r.error.startswith("stale") and r.spent_usd == 3.0


def test_opencost_unreachable():
    r = OpenCostSource("http://127.0.0.1:9", "namespace:ml", T, 300, timeout=1).read(T)
    assert not r.ok and "cannot reach OpenCost" in r.error


def test_watcher_charges_what_opencost_reports(opencost, tmp_path):
    opencost.body = {"code": 200, "data": [{"ml": allocation("ml", 20.0, T - 3600, T - 10)}]}
    c = BudgetConfig(
        cap_usd=100.0,
        source="opencost",
        opencost_url=opencost.url,
        opencost_selector="namespace:ml",
        kube="off",
    )
    w = Watcher(c, run_dir=tmp_path, stop_file=tmp_path / "stop.json", static_rate_usd_per_hour=0.0, now=T)
    v = w.tick(T)
    assert (
        v.source == "opencost" and v.source_healthy and v.spent_usd == pytest.approx(20.0 + 20.0 * 10 / 3590)
    )
    # the window starts at the run's first session, kept in the ledger across restarts
    # (at least a minute wide, so a brand-new run still asks OpenCost for a valid window)
    assert opencost.requests[-1][1]["window"] == f"{int(T) - 60},{int(T)}"
    w.close(T + 1)
