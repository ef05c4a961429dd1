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
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from app.data.shards import ShardInfo, SplitWriter, dtype_for_vocab, remove_stale, verify_shard
from app.data.sources import DocumentStream, Fetcher, ReadOptions, SourceFile, read_documents, resolve_inputs
from app.data.tokenizer import (
    MIN_BPE_VOCAB,
    TOKENIZER_FILE,
    EncodedDocs,
    ParallelEncoder,
    Tokenizer,
    load_tokenizer,
    train_bpe,
    train_char,
)
from app.errors import UserError

MANIFEST = "manifest.json"
STATE = "prepare_state.json"
LOCK = ".prepare.lock"
MANIFEST_VERSION = 2
PIPELINE_VERSION = 1  # bump when the same settings would produce different shards
SPLITS = ("train", "val")
_TASK_CHARS = 1 << 20  # text per worker task: big enough to amortize IPC, small enough for smooth progress
Log = Callable[[str], None]


def _from_dict(cls, data: dict):
    """Build a dataclass from JSON, ignoring keys a newer version may have added."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Manifest:
    tokenizer: dict
    dtype: str
    shard_tokens: int
    train: list[ShardInfo] = field(default_factory=list)
    val: list[ShardInfo] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    version: int = MANIFEST_VERSION
    documents: int = 0
    val_fraction: float = 0.0
    settings: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    def split(self, name: str) -> list[ShardInfo]:
        return self.train if name == "train" else self.val

    def tokens(self, name: str) -> int:
        return sum(s.tokens for s in self.split(name))

    def bytes_per_token(self, name: str) -> float:
        shards = self.split(name)
        tokens = sum(s.tokens for s in shards)
        return sum(s.bytes for s in shards) / tokens if tokens else 0.0

    def save(self, directory: Path) -> None:
        _write_json(Path(directory) / MANIFEST, asdict(self))

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(
                f"{directory} has no {MANIFEST}; create it with `pretrain prepare --out {directory}`"
            ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
        data["train"] = [_from_dict(ShardInfo, s) for s in data.get("train", [])]
        data["val"] = [_from_dict(ShardInfo, s) for s in data.get("val", [])]
        return _from_dict(cls, data)


def _write_json(path: Path, data: dict, indent: int | None = 1) -> None:
    """Atomic and durable: temp file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=indent))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_val_document(index: int, val_fraction: float) -> bool:
    """Deterministic document-level split: every round(1/f)-th document goes to validation."""
    return index % val_period(val_fraction) == val_period(val_fraction) - 1


def val_period(val_fraction: float) -> int:
    return max(2, round(1 / val_fraction))


# ---- configuration and resume state ----------------------------------------------------------------


@dataclass
class PrepareConfig:
    """Everything `pretrain prepare` takes; see app/data/cli.py for what each option means."""

    inputs: list[str]
    out_dir: Path
    text_column: str = "text"
    tokenizer: str = (
        "bpe"  # bpe | char (trained on a sample) | PATH to tokenizer.json or a data dir | hf://REPO
    )
    vocab_size: int = 32768
    sample_bytes: int = 256 << 20
    char_alphabet: str = ""
    val_fraction: float = 0.01
    shard_tokens: int = 50_000_000
    dtype: str = "auto"
    workers: int = 0  # 0 = every core this process may use
    txt_split: str = "file"
    doc_chars: int = 4000
    includes: list[str] = field(default_factory=list)  # extra include globs for hf:// inputs
    revision: str | None = None
    cache_dir: str | None = None
    verify: str = "sha256"  # how a re-run checks kept shards: sha256 | size
    progress: str = "auto"  # auto (bar on a terminal, else log lines) | bar | log | none
    log_every: float = 30.0

    @property
    def trains_tokenizer(self) -> bool:
        return self.tokenizer in ("bpe", "char")

    def settings(self) -> dict:
        """What determines the shards' content; a re-run with different settings refuses to mix them."""
        s: dict = {
            "pipeline": PIPELINE_VERSION,
            "text_column": self.text_column,
            "val_fraction": self.val_fraction,
            "shard_tokens": self.shard_tokens,
            "dtype": self.dtype,
            "txt_split": self.txt_split,
        }
        if self.txt_split == "paragraph":
            s["doc_chars"] = self.doc_chars
        if self.tokenizer == "bpe":
            s["tokenizer"] = {
                "train": "bpe",
                "vocab_size": self.vocab_size,
                "sample_bytes": self.sample_bytes,
            }
        elif self.tokenizer == "char":
            s["tokenizer"] = {
                "train": "char",
                "alphabet": self.char_alphabet,
                "sample_bytes": 0 if self.char_alphabet else self.sample_bytes,
            }
        else:
            s["tokenizer"] = {"load": True}
        return s


@dataclass
class FileRecord:
    """An input file read to its end: how many documents it holds and where they start."""

    name: str
    fingerprint: str
    first_doc: int
    documents: int


@dataclass
class PrepareState:
    settings: dict
    tokenizer_sha256: str
    inputs: list[list[str]] = field(default_factory=list)  # [name, fingerprint] of every input file
    files: list[FileRecord] = field(default_factory=list)  # completed files, in order, from the first
    train: list[ShardInfo] = field(default_factory=list)
    val: list[ShardInfo] = field(default_factory=list)
    complete: bool = False

    def save(self, directory: Path) -> None:
        data = {**self.__dict__, "files": [r.__dict__ for r in self.files]}
        data.update({s: [i.__dict__ for i in getattr(self, s)] for s in SPLITS})
        _write_json(Path(directory) / STATE, data, indent=None)  # compact: rewritten after every shard

    @classmethod
    def load(cls, directory: Path) -> PrepareState | None:
        try:
            data = json.loads((Path(directory) / STATE).read_text())
            data["files"] = [_from_dict(FileRecord, r) for r in data.get("files", [])]
            for s in SPLITS:
                data[s] = [_from_dict(ShardInfo, x) for x in data.get(s, [])]
            return _from_dict(cls, data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError):
            return None  # unreadable state: start over (shards are rewritten atomically)


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


def _check_config(cfg: PrepareConfig) -> None:
    if not cfg.inputs:
        raise UserError("no input: pass --input PATH or --input hf://datasets/OWNER/NAME")
    if not 0 < cfg.val_fraction < 0.5:
        raise UserError(f"--val-fraction must be in (0, 0.5), got {cfg.val_fraction}")
    if cfg.shard_tokens < 1:
        raise UserError(f"--shard-tokens must be >= 1, got {cfg.shard_tokens}")
    if cfg.dtype not in ("auto", "uint16", "uint32"):
        raise UserError(f"--dtype must be auto, uint16 or uint32, got {cfg.dtype}")
    if cfg.tokenizer == "bpe":
        if cfg.vocab_size < MIN_BPE_VOCAB:
            raise UserError(
                f"--vocab-size {cfg.vocab_size} is too small for a byte-level BPE; use >= {MIN_BPE_VOCAB}"
            )
        _check_dtype(cfg.vocab_size, cfg.dtype)
    if cfg.txt_split not in ("file", "line", "paragraph"):
        raise UserError(f"--txt-split must be file, line or paragraph, got {cfg.txt_split}")
    if cfg.verify not in ("sha256", "size"):
        raise UserError(f"--verify must be sha256 or size, got {cfg.verify}")
    if cfg.sample_bytes < 1:
        raise UserError(f"--tokenizer-sample-bytes must be >= 1, got {cfg.sample_bytes}")


def _check_dtype(vocab_size: int, dtype: str) -> np.dtype:
    if dtype == "uint16" and vocab_size > 2**16:
        raise UserError(
            f"a vocabulary of {vocab_size} tokens does not fit --dtype uint16 (at most 65536); "
            "use --dtype uint32 or auto"
        )
    if vocab_size > 2**32:
        raise UserError(f"a vocabulary of {vocab_size} tokens does not fit uint32 token ids")
    return np.dtype(dtype) if dtype != "auto" else dtype_for_vocab(vocab_size)


def default_workers() -> int:
    """Cores this process may use: CPU affinity, capped by a cgroup CPU quota (a Kubernetes CPU limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota else cores


def _cgroup_cpu_quota() -> int:
    """ceil(quota / period) from cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`; 0 when unlimited or unknown."""
    import math

    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return 0 if quota == "max" else math.ceil(int(quota) / int(period))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return math.ceil(quota / period) if quota > 0 and period > 0 else 0
    except (OSError, ValueError):
        return 0


# ---- the document stream ---------------------------------------------------------------------------


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


# ---- tokenizer ---------------------------------------------------------------------------------------


def _load_tokenizer_spec(cfg: PrepareConfig) -> tuple[Tokenizer, str]:
    spec = cfg.tokenizer
    if spec.startswith("hf://"):
        from app.data import hub

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
    _check_dtype(tok.vocab_size, cfg.dtype)
    return tok


# ---- resume planning -------------------------------------------------------------------------------


@dataclass
class _Plan:
    kept: dict[str, list[ShardInfo]]
    files: list[FileRecord]  # completed-file records still valid
    start_file: int
    first_doc: int
    resume: dict[str, tuple[int, int]]  # per split: position of the next token to write
    up_to_date: bool


def _plan(
    state: PrepareState | None,
    files: list[SourceFile],
    cfg: PrepareConfig,
    out: Path,
    dtype: np.dtype,
    log: Log,
) -> _Plan:
    empty = {s: [] for s in SPLITS}
    if state is None:
        return _Plan(empty, [], 0, 0, {s: (0, 0) for s in SPLITS}, False)
    current = [[f.name, f.fingerprint] for f in files]
    same_inputs = state.inputs == current
    n_same = 0  # input files unchanged since the shards were written, from the first
    while n_same < min(len(current), len(state.inputs)) and current[n_same] == state.inputs[n_same]:
        n_same += 1
    records = state.files[:n_same]
    limit = None  # shards holding documents from this index on are stale
    if n_same < len(state.inputs):
        changed = files[n_same].name if n_same < len(files) else state.inputs[n_same][0]
        if n_same < len(state.files):
            limit = state.files[n_same].first_doc
        else:  # its first document index was never recorded: keep only what completed files hold
            limit = state.files[-1].first_doc + state.files[-1].documents if state.files else 0
        log(f"input file {changed} changed or is gone; re-making the shards from its documents on")
    kept: dict[str, list[ShardInfo]] = {}
    for s in SPLITS:
        good: list[ShardInfo] = []
        for info in getattr(state, s):
            if limit is not None and _last_doc(info) >= limit:
                break
            if info.tokens < cfg.shard_tokens and not (state.complete and same_inputs):
                break  # a tail shard: more input or a resumed run will extend it
            why = verify_shard(
                out / info.file, dtype, info.tokens, info.sha256 if cfg.verify == "sha256" else ""
            )
            if why:
                log(f"re-making {info.file}: {why}")
                break
            good.append(info)
        kept[s] = good
    up_to_date = (
        state.complete and same_inputs and all(len(kept[s]) == len(getattr(state, s)) for s in SPLITS)
    )
    resume = {s: tuple(kept[s][-1].end) if kept[s] else (0, 0) for s in SPLITS}
    start_doc = min(g for g, _ in resume.values())
    start_file, first_doc = 0, 0
    for i, r in enumerate(records):
        if r.first_doc + r.documents > start_doc:
            break
        start_file, first_doc = i + 1, r.first_doc + r.documents
    return _Plan(kept, records[:start_file], start_file, first_doc, resume, up_to_date)  # type: ignore[arg-type]


def _last_doc(info: ShardInfo) -> int:
    """Index of the document holding a shard's last token."""
    g, offset = info.end
    return g if offset > 0 else g - 1


# ---- writing ---------------------------------------------------------------------------------------


def _tasks(inp: DocumentStream, plan: _Plan, period: int, on_file_done) -> Iterator[tuple[tuple, list[str]]]:
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


class _Progress:
    """A tqdm bar on a terminal (bytes of input, docs/s, tokens/s, ETA), else a log line every N seconds."""

    def __init__(self, mode: str, total: int, initial: int, log: Log, every: float) -> None:
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode, self.total, self.initial, self.log, self.every = mode, max(total, 1), initial, log, every
        self.t0 = self.last = time.time()
        self.docs = self.tokens = 0
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="prepare",
                dynamic_ncols=True,
                smoothing=0.05,
            )

    def update(self, done: int, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        now = time.time()
        rate = f"{self.docs / max(now - self.t0, 1e-9):,.0f} docs/s, {_si(self.tokens / max(now - self.t0, 1e-9))} tok/s"
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(rate, refresh=False)
        elif self.mode == "log" and now - self.last >= self.every:
            self.last = now
            frac = (done - self.initial) / max(self.total - self.initial, 1)
            eta = (now - self.t0) * (1 - frac) / frac if frac > 0 else float("nan")
            self.log(
                f"prepare: {100 * done / self.total:.1f}% of {self.total / 1e9:.2f} GB input, "
                f"{self.docs:,} docs, {_si(self.tokens)} tokens ({rate}), ETA {_duration(eta)}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _duration(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ---- the pipeline ------------------------------------------------------------------------------------


def prepare(
    cfg: PrepareConfig, log: Log = print, *, files: list[SourceFile] | None = None, reader=read_documents
) -> PrepareResult:
    """Run `pretrain prepare`: resolve inputs, get a tokenizer, write (or finish) the shards and manifest."""
    t0 = time.time()
    _check_config(cfg)
    out = Path(cfg.out_dir)
    lock = _DirLock(out)
    fetcher = None
    try:
        if files is None:
            files = resolve_inputs(cfg.inputs, cfg.revision, cfg.includes)
        from app.data import hub

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
    dtype = _check_dtype(tok.vocab_size, cfg.dtype)
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
    plan = _plan(state, files, cfg, out, dtype, log)
    sources = [f.label for f in files]
    if plan.up_to_date:
        manifest = _manifest(cfg, tok, dtype, plan.kept, sources, state.files if state else [])
        if not (out / MANIFEST).exists():
            manifest.save(out)
        log(f"{out} is up to date: {sum(len(v) for v in plan.kept.values())} shards verified ({cfg.verify})")
        _summary(manifest, out, time.time() - t0, 0, log)
        return PrepareResult(manifest, out, time.time() - t0, 0, True)

    # From here on the dir is being changed: it stops looking complete until the manifest is rewritten.
    (out / MANIFEST).unlink(missing_ok=True)
    remove_stale(out, {i.file for s in SPLITS for i in plan.kept[s]})
    tok.save(out)
    new_state = PrepareState(
        cfg.settings(),
        tok.sha256(),
        [[f.name, f.fingerprint] for f in files],
        list(plan.files),
        plan.kept["train"],
        plan.kept["val"],
        False,
    )
    if any(plan.kept.values()):
        n = sum(len(v) for v in plan.kept.values())
        log(
            f"resuming: {n} shards already written and verified; reading from input file {plan.start_file + 1}"
            f"/{len(files)}"
        )

    def save_state() -> None:
        new_state.train, new_state.val = writers["train"].shards, writers["val"].shards
        new_state.save(out)

    def file_done(fi: int, first: int, n: int) -> None:
        if fi == len(new_state.files):
            new_state.files.append(FileRecord(files[fi].name, files[fi].fingerprint, first, n))

    writers = {
        s: SplitWriter(out, s, cfg.shard_tokens, dtype, plan.kept[s], plan.resume[s], save_state)
        for s in SPLITS
    }
    save_state()
    workers = cfg.workers or default_workers()
    initial = int(inp.offsets[plan.start_file])
    progress = _Progress(cfg.progress, inp.total_bytes, initial, log, cfg.log_every)
    ok = False
    try:
        with ParallelEncoder(tok, workers, dtype) as enc:
            for (g_idx, done), encoded in enc.map(_tasks(inp, plan, period, file_done)):
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
    _summary(manifest, out, time.time() - t0, new_tokens, log)
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


def _summary(m: Manifest, out: Path, seconds: float, new_tokens: int, log: Log) -> None:
    train, val = m.tokens("train"), m.tokens("val")
    total_bytes = sum(s.bytes for s in m.train + m.val)
    log(
        f"{m.documents:,} documents, {train:,} train tokens in {len(m.train)} shards + {val:,} val tokens in "
        f"{len(m.val)} shards ({m.dtype}, vocab {m.vocab_size}), {total_bytes / max(train + val, 1):.2f} bytes/token"
    )
    rate = f", {_si(new_tokens / max(seconds, 1e-9))} tokens/s" if new_tokens else ""
    log(f"done in {_duration(seconds)}{rate} -> {out}")


# ---- in-memory documents (kept for callers that have text rather than files) -------------------------


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
