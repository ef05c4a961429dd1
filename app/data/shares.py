"""A sharded prepare: `pretrain prepare --shard-count N --shard-index I` in N processes at once (the chart's
Indexed Job, or two shells on a laptop), then `pretrain prepare --shard-count N --finalize` joins them.

The result is a one-process prepare's: the same token stream and validation split, byte for byte and in the
same order; only where shards are cut differs (each share ends its splits with a short shard). The split
takes every round(1/F)-th document of the whole input, so a share must know the global index of its first
document before it tokenizes. A share therefore:

1. takes its part of the input: the input's bytes cut into N equal ranges; it owns the whole files (jsonl,
   txt) and the parquet row groups that start in its range (parquet files are split between shares);
2. counts its documents (reading without tokenizing: a small part of the work) and publishes the count;
3. gets the tokenizer: a given one is loaded by every share; one to train (bpe, char) is trained by share 0
   on the first documents of the whole input, as one process would, and published for the others;
4. waits for the counts of the shares before it (their sum is the index of its first document), then runs
   the one-process pipeline (app/data/prepare.py) on its part into DATA_DIR/shares/N/I, resumable as that is.

A share that has waited PEER_PATIENCE seconds for another's count or tokenizer (that share's pod was not
scheduled, say) makes it itself: a count is the same whoever counts, and the first tokenizer published is
the one every share uses. The finalizer checks that every share is complete, made for these inputs and
settings, and that the shares are contiguous; then it writes DATA_DIR/manifest.json, which lists the
shares' shards in order, and DATA_DIR/tokenizer.json.

Layout: DATA_DIR/shares/N/ holds settings.json, tokenizer.json, counts/I.json and one data dir per share.
Detail: docs/data.md, "Sharded prepare".
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from app.config import PrepareConfig
from app.data import hub
from app.data.manifest import MANIFEST, SPLITS, STATE, Manifest, PrepareState, val_period
from app.data.prepare import (
    EMPTY_VAL,
    PrepareResult,
    ShareRun,
    _dir_lock,
    _run,
    _tokenizer,
    check_document_count,
    prepare,
)
from app.data.progress import Log, summary
from app.data.settings import check_config, check_dtype
from app.data.shards import remove_stale, verify_shard
from app.data.sources import DocumentStream, Fetcher, ReadOptions, SourceFile
from app.data.tokenizer import TOKENIZER_FILE, Tokenizer, load_tokenizer
from app.errors import UserError
from app.files import atomic_write_json, check_writable_dir, fsync_file

SHARES = "shares"
SETTINGS = "settings.json"
PEER_PATIENCE = 600.0  # seconds a share waits for another's count or tokenizer before making it itself
POLL_SECONDS = 1.0
LOG_SECONDS = 60.0


def shares_root(out: Path, count: int) -> Path:
    return Path(out) / SHARES / str(count)


def share_dir(out: Path, index: int, count: int) -> Path:
    return shares_root(out, count) / str(index)


def plan_digest(files: list[SourceFile], cfg: PrepareConfig) -> str:
    """What the shares' documents depend on: every input file, the settings and the share count."""
    inputs = [[f.name, f.fingerprint] for f in files]
    text = json.dumps([cfg.shard_count, inputs, cfg.settings()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_options(cfg: PrepareConfig) -> ReadOptions:
    return ReadOptions(cfg.text_column, cfg.txt_split, cfg.doc_chars)


def _fetcher(files: list[SourceFile], cfg: PrepareConfig) -> Fetcher:
    return Fetcher(files, lambda f: hub.download(f, cfg.cache_dir))


# ---- which input is a share's ------------------------------------------------------------------------


def _row_groups(path: Path, f: SourceFile) -> list[int]:
    """Bytes of each row group of a parquet file (uncompressed, from its footer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{f.label} is not a readable parquet file: {e}") from None
    return [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]


def share_parts(files: list[SourceFile], fetcher: Fetcher, index: int, count: int) -> list[SourceFile]:
    """The input of share `index` of `count`: the whole files, and the parquet row groups, that start in its
    range of the input's bytes. A row group starts at its file's offset plus its share of the file's bytes
    (by the footer's sizes), so every share computes the same cut from the same listing."""
    offsets = list(itertools.accumulate((f.size for f in files), initial=0))
    total = offsets[-1]
    lo = total * index // count
    hi = total * (index + 1) // count if index < count - 1 else total + 1  # the last share owns the end
    parts = []
    for i, f in enumerate(files):
        start, end = offsets[i], offsets[i + 1]
        if f.format != "parquet" or end - start <= 0:
            if lo <= start < hi:
                parts.append(f)
            continue
        if end <= lo or start >= hi:
            continue
        sizes = _row_groups(fetcher.path(i), f)
        weight = sum(sizes) or 1
        cumulative = list(itertools.accumulate(sizes, initial=0))
        mine = [g for g in range(len(sizes)) if lo <= start + f.size * cumulative[g] // weight < hi]
        if not mine:
            continue
        first, stop = mine[0], mine[-1] + 1
        if (first, stop) == (0, len(sizes)):
            parts.append(f)
            continue
        size = f.size * cumulative[stop] // weight - f.size * cumulative[first] // weight
        fingerprint = f"{f.fingerprint}:row-groups-{first}-{stop}"
        parts.append(dataclasses.replace(f, size=size, fingerprint=fingerprint, row_groups=(first, stop)))
    return parts


# ---- what shares publish for each other ------------------------------------------------------------


def _publish(path: Path, text: str) -> bool:
    """Write `path` unless it exists; True when this call wrote it. The first writer wins, also between
    machines on NFS: a hard link to a complete temp file fails when the name is taken. (Where a volume has
    no hard links, the last writer wins; the finalizer's checks then name a share to run again.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(text, encoding="utf-8")
    fsync_file(tmp)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        if path.exists():
            return False
        os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _count_path(root: Path, index: int) -> Path:
    return root / "counts" / f"{index}.json"


def read_count(root: Path, index: int, plan: str) -> int | None:
    """The published document count of share `index`, when it was made for this plan."""
    try:
        data = json.loads(_count_path(root, index).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("plan") != plan or not isinstance(data.get("documents"), int):
        return None
    return data["documents"]


def count_documents(parts: list[SourceFile], cfg: PrepareConfig) -> int:
    stream = DocumentStream(parts, _fetcher(parts, cfg), _read_options(cfg))
    return sum(len(texts) for _, texts, _ in stream.batches())


def _await(ready: Callable[[], bool], what: str, log: Log, deadline: float) -> bool:
    """Poll until ready() (True) or the monotonic `deadline` (False), saying what it waits for now and then."""
    last = -float("inf")
    start = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now >= deadline:
            return False
        if now - last >= LOG_SECONDS:
            log(f"waiting for {what} ({now - start:.0f} s)")
            last = now
        time.sleep(POLL_SECONDS)
    return True


class Share:
    """One share's view of the sharded prepare: the listing, the plan, and what the shares publish."""

    def __init__(self, cfg: PrepareConfig, log: Log) -> None:
        self.cfg, self.log = cfg, log
        self.out = Path(cfg.out_dir)
        self.root = shares_root(self.out, cfg.shard_count)
        self.files = hub.resolve_inputs(cfg.inputs, cfg.revision, cfg.includes)
        self.plan = plan_digest(self.files, cfg)
        self.fetcher = _fetcher(self.files, cfg)
        self.deadline = time.monotonic() + PEER_PATIENCE

    def parts(self, index: int) -> list[SourceFile]:
        return share_parts(self.files, self.fetcher, index, self.cfg.shard_count)

    def claim_settings(self) -> None:
        """The first share records the settings; a share with others is refused (as one process is)."""
        settings = self.cfg.settings()
        path = self.root / SETTINGS
        _publish(path, json.dumps(settings, sort_keys=True, indent=1))
        found = json.loads(path.read_text())
        if found != settings:
            diff = sorted(k for k in found.keys() | settings if found.get(k) != settings.get(k))
            raise UserError(
                f"{self.root} holds shares prepared with other settings ({', '.join(diff)} differ); "
                f"use another --out or delete {self.root}"
            )

    def count(self, index: int, parts: list[SourceFile] | None = None) -> int:
        """Share `index`'s documents: published, else waited for (not for its own), else counted here."""
        n = read_count(self.root, index, self.plan)
        own = index == self.cfg.shard_index
        what = f"share {index}'s document count ({_count_path(self.root, index)})"
        if (
            n is None
            and not own
            and _await(
                lambda: read_count(self.root, index, self.plan) is not None, what, self.log, self.deadline
            )
        ):
            n = read_count(self.root, index, self.plan)
        if n is None:
            if not own:
                self.log(f"no {what} after {PEER_PATIENCE:.0f} s: counting it here")
            n = count_documents(self.parts(index) if parts is None else parts, self.cfg)
            atomic_write_json(
                _count_path(self.root, index), {"plan": self.plan, "share": index, "documents": n}
            )
        return n

    def tokenizer(self) -> Tokenizer:
        """The shares' tokenizer, DATA_DIR/shares/N/tokenizer.json: a given one as given; one to train,
        trained by share 0 (or, after PEER_PATIENCE, by whoever waited) on the whole input's first documents."""
        cfg = self.cfg
        published = self.root / TOKENIZER_FILE
        everything = DocumentStream(self.files, self.fetcher, _read_options(cfg))
        trained = cfg.tokenizer in ("bpe", "char")
        given = None if trained else _tokenizer(cfg, self.root, None, everything, self.log)
        if given is not None:
            _publish(published, given.to_json())
        elif not published.exists():
            what = f"share 0's tokenizer ({published})"
            if cfg.shard_index == 0 or not _await(published.exists, what, self.log, self.deadline):
                _publish(published, _tokenizer(cfg, self.root, None, everything, self.log).to_json())
        tok = load_tokenizer(published)
        if given is not None and tok.sha256() != given.sha256():
            raise UserError(
                f"the shares of {self.root} were made with another tokenizer than {cfg.tokenizer}; "
                f"use another --out or delete {self.root}"
            )
        return tok


def run(cfg: PrepareConfig, log: Log = print) -> PrepareResult:
    """`pretrain prepare`, sharded or not: one process, share cfg.shard_index, or the finalizer."""
    if cfg.shard_count == 1:
        return prepare(cfg, log)
    return Shares(cfg).join(log) if cfg.finalize else prepare_share(cfg, log)


def prepare_share(cfg: PrepareConfig, log: Log = print) -> PrepareResult:
    """`pretrain prepare --shard-count N --shard-index I`: tokenize share I into DATA_DIR/shares/N/I."""
    t0 = time.time()
    check_config(cfg)
    index, count = cfg.shard_index, cfg.shard_count
    check_writable_dir(Path(cfg.out_dir), "--out")
    here = share_dir(Path(cfg.out_dir), index, count)
    with _dir_lock(here):
        share = Share(cfg, log)
        share.claim_settings()
        parts = share.parts(index)
        size = sum(p.size for p in parts)
        # jsonl and txt files are not split: an empty share is one that no file or row group starts in
        empty = (
            ""
            if parts
            else " (no input file or row group starts in its range: pre-split large jsonl/txt files)"
        )
        log(
            f"share {index} of {count}: {len(parts)} part(s) of {len(share.files)} input file(s), "
            f"{size / 1e6:.1f} MB{empty}"
        )
        # A given tokenizer (PATH, hf://) is loaded before the counting pass, which reads the whole share: a
        # typo costs seconds, not that pass. One to train waits: share 0 trains it while the others count.
        tok = None if cfg.tokenizer in ("bpe", "char") else share.tokenizer()
        own = share.count(index, parts)
        if tok is None:
            tok = share.tokenizer()
        first = sum(share.count(j) for j in range(index))
        log(f"share {index} of {count}: documents {first:,} to {first + own:,} of the whole input")
        stream = DocumentStream(parts, _fetcher(parts, cfg), _read_options(cfg))
        return _run(cfg, here, stream, log, t0, tok, ShareRun(first, share.plan))


# ---- joining them ------------------------------------------------------------------------------------


class Shares:
    """The finalizer's view: which shares are done, and joining them into DATA_DIR."""

    def __init__(self, cfg: PrepareConfig) -> None:
        check_config(cfg)
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.count = cfg.shard_count
        self.root = shares_root(self.out, self.count)
        self.files = hub.resolve_inputs(cfg.inputs, cfg.revision, cfg.includes)
        self.plan = plan_digest(self.files, cfg)

    def states(self) -> list[PrepareState | None]:
        return [PrepareState.load(share_dir(self.out, i, self.count)) for i in range(self.count)]

    def pending(self) -> dict[int, str]:
        """Shares not finished for these inputs and settings, with why."""
        out = {}
        for i, st in enumerate(self.states()):
            if st is None:
                out[i] = "not started"
            elif st.plan != self.plan:
                out[i] = "made for other inputs or settings"
            elif not st.complete or not (share_dir(self.out, i, self.count) / MANIFEST).exists():
                out[i] = "not finished"
        return out

    def join(self, log: Log = print) -> PrepareResult:
        """Check the finished shares and write DATA_DIR's manifest (their shards, in order) and tokenizer."""
        t0 = time.time()
        cfg = self.cfg
        if pending := self.pending():
            raise UserError(
                f"cannot finalize {self.out}: "
                + "; ".join(f"share {i} of {self.count} {why}" for i, why in pending.items())
                + f" (run `pretrain prepare ... --shard-count {self.count} --shard-index I` for each; "
                "an Indexed Job's pods do)"
            )
        with _dir_lock(self.out):
            tok = load_tokenizer(self.root / TOKENIZER_FILE)
            dtype = check_dtype(tok.vocab_size, cfg.dtype)
            shards: dict[str, list] = {s: [] for s in SPLITS}
            documents = 0
            for i, st in enumerate(self.states()):
                assert st is not None  # pending() is empty
                here = share_dir(self.out, i, self.count)
                again = f"delete {here} and run share {i} again"
                if st.tokenizer_sha256 != tok.sha256():
                    raise UserError(
                        f"share {i} of {self.count} was made with another tokenizer than {self.root / TOKENIZER_FILE}; {again}"
                    )
                if st.first_doc != documents:
                    raise UserError(
                        f"share {i} of {self.count} starts at document {st.first_doc:,}, but the shares before it "
                        f"end at {documents:,}; {again}"
                    )
                documents = st.files[-1].end if st.files else st.first_doc
                for split in SPLITS:
                    for info in getattr(st, split):
                        if why := verify_shard(here / info.file, dtype, info.tokens):
                            raise UserError(f"share {i} of {self.count}: {why}; {again}")
                        name = (here / info.file).relative_to(self.out).as_posix()
                        shards[split].append(dataclasses.replace(info, file=name))
            check_document_count(min(documents, val_period(cfg.val_fraction)), cfg, len(self.files))
            if not shards["val"]:
                raise UserError(EMPTY_VAL)
            # The dir stops looking complete until the new manifest is written; top-level shards of an
            # earlier one-process run are not part of it.
            (self.out / MANIFEST).unlink(missing_ok=True)
            (self.out / STATE).unlink(missing_ok=True)
            remove_stale(self.out, set())
            tok.save(self.out)
            manifest = Manifest(
                tokenizer=tok.describe(),
                dtype=dtype.name,
                shard_tokens=cfg.shard_tokens,
                train=shards["train"],
                val=shards["val"],
                sources=[f.label for f in self.files],
                documents=documents,
                val_fraction=cfg.val_fraction,
                settings=cfg.settings(),
            )
            manifest.save(self.out)
        log(f"joined {self.count} shares of {self.root} into {self.out}")
        summary(manifest, self.out, time.time() - t0, 0, log)
        return PrepareResult(manifest, 0, False)
