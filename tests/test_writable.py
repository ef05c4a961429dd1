"""An output this user cannot write (a fresh PVC owned by root, a read-only mount, a path under /proc or
/sys): every subcommand that writes says so in one line naming the path, the uid and the fsGroup fix, and
exits 2 before doing any work. An output that is a file (or lies under one) gets its own line: ownership
is not the problem there, another path is the fix. No traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FAST, REPO, pretrain

WATCH = ["watch", "--kube", "off", "--budget-cap-usd", "1", "--price-per-gpu-hour", "2", "--gpus", "1"]
COMMANDS = {
    "train": ["train", *FAST, "--max-steps", "2", "--out"],
    "prepare": ["prepare", "--input", str(REPO / "README.md"), "--out"],
    "watch": [*WATCH, "--metrics-port", "0", "--run-dir"],
    "watch-dry-run": [*WATCH, "--dry-run-budget", "--run-dir"],
    "export": ["export", "{run}", "--output"],
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    pretrain("train", "--out", str(run), *FAST, "--max-steps", "2", check=True)
    return run


@pytest.fixture
def locked(tmp_path) -> Path:
    """A directory this process cannot create files in: mode 555, or for root (who ignores modes)
    the immutable attribute, which binds root too."""
    d = tmp_path / "volume"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
    elif not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(d)]).returncode != 0:
        pytest.skip("running as root on a filesystem without chattr +i: no directory is unwritable")
    yield d
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(d)], check=True)
    d.chmod(0o755)


def check(proc: subprocess.CompletedProcess, path: Path) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(path) in lines[0] and f"uid {os.getuid()}" in lines[0], lines[0]
    assert "fsGroup" in lines[0] and "chown" in lines[0], lines[0]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("where", ["/proc/pretrain-out", "/sys/pretrain-out"])
def test_an_output_under_proc_or_sys_is_one_line_exit_2(command, where, run_dir):
    args = [a.replace("{run}", str(run_dir)) for a in COMMANDS[command]]
    check(pretrain(*args, where), Path(where))
    assert not Path(where).exists()


@pytest.mark.parametrize(
    "command, under",
    [(c, False) for c in COMMANDS] + [("train", True), ("watch", True)],
    ids=[*COMMANDS, "train-under-the-file", "watch-under-the-file"],
)
def test_an_output_that_is_a_file_says_so_not_chown(command, under, run_dir, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    out = blocker / "run" if under else blocker
    args = [a.replace("{run}", str(run_dir)) for a in COMMANDS[command]]
    proc = pretrain(*args, str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(out) in lines[0] and "not a directory" in lines[0].lower(), lines[0]
    assert "fsGroup" not in lines[0] and "chown" not in lines[0], lines[0]
    assert blocker.read_text() == "mine\n"


@pytest.mark.parametrize("command", ["train", "watch-dry-run", "prepare"])
def test_a_root_owned_volume_is_one_line_exit_2_and_nothing_is_written(command, locked):
    out = locked / "run"
    check(pretrain(*COMMANDS[command], str(out)), out)
    assert list(locked.iterdir()) == []


def test_dry_run_budget_passes_on_a_writable_run_dir(tmp_path):
    proc = pretrain(*COMMANDS["watch-dry-run"], str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "writable" in proc.stdout and "NOT writable" not in proc.stdout
