"""One table of exit codes: app/errors.py's EXIT_CODES is what docs/contracts.md shows and what
`pretrain --help` prints, and every code the job exits with is in it."""

from __future__ import annotations

import re
import subprocess
import sys

from app import errors
from tests.conftest import REPO, cli_env, pretrain

CONTRACTS = REPO / "docs" / "contracts.md"


def test_the_docs_table_is_generated_from_app_errors(tmp_path):
    text = CONTRACTS.read_text()
    table = text.split(errors.TABLE_BEGIN, 1)[1].split(errors.TABLE_END, 1)[0]
    assert table == errors.exit_codes_markdown(), "run `python -m app.errors docs/contracts.md`"
    # the command that keeps it current touches the table alone
    page = tmp_path / "page.md"
    page.write_text(text.replace(table, "| stale |\n"))
    cmd = [sys.executable, "-m", "app.errors", str(page)]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert page.read_text() == text


def test_pretrain_help_prints_the_same_table():
    proc = pretrain("--help", check=True)
    assert errors.exit_codes_help() in proc.stdout
    lines = proc.stdout.split("exit codes (", 1)[1].splitlines()
    listed = [m.group(1) for ln in lines if (m := re.match(r"  (128 \+ N|\d+)\s", ln))]
    assert listed == [e.code for e in errors.EXIT_CODES]


def test_every_code_the_job_exits_with_is_in_the_table():
    from app.trainer.stopping.causes import StopCause, StopDecision

    codes = {e.code for e in errors.EXIT_CODES}
    named = {
        value for name, value in vars(errors).items() if name.startswith("EXIT_") and isinstance(value, int)
    }
    stops = {StopDecision(cause).exit_code for cause in StopCause if cause != StopCause.PREEMPTED}
    missing = {str(c) for c in named | stops | {0, 1}} - codes
    assert not missing, f"exit codes without a row in app/errors.py EXIT_CODES: {sorted(missing)}"
    # preempted: 128 + the signal's number, one row for SIGTERM's 143 and SIGINT's 130
    assert StopDecision(StopCause.PREEMPTED, detail=15).exit_code == 143 and "128 + N" in codes


def test_no_other_page_keeps_a_table_of_its_own():
    """The README and the other pages link to the one table instead of keeping a copy that drifts."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    copies = [p.name for p in pages if p != CONTRACTS and re.search(r"^\| exit code \|", p.read_text(), re.M)]
    assert not copies, copies


def test_a_reader_that_stops_early_gets_no_traceback():
    """`pretrain train --print-config | head -1`: a reader that closes the pipe early (here `true`, gone
    before the first line is written, so the write always finds it closed) ends the command quietly with
    what a command killed by SIGPIPE returns (141), not a BrokenPipeError traceback."""
    script = f"{sys.executable} -m app.cli train --print-config | true; echo ${{PIPESTATUS[0]}} >&2"
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "141", proc.stderr


def test_an_error_line_is_one_write_so_ranks_sharing_a_log_do_not_run_into_each_other(monkeypatch):
    """The image runs unbuffered (PYTHONUNBUFFERED=1), where print() writes a line's text and its newline
    apart: two ranks refusing at once then wrote "error: ...error: ...\\n\\n" into the pod's log."""
    import io

    from app.command import guarded

    class Writes(io.RawIOBase):
        def __init__(self) -> None:
            self.calls: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            self.calls.append(bytes(data))
            return len(data)

    raw = Writes()
    # what Python makes of stderr under PYTHONUNBUFFERED: no buffer, every write passed straight through
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))

    def refuse() -> int:
        raise errors.UserError("every checkpoint is unusable")

    assert guarded(refuse) == errors.EXIT_BAD_INPUT
    assert raw.calls == [b"error: every checkpoint is unusable\n"]
