"""`make gpu-check` (scripts/gpu_check.py): the expected ranges are docs/performance.md's, the figures are
judged against them only on a GPU, and the whole script runs on CPU in its dry mode. No test here needs
a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_expected_range_is_the_one_docs_give():
    check = gpu_check()
    docs = (REPO / "docs" / "performance.md").read_text()
    for row in check.expected_rows():
        assert row in docs, f"docs/performance.md lacks: {row}"
    assert set(check.EXPECTED) == set(check.WHY)
    labels = {label for label, *_ in check.RUNS}
    assert labels == {f"{p} {k}" for p in ("x1-50m", "gpt2-124m") for k in ("compiled", "eager", "fp8")}


def test_figures_are_judged_on_a_gpu_only_and_mfu_on_hopper_only():
    check = gpu_check()
    run = {
        "tokens_per_second": 100.0,
        "mfu": 0.38,
        "peak_memory_bytes": 90,
        "estimated_memory_bytes": 100,
        "layout": {"micro_batch_size": 64},
        "recompiles": 0,
        "graph_breaks": 0,
    }
    runs = {
        "x1-50m compiled": run,
        "x1-50m eager": {**run, "tokens_per_second": 70.0},
        "x1-50m fp8": {"error": "exit 1: boom"},
    }
    values = check.figures(runs, {"MHA": "flash", "GQA": "math"}, True, "h100-sxm", dry=False)
    assert values["x1-50m eager / compiled tokens/s"] == pytest.approx(0.7)
    assert values["x1-50m fp8 / bf16 tokens/s"] is None and values["gpt2-124m compiled MFU"] is None
    assert values["recompiles"] == 0 and values["x1-50m compiled peak / estimate"] == pytest.approx(0.9)
    assert check.judge("x1-50m compiled MFU", 0.38, "h100-sxm", dry=False) is True
    assert check.judge("x1-50m compiled MFU", 0.20, "h100-sxm", dry=False) is False
    assert check.judge("x1-50m compiled MFU", 0.20, "a100-80gb", dry=False) is None  # another GPU's peak
    assert check.judge("sdpa GQA", "math", "a100-80gb", dry=False) is False
    assert check.judge("recompiles", 1, "h100-sxm", dry=False) is False
    assert check.judge("recompiles", 0, "h100-sxm", dry=True) is None
    assert check.judge("x1-50m fp8 / bf16 tokens/s", None, "h100-sxm", dry=False) is None


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "g.json")],
        cwd=REPO,
        env=cli_env(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--dry-run" in proc.stdout and not (tmp_path / "g.json").exists()


@pytest.mark.slow  # six benches in their own processes, two of them compiling (minutes on 2 loaded cores)
def test_the_dry_run_measures_every_figure_on_cpu(tmp_path):
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["device"]["device"] == "cpu" and report["device"]["torch"]
    assert not [label for label, r in report["runs"].items() if "error" in r], report["runs"]
    rows = {row["name"]: row for row in report["figures"]}
    check = gpu_check()
    assert list(rows) == list(check.EXPECTED)
    for name, row in rows.items():
        assert row["expected"] == check.show(check.EXPECTED[name]) and row["in_range"] is None, row
    assert rows["sdpa MHA"]["value"] == rows["sdpa GQA"]["value"] == "flash (cpu)"
    assert rows["data pinned contiguous int32"]["value"] is True
    assert rows["recompiles"]["value"] == 0 and rows["graph breaks"]["value"] == 0
    assert rows["x1-50m micro-batch as planned"]["value"] is True
    for preset in ("x1-50m", "gpt2-124m"):
        assert rows[f"{preset} eager / compiled tokens/s"]["value"] > 0
        assert rows[f"{preset} fp8 / bf16 tokens/s"]["value"] > 0
        assert report["runs"][f"{preset} compiled"]["compile"] is True
    assert "figures in range" in proc.stdout.splitlines()[-1]
