"""Raw text -> tokenizer -> token shards + validation split + manifest.json (`pretrain prepare`).

Why it is built this way: tokenizing a large corpus takes hours on a preemptible CPU node, so the output
must be deterministic (documents numbered in input order, results consumed in order whatever the worker
count), resumable (finished shards recorded in prepare_state.json with sha256 and stream positions) and
safe to stop anywhere (shards renamed from `.partial` files when complete, manifest.json written last).

Detail: docs/data.md, "Output", "Parallelism, determinism, memory" and "Resume and re-runs".
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.config import PrepareConfig
from app.data import hub
from app.data.manifest import (
    MANIFEST,
    SPLITS,
    FileRecord,
    Manifest,
    PrepareState,
    is_val_document,
    val_period,
)
from app.data.progress import Log, Progress, summary
from app.data.settings import check_config, check_dtype, default_workers
from app.data.shards import ShardInfo, SplitWriter, remove_stale, verify_shard
from app.data.sources import (
    DocumentStream,
    Fetcher,
    ReadOptions,
    SourceFile,
)
from app.data.tokenizer import (
    TOKENIZER_FILE,
    EncodedDocs,
    ParallelEncoder,
    Tokenizer,
    load_tokenizer,
    train_bpe,
    train_char,
)
from app.errors import UserError
from app.files import check_writable_dir

LOCK = ".prepare.lock"
EMPTY_VAL = "the validation split is empty; add data or raise --val-fraction"
_TASK_CHARS = 1 << 20  # text per worker task: big enough to amortize IPC, small enough for smooth progress


@dataclass(frozen=True)
class ShareRun:
    """One share of a sharded prepare (app/data/shares.py): its documents are numbered from `first_doc`."""

    first_doc: int
    plan: str  # digest of the inputs, settings and share count (a finalizer takes only matching shares)


@dataclass
class PrepareResult:
    manifest: Manifest
    new_tokens: int  # tokens written by this run (0 when the dir was already up to date)
    up_to_date: bool


@contextlib.contextmanager
def _dir_lock(out: Path) -> Iterator[None]:
    """One writer per data dir; also proves the dir is writable before any work starts."""
    created = not out.exists()
    check_writable_dir(out, "--out")
    with open(out / LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(
                f"another `pretrain prepare` is writing {out}; wait for it or use another --out"
            ) from None
        try:
            yield
        finally:
            # A run that failed before writing anything leaves no trace: not even the dir it created.
            if created and [p.name for p in out.iterdir()] == [LOCK]:
                (out / LOCK).unlink(missing_ok=True)
                out.rmdir()


# ---- resume ----------------------------------------------------------------------------------------


@dataclass
class Plan:
    kept: dict[str, list[ShardInfo]]
    files: list[FileRecord]  # completed-file records still valid
    start_file: int
    first_doc: int
    resume: dict[str, tuple[int, int]]  # per split: position of the next token to write
    up_to_date: bool


def plan_resume(
    state: PrepareState,
    files: list[SourceFile],
    cfg: PrepareConfig,
    out: Path,
    dtype: np.dtype,
    log,
    first_doc: int = 0,
) -> Plan:
    current = [[f.name, f.fingerprint] for f in files]
    same_inputs = state.inputs == current
    n_same = 0  # input files unchanged since the shards were written, from the first
    while n_same < min(len(current), len(state.inputs)) and current[n_same] == state.inputs[n_same]:
        n_same += 1
    records = state.files[:n_same]
    limit = None  # shards holding documents from this index on are stale
    if n_same < len(state.inputs):
        changed = files[n_same].name if n_same < len(files) else state.inputs[n_same][0]
        limit = records[-1].end if records else 0  # keep only what unchanged, completed files hold
        log(f"input file {changed} changed or is gone; re-making the shards from its documents on")
    kept: dict[str, list[ShardInfo]] = {s: [] for s in SPLITS}
    for s in SPLITS:
        for info in getattr(state, s):
            g, offset = info.end  # the shard's last token is in document g, or g - 1 at a boundary
            if limit is not None and (g if offset > 0 else g - 1) >= limit:
                break
            if info.tokens < cfg.shard_tokens and not (state.complete and same_inputs):
                break  # a tail shard: more input or a resumed run will extend it
            why = verify_shard(
                out / info.file, dtype, info.tokens, info.sha256 if cfg.verify == "sha256" else ""
            )
            if why:
                log(f"re-making {info.file}: {why}")
                break
            kept[s].append(info)
    up_to_date = (
        state.complete and same_inputs and all(len(kept[s]) == len(getattr(state, s)) for s in SPLITS)
    )
    resume = {s: tuple(kept[s][-1].end) if kept[s] else (first_doc, 0) for s in SPLITS}
    start_doc = min(g for g, _ in resume.values())
    start_file = 0
    for i, r in enumerate(records):
        if r.end > start_doc:
            break
        start_file, first_doc = i + 1, r.end
    return Plan(kept, records[:start_file], start_file, first_doc, resume, up_to_date)  # type: ignore[arg-type]


# ---- tokenizer ---------------------------------------------------------------------------------------


def _sample(inp: DocumentStream, cfg: PrepareConfig, log: Log) -> Iterator[str]:
    """The first `sample_bytes` of training documents (validation documents stay unseen)."""
    taken = 0
    for g, text in inp.documents():
        if is_val_document(g, cfg.val_fraction):
            continue
        yield text
        taken += len(text.encode("utf-8", "surrogatepass"))
        if taken >= cfg.sample_bytes:
            break
    log(f"trained the tokenizer on {taken / 1e6:.1f} MB of text")


def _tokenizer(
    cfg: PrepareConfig, out: Path, state: PrepareState | None, inp: DocumentStream, log: Log
) -> Tokenizer:
    """The given tokenizer; else the saved one when resuming, or a newly trained one (the caller saves it)."""
    if cfg.tokenizer not in ("bpe", "char"):  # a tokenizer.json to load
        spec = cfg.tokenizer
        path = Path(spec)
        label = str(path)
        if spec.startswith("hf://"):
            label, path = hub.download_tokenizer(spec, cfg.cache_dir)
        elif not path.exists():
            raise UserError(
                f"--tokenizer {spec}: no such file or directory (or use bpe, char, hf://OWNER/NAME)"
            )
        elif path.is_dir() and not (path / TOKENIZER_FILE).exists():
            raise UserError(f"--tokenizer {spec}: the directory has no {TOKENIZER_FILE}")
        tok = load_tokenizer(path)
        if state is not None and tok.sha256() != state.tokenizer_sha256:
            raise UserError(
                f"{out} was prepared with a different tokenizer than {label}; use another --out or delete {out}"
            )
        log(f"tokenizer {label}: {tok.kind}, vocab {tok.vocab_size}")
        return tok
    if state is not None:
        with contextlib.suppress(UserError):  # gone or damaged: train again
            tok = load_tokenizer(out / TOKENIZER_FILE)
            if tok.sha256() == state.tokenizer_sha256:
                return tok
    if cfg.tokenizer == "bpe":
        mb = cfg.sample_bytes / 1e6
        log(f"training a byte-level BPE tokenizer (vocab {cfg.vocab_size}) on up to {mb:.0f} MB ...")
        return train_bpe(_sample(inp, cfg, log), cfg.vocab_size)
    return train_char(_sample(inp, cfg, log), cfg.char_alphabet)  # with a fixed alphabet it reads no sample


def _tasks(inp: DocumentStream, plan: Plan, period: int, on_file_done) -> Iterator[tuple[tuple, list[str]]]:
    """Worker tasks of about _TASK_CHARS of text: (meta, texts), with only the documents that are not
    already in kept shards. meta = (document indices, input bytes consumed)."""
    rv, rt = plan.resume["val"][0], plan.resume["train"][0]
    buf: list[str] = []
    idx: list[int] = []
    chars = done = 0
    try:
        for g, texts, done in inp.batches(plan.start_file, plan.first_doc, on_file_done):
            for gi, text in enumerate(texts, g):
                if gi < (rv if gi % period == period - 1 else rt):
                    continue  # already in a kept shard
                buf.append(text)
                idx.append(gi)
                chars += len(text)
                if chars >= _TASK_CHARS:
                    yield (np.array(idx, dtype=np.int64), done), buf
                    buf, idx, chars = [], [], 0
    except Exception:
        if buf:  # a bad file: still tokenize and write what was read before it
            yield (np.array(idx, dtype=np.int64), done), buf
        raise
    if buf:
        yield (np.array(idx, dtype=np.int64), inp.total_bytes), buf


# ---- the pipeline ------------------------------------------------------------------------------------


def prepare(cfg: PrepareConfig, log: Log = print) -> PrepareResult:
    """Run `pretrain prepare` in one process: resolve inputs, get a tokenizer, write (or finish) the shards
    and manifest. (A sharded prepare, --shard-count N, runs through app.data.shares.run.)"""
    t0 = time.time()
    check_config(cfg)
    out = Path(cfg.out_dir)
    with _dir_lock(out):
        files = hub.resolve_inputs(cfg.inputs, cfg.revision, cfg.includes)
        fetcher = Fetcher(files, lambda f: hub.download(f, cfg.cache_dir))
        opts = ReadOptions(cfg.text_column, cfg.txt_split, cfg.doc_chars)
        return _run(cfg, out, DocumentStream(files, fetcher, opts), log, t0)


def _run(
    cfg: PrepareConfig,
    out: Path,
    inp: DocumentStream,
    log: Log,
    t0: float,
    tok: Tokenizer | None = None,
    share: ShareRun | None = None,
) -> PrepareResult:
    """Tokenize `inp` into `out`, resuming what is there. A share (app/data/shares.py) passes the shares'
    tokenizer and where its documents start; the checks on the whole input are then the finalizer's."""
    files, settings = inp.files, cfg.settings()
    base = share.first_doc if share else 0
    state = PrepareState.load(out)
    if state is not None and state.settings != settings:
        diff = sorted(k for k in state.settings.keys() | settings if state.settings.get(k) != settings.get(k))
        raise UserError(
            f"{out} holds data prepared with other settings ({', '.join(diff)} differ); "
            f"use another --out or delete {out}"
        )
    if state is not None and state.first_doc != base:
        log(
            f"{out}: its first document is now {base}, not {state.first_doc} (an earlier input changed); starting over"
        )
        state = None
    period = val_period(cfg.val_fraction)
    if share is None:
        check_document_count(sum(1 for _ in itertools.islice(inp.documents(), period)), cfg, len(files))
    tok = tok or _tokenizer(cfg, out, state, inp, log)
    dtype = check_dtype(tok.vocab_size, cfg.dtype)
    if state is not None and state.tokenizer_sha256 != tok.sha256():
        log(
            f"the saved tokenizer of {out} is gone or damaged and training gave a different one; starting over"
        )
        state = None
    # no state: nothing to keep
    work = plan_resume(state or PrepareState({}, ""), files, cfg, out, dtype, log, base)
    n_kept = sum(len(v) for v in work.kept.values())

    def finish(shards: dict, records: list[FileRecord], new_tokens: int) -> PrepareResult:
        manifest = Manifest(
            tokenizer=tok.describe(),
            dtype=dtype.name,
            shard_tokens=cfg.shard_tokens,
            train=list(shards["train"]),
            val=list(shards["val"]),
            sources=[f.label for f in files],
            documents=(records[-1].end if records else base) - base,  # a share's own
            val_fraction=cfg.val_fraction,
            settings=settings,
        )
        if not (out / MANIFEST).exists():
            manifest.save(out)
        summary(manifest, out, time.time() - t0, new_tokens, log)
        return PrepareResult(manifest, new_tokens, work.up_to_date)

    if work.up_to_date:
        log(f"{out} is up to date: {n_kept} shards verified ({cfg.verify})")
        if share and state and state.plan != share.plan:  # the same share of an input changed elsewhere
            state.plan = share.plan
            state.save(out)
        return finish(work.kept, state.files if state else [], 0)

    # From here on the dir is being changed: it stops looking complete until the manifest is rewritten.
    (out / MANIFEST).unlink(missing_ok=True)
    remove_stale(out, {i.file for s in SPLITS for i in work.kept[s]})
    tok.save(out)
    inputs = [[f.name, f.fingerprint] for f in files]
    new_state = PrepareState(
        settings,
        tok.sha256(),
        inputs,
        list(work.files),
        **work.kept,
        first_doc=base,
        plan=share.plan if share else "",
    )
    if n_kept:
        log(
            f"resuming: {n_kept} shards already written and verified; "
            f"reading from input file {work.start_file + 1}/{len(files)}"
        )

    def save_state() -> None:
        new_state.train, new_state.val = writers["train"].shards, writers["val"].shards
        new_state.save(out)

    def file_done(fi: int, first: int, n: int) -> None:
        if fi == len(new_state.files):
            new_state.files.append(FileRecord(files[fi].name, files[fi].fingerprint, first, n))

    writers = {s: SplitWriter(out, s, cfg.shard_tokens, dtype, work.kept[s], save_state) for s in SPLITS}
    save_state()
    progress = Progress(cfg.progress, inp.total_bytes, inp.offsets[work.start_file], log, cfg.log_every)
    try:
        with ParallelEncoder(tok, cfg.workers or default_workers(), dtype) as enc:
            for (g_idx, done), encoded in enc.map(_tasks(inp, work, period, file_done)):
                _route(encoded, g_idx, period, writers)
                progress.update(done, len(g_idx), int(encoded.tokens.size))
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        progress.close()
        save_state()
    if not writers["val"].shards and share is None:
        raise UserError(EMPTY_VAL)
    new_state.complete = True
    save_state()
    new_tokens = sum(w.new_tokens for w in writers.values())
    return finish({s: w.shards for s, w in writers.items()}, new_state.files, new_tokens)


def check_document_count(found: int, cfg: PrepareConfig, n_files: int) -> None:
    """`found`: documents in the input, counted up to one validation period."""
    if found == 0:
        raise UserError(
            f"no documents in {', '.join(cfg.inputs)}: {n_files} file(s), none with a non-empty "
            f"'{cfg.text_column}' value"
        )
    period = val_period(cfg.val_fraction)
    if found < period:
        raise UserError(
            f"only {found} documents: --val-fraction {cfg.val_fraction} puts every {period}th "
            "document in the validation split, which would be empty; add data or raise --val-fraction"
        )


def _route(enc: EncodedDocs, g_idx: np.ndarray, period: int, writers: dict[str, SplitWriter]) -> None:
    """Send each document's tokens to its split, keeping order within each split."""
    val = g_idx % period == period - 1
    for split, mask in (("train", ~val), ("val", val)):
        if mask.any():
            tok_mask = np.repeat(mask, enc.lengths)
            writers[split].add(enc.tokens[tok_mask], enc.lengths[mask], enc.nbytes[mask], g_idx[mask])
