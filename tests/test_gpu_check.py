"""`make gpu-check` (scripts/gpu_check.py): the expected ranges are docs/performance.md's, the figures are
judged against them only on a GPU, and the whole script runs on CPU in its dry mode. No test here needs
a GPU."""

from __future__ import annotations

import importlib.util
import json
import shutil
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
    labels = [label for label, *_ in check.RUNS]
    assert labels == [
        *(f"{p} {k}" for p in ("x1-50m", "gpt2-124m") for k in ("compiled", "eager", "fp8")),
        "gpt2-124m-speedrun compiled",
        "gpt2-124m-speedrun fp8",  # ReLU²: FP8 with w_down kept in bf16
    ]


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
    assert values["recompiles, x1-50m and gpt2-124m"] == 0
    assert values["x1-50m compiled peak / estimate"] == pytest.approx(0.9)
    assert values["gpt2-124m-speedrun compiled recompiles"] is None  # not measured
    assert check.judge("x1-50m compiled MFU", 0.38, "h100-sxm", dry=False) is True
    assert check.judge("x1-50m compiled MFU", 0.20, "h100-sxm", dry=False) is False
    assert check.judge("x1-50m compiled MFU", 0.20, "a100-80gb", dry=False) is None  # another GPU's peak
    assert check.judge("sdpa GQA", "math", "a100-80gb", dry=False) is False
    assert check.judge("recompiles, x1-50m and gpt2-124m", 1, "h100-sxm", dry=False) is False
    assert check.judge("recompiles, x1-50m and gpt2-124m", 0, "h100-sxm", dry=True) is None
    assert check.judge("gpt2-124m-speedrun compiled recompiles", 5, "h100-sxm", dry=False) is True
    assert check.judge("x1-50m fp8 / bf16 tokens/s", None, "h100-sxm", dry=False) is None


def test_peak_memory_is_compared_with_the_estimate_without_the_cuda_context():
    """The allocator never counts the CUDA context, NCCL's buffers or fragmentation (the estimate's 3 GiB
    overhead): a run on CUDA is judged against the estimate less that, a CPU run (no overhead) as it is."""
    from app.trainer.parallel.memory import CUDA_OVERHEAD, GB

    check = gpu_check()
    estimate = int(30 * GB)
    cuda = {
        "device": "cuda",
        "peak_memory_bytes": int(27 * GB),
        "estimated_memory_bytes": estimate + CUDA_OVERHEAD,
    }
    cpu = {"device": "cpu", "peak_memory_bytes": int(27 * GB), "estimated_memory_bytes": estimate}
    for run in (cuda, cpu):
        values = check.figures(
            {"x1-50m compiled": run}, {"MHA": "flash", "GQA": "flash"}, True, "", dry=False
        )
        assert values["x1-50m compiled peak / estimate"] == pytest.approx(0.9)
        assert check.judge("x1-50m compiled peak / estimate", 0.9, "h100-sxm", dry=False) is True


def test_each_bench_is_capped_so_a_hung_one_leaves_time_for_the_rest():
    check = gpu_check()
    assert check.bench_cap(480, 8) == 120  # twice its share of what is left
    assert check.bench_cap(100, 1) == 100  # the last one gets what is left
    assert check.bench_cap(480, 8, fixed=60) == 60 and check.bench_cap(30, 8, fixed=60) == 30
    # a first bench that hangs for its whole cap leaves the next its own cap, and so on to the last
    left = 9.5 * 60
    for benches_left in range(len(check.RUNS), 0, -1):
        cap = check.bench_cap(left, benches_left)
        assert cap > 0
        left -= cap / 2  # each one hangs for half its cap: the time still lasts to the end
    assert left > 0


def test_a_bench_past_its_cap_is_killed_reported_timed_out_and_the_report_still_written(tmp_path):
    """Every bench capped at half a second (none finishes: starting torch alone takes longer): each one is
    killed with its process group, reported TIMED OUT, and the script still ends with the full report."""
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--dry-run", "--bench-seconds", "0.5", "--out", str(out)],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    check = gpu_check()
    assert {label: r["error"] for label, r in report["runs"].items()} == {
        label: "TIMED OUT after 0.5 s" for label, *_ in check.RUNS
    }
    assert [row["name"] for row in report["figures"]] == list(check.EXPECTED)
    assert (
        f"{len(check.RUNS)} runs not measured ({len(check.RUNS)} timed out)" in proc.stdout.splitlines()[-1]
    )
    assert not list((tmp_path / "gpu-check.runs").glob("*.json"))  # none got as far as writing its figures


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_make_gpu_check_without_a_driver_prints_one_line_and_exits_2():
    """What a user on a machine without a GPU sees: one line on stdout, exit 2, no traceback (make adds its
    own "Error 2" line on stderr)."""
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-check"],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu-check: no NVIDIA driver here (nvidia-smi not found): run this on the GPU machine, "
        "or --dry-run to check the script"
    ]


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


@pytest.mark.slow  # eight benches in their own processes, three of them compiling (minutes on 2 loaded cores)
def test_the_dry_run_measures_every_figure_on_cpu(tmp_path):
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        # caps far above a toy bench's time, even compiling on 2 loaded cores: this checks the plumbing
        [sys.executable, "scripts/gpu_check.py", "--dry-run", "--minutes", "24", "--bench-seconds", "400"]
        + ["--out", str(out)],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=1500,
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
    assert rows["recompiles, x1-50m and gpt2-124m"]["value"] == 0 and rows["graph breaks"]["value"] == 0
    # the speedrun's kinds of blocks are graphs of their own: what gpu-check expects on the GPU (the dry run
    # keeps the preset's depth, and dynamo's guards do not depend on the device)
    expected = check.EXPECTED["gpt2-124m-speedrun compiled recompiles"]
    assert (rows["gpt2-124m-speedrun compiled recompiles"]["value"],) * 2 == expected
    assert rows["x1-50m micro-batch as planned"]["value"] is True
    for preset in ("x1-50m", "gpt2-124m"):
        assert rows[f"{preset} eager / compiled tokens/s"]["value"] > 0
    for preset in ("x1-50m", "gpt2-124m", "gpt2-124m-speedrun"):
        assert rows[f"{preset} fp8 / bf16 tokens/s"]["value"] > 0
        assert report["runs"][f"{preset} compiled"]["compile"] is True
    assert "figures in range" in proc.stdout.splitlines()[-1]
