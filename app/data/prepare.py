"""Raw text -> tokenizer -> token shards + validation split + manifest.json (`pretrain prepare`).

The manifest is the data dir's table of contents; the trainer reads only it and the shards.

How it stays deterministic, resumable and idempotent:
- Documents are numbered in input order (files in a fixed order, rows in file order). Document i goes
  to validation when `is_val_document(i)`, so the split never depends on timing or worker count.
- Each split's token stream (every document followed by the boundary token) is cut into shards of
  exactly `shard_tokens` tokens (the last one shorter); documents may straddle two shards.
- Workers tokenize batches in parallel but results are consumed in input order, so `--workers 1` and
  `--workers 8` write byte-identical shards.
- Every finished shard is recorded in `prepare_state.json` with its sha256 and the stream positions
  (document index, token offset) where it starts and ends. A re-run keeps the shards that still verify
  and whose input files are unchanged, re-reads the input from the earliest position still needed and
  tokenizes only the documents that are not already in kept shards. Shards are written to hidden
  `.partial` files and renamed when complete; `manifest.json` is written last and removed before any
  shard is replaced, so a dir with a manifest is always complete.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.data import hub
from app.data.inputs import SourceFile
from app.data.manifest import MANIFEST, SPLITS, Manifest, is_val_document, val_period
from app.data.progress import Progress, summary
from app.data.resume import STATE, FileRecord, Plan, PrepareState
from app.data.resume import plan as plan_resume
from app.data.settings import PrepareConfig, check_config, check_dtype, default_workers
from app.data.shards import ShardInfo, SplitWriter, remove_stale
from app.data.sources import DocumentStream, Fetcher, ReadOptions, read_documents, resolve_inputs
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

LOCK = ".prepare.lock"
_TASK_CHARS = 1 << 20  # text per worker task: big enough to amortize IPC, small enough for smooth progress
Log = Callable[[str], None]


@dataclass
class PrepareResult:
    manifest: Manifest
    out_dir: Path
    seconds: float
    new_tokens: int  # tokens written by this run (0 when the dir was already up to date)
    up_to_date: bool


# ---- output dir ------------------------------------------------------------------------------------


class _DirLock:
    """One writer per data dir; also proves the dir is writable before any work starts."""

    def __init__(self, out: Path) -> None:
        self.out, self.created = out, not out.exists()
        try:
            out.mkdir(parents=True, exist_ok=True)
            self._f = open(out / LOCK, "a+")  # noqa: SIM115 - closed in release
        except FileExistsError:
            raise UserError(f"output {out} exists and is not a directory") from None
        except OSError as e:
            raise UserError(f"cannot write to output dir {out}: {e.strerror}") from None
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._f.close()
            raise UserError(
                f"another `pretrain prepare` is writing {out}; wait for it or use another --out"
            ) from None

    def release(self) -> None:
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()
        # A run that failed before writing anything leaves no trace: not even the dir it created.
        if self.created and [p.name for p in self.out.iterdir()] == [LOCK]:
            (self.out / LOCK).unlink(missing_ok=True)
            self.out.rmdir()


# ---- tokenizer ---------------------------------------------------------------------------------------


def _sample(inp: DocumentStream, val_fraction: float, sample_bytes: int, log: Log) -> Iterator[str]:
    """The first `sample_bytes` of training documents (validation documents stay unseen)."""
    taken = 0
    for g, text in inp.documents():
        if is_val_document(g, val_fraction):
            continue
        yield text
        taken += len(text.encode("utf-8", "surrogatepass"))
        if taken >= sample_bytes:
            break
    log(f"trained the tokenizer on {taken / 1e6:.1f} MB of text")


def _load_tokenizer_spec(cfg: PrepareConfig) -> tuple[Tokenizer, str]:
    spec = cfg.tokenizer
    if spec.startswith("hf://"):
        label, path = hub.download_tokenizer(spec, cfg.cache_dir)
        return load_tokenizer(path), label
    path = Path(spec)
    if not path.exists():
        raise UserError(f"--tokenizer {spec}: no such file or directory (or use bpe, char, hf://OWNER/NAME)")
    if path.is_dir() and not (path / TOKENIZER_FILE).exists():
        raise UserError(f"--tokenizer {spec}: the directory has no {TOKENIZER_FILE}")
    return load_tokenizer(path), str(path)


def _tokenizer(
    cfg: PrepareConfig, out: Path, state: PrepareState | None, inp: DocumentStream, log: Log
) -> Tokenizer:
    """The saved tokenizer when resuming, else loaded or trained (and saved beside the shards)."""
    saved = out / TOKENIZER_FILE
    if state is not None and saved.exists():
        try:
            tok = load_tokenizer(saved)
        except UserError:
            tok = None
        if tok is not None and tok.sha256() == state.tokenizer_sha256:
            if cfg.trains_tokenizer:
                return tok
            loaded, label = _load_tokenizer_spec(cfg)
            if loaded.sha256() != tok.sha256():
                raise UserError(
                    f"{out} was prepared with a different tokenizer than {label}; use another --out or delete {out}"
                )
            return tok
    if cfg.tokenizer == "bpe":
        log(
            f"training a byte-level BPE tokenizer (vocab {cfg.vocab_size}) on up to {cfg.sample_bytes / 1e6:.0f} MB ..."
        )
        tok = train_bpe(_sample(inp, cfg.val_fraction, cfg.sample_bytes, log), cfg.vocab_size)
    elif cfg.tokenizer == "char":
        texts = [] if cfg.char_alphabet else _sample(inp, cfg.val_fraction, cfg.sample_bytes, log)
        tok = train_char(texts, cfg.char_alphabet)
    else:
        tok, label = _load_tokenizer_spec(cfg)
        log(f"tokenizer {label}: {tok.kind}, vocab {tok.vocab_size}")
    check_dtype(tok.vocab_size, cfg.dtype)
    return tok


# ---- writing ---------------------------------------------------------------------------------------


def _tasks(inp: DocumentStream, plan: Plan, period: int, on_file_done) -> Iterator[tuple[tuple, list[str]]]:
    """Worker tasks of about _TASK_CHARS of text: (meta, texts), with only the documents that are not
    already in kept shards. meta = (document indices, input bytes consumed)."""
    rv, rt = plan.resume["val"][0], plan.resume["train"][0]
    buf: list[str] = []
    idx: list[int] = []
    chars = done = 0
    batches = inp.batches(plan.start_file, plan.first_doc, on_file_done)
    while True:
        try:
            g, texts, done = next(batches)
        except StopIteration:
            break
        except Exception:
            if buf:  # a bad file: still tokenize and write what was read before it
                yield (np.array(idx, dtype=np.int64), done), buf
            raise
        for i, text in enumerate(texts):
            gi = g + i
            if gi < (rv if gi % period == period - 1 else rt):
                continue  # already in a kept shard
            buf.append(text)
            idx.append(gi)
            chars += len(text)
            if chars >= _TASK_CHARS:
                yield (np.array(idx, dtype=np.int64), done), buf
                buf, idx, chars = [], [], 0
    if buf:
        yield (np.array(idx, dtype=np.int64), inp.total_bytes), buf


# ---- the pipeline ------------------------------------------------------------------------------------


def prepare(
    cfg: PrepareConfig, log: Log = print, *, files: list[SourceFile] | None = None, reader=read_documents
) -> PrepareResult:
    """Run `pretrain prepare`: resolve inputs, get a tokenizer, write (or finish) the shards and manifest."""
    t0 = time.time()
    check_config(cfg)
    out = Path(cfg.out_dir)
    lock = _DirLock(out)
    fetcher = None
    try:
        if files is None:
            files = resolve_inputs(cfg.inputs, cfg.revision, cfg.includes)

        fetcher = Fetcher(files, lambda f: hub.download(f, cfg.cache_dir))
        opts = ReadOptions(cfg.text_column, cfg.txt_split, cfg.doc_chars)
        inp = DocumentStream(files, fetcher, opts, reader)
        return _run(cfg, out, inp, log, t0)
    finally:
        if fetcher is not None:
            fetcher.close()
        lock.release()


def _run(cfg: PrepareConfig, out: Path, inp: DocumentStream, log: Log, t0: float) -> PrepareResult:
    files = inp.files
    state = PrepareState.load(out)
    if state is not None and state.settings != cfg.settings():
        diff = sorted(
            k
            for k in set(state.settings) | set(cfg.settings())
            if state.settings.get(k) != cfg.settings().get(k)
        )
        raise UserError(
            f"{out} holds data prepared with other settings ({', '.join(diff)} differ); "
            f"use another --out or delete {out}"
        )
    period = val_period(cfg.val_fraction)
    found = inp.count(period)
    if found == 0:
        raise UserError(
            f"no documents in {', '.join(cfg.inputs)}: {len(files)} file(s), none with a non-empty "
            f"'{cfg.text_column}' value"
        )
    if found < period:
        raise UserError(
            f"only {found} documents: --val-fraction {cfg.val_fraction} puts every {period}th "
            "document in the validation split, which would be empty; add data or raise --val-fraction"
        )
    tok = _tokenizer(cfg, out, state, inp, log)
    dtype = check_dtype(tok.vocab_size, cfg.dtype)
    if state is not None and state.tokenizer_sha256 != tok.sha256():
        if not cfg.trains_tokenizer:
            raise UserError(
                f"{out} was prepared with a different tokenizer (sha256 {state.tokenizer_sha256[:12]}); "
                f"use another --out or delete {out}"
            )
        log(
            f"the saved tokenizer of {out} is gone or damaged and training gave a different one; starting over"
        )
        state = None
    work = plan_resume(state, files, cfg, out, dtype, log)
    sources = [f.label for f in files]
    if work.up_to_date:
        manifest = _manifest(cfg, tok, dtype, work.kept, sources, state.files if state else [])
        if not (out / MANIFEST).exists():
            manifest.save(out)
        log(f"{out} is up to date: {sum(len(v) for v in work.kept.values())} shards verified ({cfg.verify})")
        summary(manifest, out, time.time() - t0, 0, log)
        return PrepareResult(manifest, out, time.time() - t0, 0, True)

    # From here on the dir is being changed: it stops looking complete until the manifest is rewritten.
    (out / MANIFEST).unlink(missing_ok=True)
    remove_stale(out, {i.file for s in SPLITS for i in work.kept[s]})
    tok.save(out)
    new_state = PrepareState(
        cfg.settings(),
        tok.sha256(),
        [[f.name, f.fingerprint] for f in files],
        list(work.files),
        work.kept["train"],
        work.kept["val"],
        False,
    )
    if any(work.kept.values()):
        n = sum(len(v) for v in work.kept.values())
        log(
            f"resuming: {n} shards already written and verified; reading from input file {work.start_file + 1}"
            f"/{len(files)}"
        )

    def save_state() -> None:
        new_state.train, new_state.val = writers["train"].shards, writers["val"].shards
        new_state.save(out)

    def file_done(fi: int, first: int, n: int) -> None:
        if fi == len(new_state.files):
            new_state.files.append(FileRecord(files[fi].name, files[fi].fingerprint, first, n))

    writers = {
        s: SplitWriter(out, s, cfg.shard_tokens, dtype, work.kept[s], work.resume[s], save_state)
        for s in SPLITS
    }
    save_state()
    workers = cfg.workers or default_workers()
    initial = int(inp.offsets[work.start_file])
    progress = Progress(cfg.progress, inp.total_bytes, initial, log, cfg.log_every)
    ok = False
    try:
        with ParallelEncoder(tok, workers, dtype) as enc:
            for (g_idx, done), encoded in enc.map(_tasks(inp, work, period, file_done)):
                _route(encoded, g_idx, period, writers)
                progress.update(done, len(g_idx), int(encoded.tokens.size))
        for w in writers.values():
            w.close()
        ok = True
    finally:
        progress.close()
        if not ok:
            for w in writers.values():
                w.abort()
        save_state()
    if not writers["val"].shards:
        raise UserError("the validation split is empty; add data or raise --val-fraction")
    new_state.complete = True
    save_state()
    manifest = _manifest(cfg, tok, dtype, {s: writers[s].shards for s in SPLITS}, sources, new_state.files)
    manifest.save(out)
    new_tokens = sum(w.new_tokens for w in writers.values())
    summary(manifest, out, time.time() - t0, new_tokens, log)
    return PrepareResult(manifest, out, time.time() - t0, new_tokens, False)


def _route(enc: EncodedDocs, g_idx: np.ndarray, period: int, writers: dict[str, SplitWriter]) -> None:
    """Send each document's tokens to its split, keeping order within each split."""
    val = g_idx % period == period - 1
    for split, mask in (("train", ~val), ("val", val)):
        if not mask.any():
            continue
        if mask.all():
            writers[split].add(enc.tokens, enc.lengths, enc.nbytes, g_idx)
        else:
            tok_mask = np.repeat(mask, enc.lengths)
            writers[split].add(enc.tokens[tok_mask], enc.lengths[mask], enc.nbytes[mask], g_idx[mask])


def _manifest(
    cfg: PrepareConfig,
    tok: Tokenizer,
    dtype: np.dtype,
    shards: dict[str, list[ShardInfo]],
    sources: list[str],
    records: list[FileRecord],
) -> Manifest:
    docs = records[-1].first_doc + records[-1].documents if records else 0
    return Manifest(
        tokenizer=tok.describe(),
        dtype=np.dtype(dtype).name,
        shard_tokens=cfg.shard_tokens,
        train=list(shards["train"]),
        val=list(shards["val"]),
        sources=sources,
        documents=docs,
        val_fraction=cfg.val_fraction,
        settings=cfg.settings(),
    )


def build_dataset(
    documents: Callable[[], Iterable[str]],
    out_dir: Path,
    tokenizer: Tokenizer,
    val_fraction: float = 0.02,
    shard_tokens: int = 50_000_000,
    sources: list[str] | None = None,
    log: Log = print,
    workers: int = 1,
) -> Manifest:
    """Tokenize `documents()` into shards through the same pipeline (always rebuilt, not resumable)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out)
    (out / STATE).unlink(missing_ok=True)
    name = ",".join(sources or ["documents"])
    mem = SourceFile(name, 0, "memory", "txt", local_path=str(out))

    def reader(_path: Path, _f: SourceFile, _opts: ReadOptions) -> Iterator[tuple[list[str], int]]:
        batch: list[str] = []
        for d in documents():
            if d:
                batch.append(d)
            if len(batch) >= 1024:
                yield batch, 0
                batch = []
        if batch:
            yield batch, 0

    cfg = PrepareConfig(
        [name],
        out,
        tokenizer=str(out),
        val_fraction=val_fraction,
        shard_tokens=shard_tokens,
        workers=workers,
        progress="none",
    )
    return prepare(cfg, log, files=[mem], reader=reader).manifest
