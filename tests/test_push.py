"""`pretrain push DIR --repo ORG/NAME`: the real CLI in a process of its own, on a Hugging Face export folder
written here (config.json, generation_config.json, safetensors weights, tokenizer files, a model card), so
these tests do not wait for `pretrain export --format hf`.

The real Hub is out of reach here (no network, no account). So the push is tested on both sides of one thin
seam, `app.tools.push.hub_client`:
- our side: a recorder replaces the client (installed by a small driver before the CLI runs) and records the
  create_repo / create_branch / upload_folder calls; the token given to it must be the one huggingface_hub's
  own lookup finds (HF_TOKEN, else the login cache), and must appear in nothing the command prints or logs;
- the client's side: the real huggingface_hub client against a closed port on 127.0.0.1 (a real refused
  connection) and against a small HTTP server that answers like the Hub refusing a token (401), a write
  (403) or failing (500): one line, exit 2, no traceback, no token.
What the Hub itself does with a good token (the upload through its storage backend) is not run here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
TOKEN = "hf_pushTestToken0123456789abcdefXYZ"  # a made-up token: it must never show

# Runs the CLI with the Hub client replaced by a recorder that writes its calls to argv[1] as JSON.
DRIVER = """
import json, logging, sys
import app.tools.push as push

logging.basicConfig(level=logging.DEBUG)  # every logger, ours and huggingface_hub's, to stderr
calls = []
fail = {"upload": None}


class Recorder:
    def __init__(self, token):
        calls.append(["client", {"token": token}])

    def create_repo(self, *args, **kwargs):
        calls.append(["create_repo", list(args), kwargs])
        return "https://hub.invalid/" + args[0]

    def create_branch(self, *args, **kwargs):
        calls.append(["create_branch", list(args), kwargs])

    def upload_folder(self, **kwargs):
        calls.append(["upload_folder", [], kwargs])
        if "RECORDER_CRASH" in __import__("os").environ:
            raise RuntimeError("backend crashed while sending " + kwargs["repo_id"] + " with " + calls[0][1]["token"])
        return type("CommitInfo", (), {"commit_url": "https://hub.invalid/commit/abc123"})()


push.hub_client = Recorder
from app.cli import main

try:
    rc = main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump(calls, f)
sys.exit(rc)
"""


def write_export(out: Path, sharded: bool = False) -> Path:
    """A folder shaped like `pretrain export --format hf` writes: small real safetensors weights."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "max_new_tokens": 64}))
    (out / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel"}}))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (out / "README.md").write_text("---\nlibrary_name: transformers\n---\n# tiny\n")
    weights = {"model.embed_tokens.weight": torch.randn(64, 16), "lm_head.weight": torch.randn(64, 16)}
    if sharded:
        names = {}
        for i, (key, tensor) in enumerate(weights.items()):
            shard = f"model-0000{i + 1}-of-00002.safetensors"
            save_file({key: tensor}, str(out / shard))
            names[key] = shard
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    else:
        save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.fixture
def export_dir(tmp_path) -> Path:
    return write_export(tmp_path / "tiny-hf")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The user's environment without a token or a login cache of theirs (HF_HOME is the test's), and a
    Hub endpoint nothing listens on: a call that should not happen fails."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    base.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}",
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    base.update(extra)
    return base


def pretrain(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def recorded(tmp_path: Path, *args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list]:
    """`pretrain ARGS` with the Hub client replaced by the recorder: the process and the calls it made."""
    calls = tmp_path / "calls.json"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(calls), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    return proc, json.loads(calls.read_text()) if calls.exists() else []


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The one line of a refused command: exit 2, that line on stderr, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


# ---- --dry-run -------------------------------------------------------------------------------------------


def test_dry_run_lists_files_sizes_total_and_target_without_a_token_or_network(tmp_path, export_dir):
    (export_dir / ".cache" / "huggingface").mkdir(parents=True)  # huggingface_hub's upload cache: never sent
    (export_dir / ".cache" / "huggingface" / "upload.lock").write_text("x")
    proc = pretrain(
        "push",
        str(export_dir),
        "--repo",
        "my-org/tiny",
        "--revision",
        "v1",
        "--private",
        "--dry-run",
        env=env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "my-org/tiny (revision v1, private)" in out and "nothing uploaded (--dry-run)" in out
    sizes = {p.name: p.stat().st_size for p in export_dir.iterdir() if p.is_file()}
    listed = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(listed) == {*sizes, "total"}, out
    assert listed["README.md"].split()[1:] == [str(sizes["README.md"]), "B"]
    weights = sizes["model.safetensors"]
    assert f"{weights / 1000:.1f} kB" in listed["model.safetensors"]
    assert f"({sum(sizes.values())} bytes)" in listed["total"]
    assert f"would upload {len(sizes)} files" in out


def test_a_sharded_export_is_an_export_and_a_missing_or_stray_shard_is_one_line(tmp_path):
    folder = write_export(tmp_path / "sharded", sharded=True)
    proc = pretrain("push", str(folder), "--repo", "org/name", "--dry-run", env=env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "model-00002-of-00002.safetensors" in proc.stdout
    # an earlier unsharded export's file beside the shards: transformers would load it, not the shards
    (folder / "model.safetensors").write_bytes((folder / "model-00001-of-00002.safetensors").read_bytes())
    line = one_line(pretrain("push", str(folder), "--repo", "org/name", "--dry-run", env=env(tmp_path)))
    assert "holds weights its export does not name (model.safetensors)" in line and "empty folder" in line
    (folder / "model.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").unlink()
    line = one_line(pretrain("push", str(folder), "--repo", "org/name", "--dry-run", env=env(tmp_path)))
    assert "lacks 1 weight shard" in line and "model-00002-of-00002.safetensors" in line


# ---- the push, through the recorder ------------------------------------------------------------------------


def test_push_creates_the_repo_and_branch_and_uploads_the_folder_with_the_env_token(tmp_path, export_dir):
    proc, calls = recorded(
        tmp_path,
        "push",
        str(export_dir),
        "--repo",
        "my-org/tiny",
        "--private",
        "--revision",
        "v1",
        "--commit-message",
        "tiny after 100 steps",
        env=env(tmp_path, HF_TOKEN=TOKEN),
    )
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        ["client", {"token": TOKEN}],
        ["create_repo", ["my-org/tiny"], {"repo_type": "model", "private": True, "exist_ok": True}],
        ["create_branch", ["my-org/tiny"], {"branch": "v1", "repo_type": "model", "exist_ok": True}],
        [
            "upload_folder",
            [],
            {
                "repo_id": "my-org/tiny",
                "folder_path": str(export_dir),
                "repo_type": "model",
                "revision": "v1",
                "commit_message": "tiny after 100 steps",
                # the repo's weights this export does not carry go in the same commit
                "delete_patterns": ["*.safetensors", "*.safetensors.index.json"],
            },
        ],
    ]
    assert "huggingface_hub shows the upload's progress" in proc.stdout
    assert "https://hub.invalid/commit/abc123" in proc.stdout
    assert TOKEN not in proc.stdout + proc.stderr  # stderr carries every logger at DEBUG


def test_push_without_private_leaves_visibility_to_the_hub_and_uses_the_login_cache(tmp_path, export_dir):
    """No HF_TOKEN: the token `hf auth login` cached (HF_HOME/token) is the one used. On main, no branch is
    created, and the commit message names the folder."""
    home = tmp_path / "hf-home"
    home.mkdir()
    (home / "token").write_text(TOKEN)
    proc, calls = recorded(tmp_path, "push", str(export_dir), "--repo", "me/tiny", env=env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert [c[0] for c in calls] == ["client", "create_repo", "upload_folder"]
    assert calls[0][1] == {"token": TOKEN}
    assert calls[1][2]["private"] is None  # public, unless the organization's default is private
    assert calls[2][2]["revision"] == "main"
    assert calls[2][2]["commit_message"] == "Upload tiny-hf with pretrain push"
    assert TOKEN not in proc.stdout + proc.stderr


def test_a_crash_of_the_client_is_not_a_one_liner_but_never_shows_the_token(tmp_path, export_dir):
    """An error no user input explains (here the client raises with the token in its message) stays a
    crash, exit 1 with a traceback, and the message it re-raises has the token cut out."""
    proc, calls = recorded(
        tmp_path,
        "push",
        str(export_dir),
        "--repo",
        "org/name",
        env=env(tmp_path, HF_TOKEN=TOKEN, RECORDER_CRASH="1"),
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert (
        "push to org/name failed: RuntimeError: backend crashed while sending org/name with <token>"
        in proc.stderr
    )
    assert TOKEN not in proc.stdout + proc.stderr
    assert calls[-1][0] == "upload_folder"


# ---- what is refused: one line, exit 2, before any call ------------------------------------------------


@pytest.mark.parametrize(
    "make, expect",
    [
        (lambda d: None, "is not a directory"),
        (lambda d: d.mkdir(), "no config.json"),
        (lambda d: (write_export(d), (d / "model.safetensors").unlink()), "has no weights"),
        (lambda d: (write_export(d), (d / "config.json").write_text("{not json")), "cannot be read as JSON"),
    ],
    ids=["missing", "empty", "no-weights", "bad-config"],
)
def test_a_folder_that_is_not_an_export_is_refused_before_anything_else(tmp_path, make, expect):
    folder = tmp_path / "out"
    make(folder)
    # a bad repo name and no token too: the folder is checked first
    proc, calls = recorded(tmp_path, "push", str(folder), "--repo", "bad name", env=env(tmp_path))
    line = one_line(proc)
    assert expect in line and "pretrain export RUN_DIR --output" in line and "--format hf" in line
    assert calls == []


@pytest.mark.parametrize(
    "repo",
    [
        "tiny",
        "org/",
        "/tiny",
        "a/b/c",
        "org/ti ny",
        "org/ti--ny",
        "org/ti..ny",
        "org/-tiny",
        "org/tiny.git",
        "org/" + "x" * 97,
    ],
)
def test_a_repo_name_the_hub_refuses_is_one_line(tmp_path, export_dir, repo):
    proc, calls = recorded(
        tmp_path, "push", str(export_dir), "--repo", repo, env=env(tmp_path, HF_TOKEN=TOKEN)
    )
    line = one_line(proc)
    assert f"--repo {repo!r}: a Hub repo is ORG/NAME" in line
    assert calls == []


@pytest.mark.parametrize("repo", ["org/tiny", "Org_1/tiny.v2-final", "o/" + "x" * 96])
def test_repo_names_the_hub_accepts(tmp_path, export_dir, repo):
    assert pretrain("push", str(export_dir), "--repo", repo, "--dry-run", env=env(tmp_path)).returncode == 0


def test_no_token_is_one_line_that_says_how_to_get_one(tmp_path, export_dir):
    proc, calls = recorded(tmp_path, "push", str(export_dir), "--repo", "org/name", env=env(tmp_path))
    line = one_line(proc)
    assert "no Hugging Face token" in line and "HF_TOKEN" in line and "hf auth login" in line
    assert calls == []


# ---- the real client, against what a network answers ----------------------------------------------------


def test_a_refused_connection_is_one_line(tmp_path, export_dir):
    port = closed_port()
    proc = pretrain(
        "push",
        str(export_dir),
        "--repo",
        "org/name",
        env=env(tmp_path, HF_TOKEN=TOKEN, HF_ENDPOINT=f"http://127.0.0.1:{port}"),
    )
    line = one_line(proc)
    assert f"cannot reach the Hub at http://127.0.0.1:{port}" in line and "HF_ENDPOINT" in line
    assert TOKEN not in proc.stdout + proc.stderr


class FakeHub:
    """An HTTP server on 127.0.0.1 answering every request with one status and a Hub-style error body;
    it records the requests' paths and Authorization headers."""

    def __init__(self, status: int):
        self.requests: list[tuple[str, str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                hub.requests.append((self.command, self.path, self.headers.get("Authorization", "")))
                # a Hub that echoes the credentials it refused: the command must not pass them on
                body = json.dumps({"error": f"refused {self.headers.get('Authorization', '')}"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    "status, expect",
    [
        (401, "the Hub refused the token (HTTP 401"),
        (403, "the token may not write to org/name (HTTP 403"),
        (500, "answered HTTP 500"),
    ],
)
def test_an_http_error_of_the_hub_is_one_line_without_the_token(tmp_path, export_dir, status, expect):
    hub = FakeHub(status)
    try:
        proc = pretrain(
            "push",
            str(export_dir),
            "--repo",
            "org/name",
            env=env(tmp_path, HF_TOKEN=TOKEN, HF_ENDPOINT=hub.url),
        )
    finally:
        hub.close()
    line = one_line(proc)
    assert expect in line, line
    (create,) = [r for r in hub.requests if r[:2] == ("POST", "/api/repos/create")]
    assert create[2] == f"Bearer {TOKEN}"  # the token reached the Hub, and nothing the user reads
    assert TOKEN not in proc.stdout + proc.stderr
