"""`pretrain prepare --input hf://datasets/...` against a local HTTP server that answers like the HF Hub.

The real huggingface_hub code runs (HF_ENDPOINT points it at 127.0.0.1): repo info, paginated tree
listing, HEAD + GET on resolve URLs, the download cache. No network.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.data.manifest import Manifest
from app.data.shards import open_shard
from app.data.tokenizer import load_tokenizer, train_bpe
from tests.procs import Proc

ROOT = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_testsecret_do_not_log_1234567890"


class FakeHub:
    """Repos: {repo_id: {"type": "dataset"|"model", "files": {path: bytes}, "access": "public"|"private"|"gated"}}."""

    def __init__(self, repos: dict) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.slow = False
        self.release = threading.Event()  # a slow link sends the rest of a file only once this is set
        self.auth_seen: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def do_GET(self) -> None:
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- responses ---------------------------------------------------------------------------------

    def _send(
        self, h, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False
    ) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if head:
            return
        if not self.slow or len(body) < 21 << 19:
            h.wfile.write(body)
            return
        # A link that stalls after 10.5 MB (huggingface_hub writes to disk in 10 MiB chunks) until
        # `release` is set, so a download can be interrupted with part of the file on disk.
        fast = 21 << 19
        h.wfile.write(body[:fast])
        h.wfile.flush()
        self.release.wait(120)
        try:
            h.wfile.write(body[fast:])
            h.wfile.flush()
        except OSError:  # the client was killed meanwhile
            pass

    def _json(self, h, data, headers: dict | None = None, head: bool = False) -> None:
        self._send(
            h, 200, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})}, head
        )

    def _error(self, h, status: int, code: str, head: bool) -> None:
        msg = {"RepoNotFound": "Repository not found", "GatedRepo": "Access to this repo is restricted"}.get(
            code, code
        )
        self._send(
            h,
            status,
            json.dumps({"error": msg}).encode(),
            {"X-Error-Code": code, "X-Error-Message": msg},
            head,
        )

    def _access(self, h, repo: dict | None, head: bool) -> bool:
        auth = h.headers.get("Authorization", "")
        self.auth_seen.append(auth)
        if repo is None:
            self._error(h, 401 if not auth else 404, "RepoNotFound", head)
            return False
        if repo["access"] == "private" and auth != f"Bearer {TOKEN}":
            self._error(h, 401, "RepoNotFound", head)
            return False
        if repo["access"] == "gated" and auth != f"Bearer {TOKEN}":
            self._error(h, 403, "GatedRepo", head)
            return False
        return True

    def handle(self, h, head: bool) -> None:
        parts = urlsplit(h.path)
        path = unquote(parts.path)
        self.requests.append(("HEAD" if head else "GET", path))
        segs = path.strip("/").split("/")
        # /api/datasets/OWNER/NAME/revision/REV  and  /api/datasets/OWNER/NAME/tree/REV[/PATH]
        if segs[0] == "api" and segs[1] in ("datasets", "models"):
            repo_id = "/".join(segs[2:4])
            repo = self.repos.get(repo_id)
            if not self._access(h, repo, head):
                return
            if len(segs) == 4 or segs[4] == "revision":
                if len(segs) > 5 and segs[5] not in ("main", SHA):
                    self._error(h, 404, "RevisionNotFound", head)
                    return
                siblings = [{"rfilename": p} for p in repo["files"]]
                self._json(h, {"id": repo_id, "sha": SHA, "siblings": siblings, "private": False}, head=head)
                return
            if segs[4] == "tree":
                entries = [
                    {
                        "type": "file",
                        "path": p,
                        "size": len(b),
                        "oid": hashlib.sha1(b).hexdigest(),
                        "lfs": {"oid": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134},
                    }
                    for p, b in sorted(repo["files"].items())
                ]
                entries += [
                    {"type": "directory", "path": d, "oid": "0" * 40, "size": 0} for d in repo.get("dirs", [])
                ]
                cursor = int(parse_qs(parts.query).get("cursor", ["0"])[0])
                page = entries[cursor : cursor + 2]  # tiny pages: exercise the Link-header pagination
                headers = {}
                if cursor + 2 < len(entries):
                    q = parts.query.split("&cursor=")[0]
                    headers["Link"] = f'<{self.url}{parts.path}?{q}&cursor={cursor + 2}>; rel="next"'
                self._json(h, page, headers, head)
                return
        # /datasets/OWNER/NAME/resolve/REV/PATH  or  /OWNER/NAME/resolve/REV/PATH (models)
        if "resolve" in segs:
            i = segs.index("resolve")
            repo_id = "/".join(segs[i - 2 : i])
            repo = self.repos.get(repo_id)
            kind = "dataset" if segs[0] == "datasets" else "model"
            if repo is not None and repo["type"] != kind:
                repo = None
            if not self._access(h, repo, head):
                return
            file_path = "/".join(segs[i + 2 :])
            if file_path not in repo["files"]:
                self._send(h, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": SHA}, head)
                return
            body = repo["files"][file_path]
            etag = hashlib.sha256(body).hexdigest()
            headers = {"X-Repo-Commit": SHA, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            status = 200
            rng = h.headers.get("Range")
            if rng and not head:
                start = int(rng.split("=")[1].split("-")[0])
                headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
                body, status = body[start:], 206
            if head:
                headers["X-Linked-Size"] = str(len(body))
            self._send(h, status, body, headers, head)
            return
        self._send(h, 404, b"", {}, head)


def _parquet_bytes(docs: list[str], tmp: Path, name: str) -> bytes:
    p = tmp / name
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), p, row_group_size=50)
    return p.read_bytes()


def _docs(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "quiet", "over"]
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 80)))) + "." for _ in range(n)]


def _env(hub_url: str, tmp: Path, token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=hub_url,
        HF_HUB_CACHE=str(tmp / "hfcache"),
        HF_HOME=str(tmp / "hfhome"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        HF_HUB_DOWNLOAD_TIMEOUT="5",
    )
    if token:
        env["HF_TOKEN"] = token
    return env


PREPARE = [sys.executable, "-m", "app.cli", "prepare"]  # the real CLI, what the `pretrain` script runs


def _run(args: list[str], hub: FakeHub, tmp: Path, token: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PREPARE, *args],
        cwd=ROOT,
        env=_env(hub.url, tmp, token),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def repos(tmp_path: Path) -> dict:
    a, b, c = _docs(1, 120), _docs(2, 80), _docs(3, 50)
    files = {
        "README.md": b"# a dataset card, not data\n",
        "sample/10BT/000.parquet": _parquet_bytes(a, tmp_path, "a.parquet"),
        "sample/10BT/001.parquet": _parquet_bytes(b, tmp_path, "b.parquet"),
        "sample/100BT/000.parquet": _parquet_bytes(c, tmp_path, "c.parquet"),
    }
    tok = train_bpe(a + b + c, 300)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(tok_dir)
    return {
        "docs": {"a": a, "b": b, "c": c},
        "hub": {
            "acme/corpus": {"type": "dataset", "files": files, "access": "public", "dirs": ["sample"]},
            "acme/private": {"type": "dataset", "files": files, "access": "private"},
            "acme/gated": {"type": "dataset", "files": files, "access": "gated"},
            "acme/tok": {
                "type": "model",
                "files": {"tokenizer.json": tok.to_json().encode()},
                "access": "public",
            },
        },
    }


def _expected(docs: list[str], tok, period: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"train": [], "val": []}
    for i, d in enumerate(docs):
        out["val" if i % period == period - 1 else "train"] += [*tok.encode(d), tok.eot_id]
    return out


def _stream(out: Path, split: str) -> np.ndarray:
    m = Manifest.load(out)
    return np.concatenate([np.asarray(open_shard(out / s.file)) for s in m.split(split)])


def test_hub_dataset_include_pattern_downloads_and_caches(tmp_path: Path, repos: dict) -> None:
    with FakeHub(repos["hub"]) as hub:
        out = tmp_path / "out"
        args = [
            "--input",
            "hf://datasets/acme/corpus?include=sample/10BT/*.parquet",
            "--out",
            str(out),
            "--tokenizer",
            "hf://acme/tok",
            "--shard-tokens",
            "2000",
            "--val-fraction",
            "0.1",
            "--workers",
            "1",
        ]
        r = _run(args, hub, tmp_path)
        assert r.returncode == 0, r.stderr
        m = Manifest.load(out)
        assert m.sources == [
            "hf://datasets/acme/corpus/sample/10BT/000.parquet",
            "hf://datasets/acme/corpus/sample/10BT/001.parquet",
        ]
        tok = load_tokenizer(out)
        exp = _expected(repos["docs"]["a"] + repos["docs"]["b"], tok, 10)
        for split in ("train", "val"):
            assert _stream(out, split).tolist() == exp[split]
        assert m.documents == 200
        downloads = [
            p for meth, p in hub.requests if meth == "GET" and "/resolve/" in p and p.endswith(".parquet")
        ]
        assert sorted(downloads) == [
            f"/datasets/acme/corpus/resolve/{SHA}/sample/10BT/00{i}.parquet" for i in (0, 1)
        ]
        assert not any("100BT" in p for _, p in hub.requests)

        # A second run into a new dir reads the files from the download cache.
        hub.requests.clear()
        r = _run([*args[:3], str(tmp_path / "out2"), *args[4:]], hub, tmp_path)
        assert r.returncode == 0, r.stderr
        assert not [p for meth, p in hub.requests if "/resolve/" in p and p.endswith(".parquet")]
        assert (tmp_path / "out2" / "train_000000.bin").read_bytes() == (
            out / "train_000000.bin"
        ).read_bytes()


def test_hub_path_glob_form_and_private_repo_with_token(tmp_path: Path, repos: dict) -> None:
    with FakeHub(repos["hub"]) as hub:
        out = tmp_path / "out"
        args = [
            "--input",
            "hf://datasets/acme/private/sample/100BT/*.parquet",
            "--out",
            str(out),
            "--tokenizer",
            "hf://acme/tok",
            "--val-fraction",
            "0.1",
            "--workers",
            "1",
        ]
        r = _run(args, hub, tmp_path)
        assert r.returncode == 2
        assert "HF_TOKEN" in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        r = _run(args, hub, tmp_path, token=TOKEN)
        assert r.returncode == 0, r.stderr
        assert Manifest.load(out).documents == 50
        assert f"Bearer {TOKEN}" in hub.auth_seen
        assert TOKEN not in r.stdout + r.stderr


HUB_ERRORS = [
    ("hf://datasets/acme/nope", "does not exist or refuses access"),
    ("hf://datasets/acme/gated", "gated"),
    (
        "hf://datasets/acme/corpus?include=other/*.parquet",
        "no parquet/jsonl/txt files matching other/*.parquet",
    ),
    ("hf://datasets/acme/corpus@v9", "no revision 'v9'"),
    ("hf://datasets/justone", "OWNER/NAME"),
    ("hf://datasets/acme/corpus?inclde=x", "unknown parameter 'inclde'"),
]


def test_hub_errors_exit_2_with_one_line(tmp_path: Path, repos: dict) -> None:
    with FakeHub(repos["hub"]) as hub:
        env = _env(hub.url, tmp_path)
        started = [
            Proc(
                [*PREPARE, "--input", url, "--out", str(tmp_path / f"out{i}"), "--tokenizer", "char"],
                tmp_path / "logs" / f"{i}.log",
                env=env,
                cwd=ROOT,
                separate_stderr=True,
            )
            for i, (url, _) in enumerate(HUB_ERRORS)
        ]
        results = [(p.wait(180), p.errors) for p in started]
    for (url, needle), (rc, err) in zip(HUB_ERRORS, results, strict=True):
        assert rc == 2, (url, err)
        assert needle in err, (url, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        if "refuses" in needle or "gated" in needle:
            assert "HF_TOKEN" in err
        assert not (tmp_path / f"out{HUB_ERRORS.index((url, needle))}" / "manifest.json").exists()


def test_hub_unreachable_is_one_line(tmp_path: Path) -> None:
    r = subprocess.run(
        [*PREPARE, "--input", "hf://datasets/acme/corpus", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=_env("http://127.0.0.1:9", tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "cannot reach the Hub at http://127.0.0.1:9" in r.stderr and "Traceback" not in r.stderr


def test_rerun_after_sigkill_mid_download_reuses_finished_downloads(tmp_path: Path) -> None:
    """SIGKILL while a hub file downloads: the re-run takes finished files from the download cache and
    fetches only the interrupted one again (huggingface_hub 2.x restarts an interrupted file).

    prepare downloads a.parquet and b.parquet at the same time (one file ahead), so the kill waits for
    a.parquet to be in the cache (its snapshot link, made after the blob is renamed into place) as well
    as for 10 MB of b.parquet, which stalls there: killing on b's progress alone raced with a's commit
    on a loaded machine (a fetched twice)."""
    rng = np.random.default_rng(5)
    letters = np.array(list("abcdefghij klmnopqrstuvwxyz"))
    big = ["".join(rng.choice(letters, size=2000)) for _ in range(6000)]
    pq.write_table(pa.table({"text": big}), tmp_path / "b.parquet", compression="none")
    files = {
        "data/a.parquet": _parquet_bytes(_docs(1, 100), tmp_path, "a.parquet"),
        "data/b.parquet": (tmp_path / "b.parquet").read_bytes(),
    }
    assert len(files["data/b.parquet"]) > 11 << 20
    repos = {"acme/big": {"type": "dataset", "files": files, "access": "public"}}
    args = [
        "--input",
        "hf://datasets/acme/big",
        "--out",
        str(tmp_path / "out"),
        "--tokenizer",
        "char",
        "--val-fraction",
        "0.1",
    ]
    with FakeHub(repos) as hub:
        hub.slow = True
        proc = Proc(
            [*PREPARE, *args], tmp_path / "logs" / "killed.log", env=_env(hub.url, tmp_path), cwd=ROOT
        )
        cache = tmp_path / "hfcache"

        def sizes(pattern: str) -> list[int]:
            return [p.stat().st_size for p in cache.rglob(pattern) if p.exists()]

        try:
            proc.wait_until(
                lambda: (
                    sizes("snapshots/*/data/a.parquet") and max(sizes("*.incomplete"), default=0) >= 10 << 20
                ),
                "a.parquet downloaded and 10 MiB of b.parquet",
            )
            proc.kill()
            proc.wait(timeout=30)
        finally:
            proc.stop()
            hub.release.set()
        assert not (tmp_path / "out" / "manifest.json").exists()
        assert not list(cache.rglob("snapshots/*/data/b.parquet"))  # b was cut off, a was finished
        hub.slow = False
        r = _run(args, hub, tmp_path)
        assert r.returncode == 0, r.stderr
    gets = [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]
    assert sum(p.endswith("a.parquet") for p in gets) == 1  # cached by the first run
    assert sum(p.endswith("b.parquet") for p in gets) == 2
    assert Manifest.load(tmp_path / "out").documents == 6100
