"""Raw text -> tokenizer -> token shards + validation split + manifest.json (`pretrain prepare`).

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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.data import hub
from app.data.inputs import SourceFile
from app.data.manifest import MANIFEST, SPLITS, Manifest, is_val_document, val_period
from app.data.progress import Log, Progress, summary
from app.data.resume import STATE, FileRecord, Plan, PrepareState
from app.data.resume import plan as plan_resume
from app.data.settings import PrepareConfig, check_config, check_dtype, default_workers
from app.data.shards import SplitWriter, remove_stale
from app.data.sources import DocumentStream, Fetcher, ReadOptions, batched, read_documents, resolve_inputs
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
from app.files import unwritable_message

LOCK = ".prepare.lock"
_TASK_CHARS = 1 << 20  # text per worker task: big enough to amortize IPC, small enough for smooth progress


@dataclass
class PrepareResult:
    manifest: Manifest
    new_tokens: int  # tokens written by this run (0 when the dir was already up to date)
    up_to_date: bool


@contextmanager
def _dir_lock(out: Path) -> Iterator[None]:
    """One writer per data dir; also proves the dir is writable before any work starts."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / LOCK, "a+")  # noqa: SIM115 - closed below
    except FileExistsError:
        raise UserError(f"output {out} exists and is not a directory") from None
    except OSError as e:
        raise UserError(unwritable_message(out, "--out", e.strerror)) from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UserError(
            f"another `pretrain prepare` is writing {out}; wait for it or use another --out"
        ) from None
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()
        # A run that failed before writing anything leaves no trace: not even the dir it created.
        if created and [p.name for p in out.iterdir()] == [LOCK]:
            (out / LOCK).unlink(missing_ok=True)
            out.rmdir()


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
    """The saved tokenizer when resuming, else loaded or trained (saved beside the shards by the caller)."""
    if state is not None:
        try:
            tok = load_tokenizer(out / TOKENIZER_FILE)
        except UserError:  # gone or damaged
            tok = None
        if tok is not None and tok.sha256() == state.tokenizer_sha256:
            if not cfg.trains_tokenizer:
                loaded, label = _load_tokenizer_spec(cfg)
                if loaded.sha256() != tok.sha256():
                    raise UserError(
                        f"{out} was prepared with a different tokenizer than {label}; "
                        f"use another --out or delete {out}"
                    )
            return tok
    if cfg.tokenizer == "bpe":
        mb = cfg.sample_bytes / 1e6
        log(f"training a byte-level BPE tokenizer (vocab {cfg.vocab_size}) on up to {mb:.0f} MB ...")
        return train_bpe(_sample(inp, cfg, log), cfg.vocab_size)
    if cfg.tokenizer == "char":  # with a fixed alphabet the sample is never read
        return train_char(_sample(inp, cfg, log), cfg.char_alphabet)
    tok, label = _load_tokenizer_spec(cfg)
    log(f"tokenizer {label}: {tok.kind}, vocab {tok.vocab_size}")
    return tok


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


def prepare(
    cfg: PrepareConfig, log: Log = print, *, files: list[SourceFile] | None = None, reader=read_documents
) -> PrepareResult:
    """Run `pretrain prepare`: resolve inputs, get a tokenizer, write (or finish) the shards and manifest."""
    t0 = time.time()
    check_config(cfg)
    out = Path(cfg.out_dir)
    with _dir_lock(out):
        if files is None:
            files = resolve_inputs(cfg.inputs, cfg.revision, cfg.includes)
        fetcher = Fetcher(files, lambda f: hub.download(f, cfg.cache_dir))
        opts = ReadOptions(cfg.text_column, cfg.txt_split, cfg.doc_chars)
        return _run(cfg, out, DocumentStream(files, fetcher, opts, reader), log, t0)


def _run(cfg: PrepareConfig, out: Path, inp: DocumentStream, log: Log, t0: float) -> PrepareResult:
    files, settings = inp.files, cfg.settings()
    state = PrepareState.load(out)
    if state is not None and state.settings != settings:
        diff = sorted(k for k in state.settings.keys() | settings if state.settings.get(k) != settings.get(k))
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
    n_kept = sum(len(v) for v in work.kept.values())

    def finish(shards: dict, records: list[FileRecord], new_tokens: int) -> PrepareResult:
        manifest = Manifest(
            tokenizer=tok.describe(),
            dtype=dtype.name,
            shard_tokens=cfg.shard_tokens,
            train=list(shards["train"]),
            val=list(shards["val"]),
            sources=[f.label for f in files],
            documents=records[-1].end if records else 0,
            val_fraction=cfg.val_fraction,
            settings=settings,
        )
        if not (out / MANIFEST).exists():
            manifest.save(out)
        summary(manifest, out, time.time() - t0, new_tokens, log)
        return PrepareResult(manifest, new_tokens, work.up_to_date)

    if work.up_to_date:
        log(f"{out} is up to date: {n_kept} shards verified ({cfg.verify})")
        return finish(work.kept, state.files if state else [], 0)

    # From here on the dir is being changed: it stops looking complete until the manifest is rewritten.
    (out / MANIFEST).unlink(missing_ok=True)
    remove_stale(out, {i.file for s in SPLITS for i in work.kept[s]})
    tok.save(out)
    inputs = [[f.name, f.fingerprint] for f in files]
    new_state = PrepareState(settings, tok.sha256(), inputs, list(work.files), **work.kept)
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

    writers = {
        s: SplitWriter(out, s, cfg.shard_tokens, dtype, work.kept[s], work.resume[s], save_state)
        for s in SPLITS
    }
    save_state()
    workers = cfg.workers or default_workers()
    initial = int(inp.offsets[work.start_file])
    progress = Progress(cfg.progress, inp.total_bytes, initial, log, cfg.log_every)
    try:
        with ParallelEncoder(tok, workers, dtype) as enc:
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
    if not writers["val"].shards:
        raise UserError("the validation split is empty; add data or raise --val-fraction")
    new_state.complete = True
    save_state()
    new_tokens = sum(w.new_tokens for w in writers.values())
    return finish({s: w.shards for s, w in writers.items()}, new_state.files, new_tokens)


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

    def reader(_path: Path, _f: SourceFile, opts: ReadOptions) -> Iterator[tuple[list[str], int]]:
        return batched((d for d in documents() if d), opts, lambda: 0)

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
