"""Input files -> a stream of documents: local parquet, jsonl (optionally .gz/.zst) and txt files,
directories or globs (listed here), and HF Hub dataset files (listed and downloaded by app.data.hub).

Everything streams: parquet in record batches, jsonl and txt line by line, so memory does not grow with
the input. Every read error names the file and becomes a one-line UserError.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import itertools
import json
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from app.errors import UserError

_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_FORMATS = {
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".txt": "txt",
    ".text": "txt",
    ".md": "txt",
}
SUPPORTED = ".parquet, .jsonl/.json/.ndjson and .txt/.md (text formats optionally .gz or .zst)"


@dataclass(frozen=True)
class SourceFile:
    """One input file; `name` and `fingerprint` let a re-run tell whether it changed."""

    name: str  # path relative to its input (local), or the path in the repo (hub)
    size: int
    fingerprint: str
    format: str  # parquet | jsonl | txt
    compression: str = ""  # "" | gzip | zstd
    local_path: str = ""  # "" for a hub file until it is downloaded
    repo: str = ""  # hub dataset repo id
    commit: str = ""  # hub commit sha the listing came from
    row_groups: tuple[int, int] | None = None  # parquet: only row groups [first, stop) (a share's part)

    @property
    def label(self) -> str:
        """How messages and the manifest name this file."""
        return f"hf://datasets/{self.repo}/{self.name}" if self.repo else (self.local_path or self.name)


def file_format(name: str) -> tuple[str, str] | None:
    """(format, compression) from the file name, or None when it is not a supported input."""
    p = Path(name.lower())
    compression = _COMPRESSION.get(p.suffix, "")
    if compression:
        p = p.with_suffix("")
    fmt = _FORMATS.get(p.suffix)
    if fmt is None or (fmt == "parquet" and compression):
        return None
    return fmt, compression


def _quick_fingerprint(path: Path, size: int) -> str:
    """Size plus a hash of the first and last 64 KiB: survives copies, notices almost any rewrite."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        if size > 1 << 17:
            f.seek(size - (1 << 16))
        h.update(f.read(1 << 16))
    return f"{size}:{h.hexdigest()[:16]}"


def _local_file(path: Path, name: str) -> SourceFile:
    fmt = file_format(path.name)
    if fmt is None:
        raise UserError(f"cannot tell the format of {path}: supported are {SUPPORTED}")
    try:
        size = path.stat().st_size
        fingerprint = _quick_fingerprint(path, size)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    return SourceFile(name, size, fingerprint, fmt[0], fmt[1], local_path=str(path))


def list_local(spec: str) -> list[SourceFile]:
    """A file, a directory (searched recursively, hidden entries skipped) or a glob pattern."""
    if any(c in spec for c in "*?["):
        paths = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        files = [p for p in paths if file_format(p.name)]
        if not files:
            raise UserError(f"no input files match {spec} (supported: {SUPPORTED})")
        root = Path(spec.split("*")[0].split("?")[0].split("[")[0])
        root = root if root.is_dir() else root.parent
        return [_local_file(p, str(p.relative_to(root)) if p.is_relative_to(root) else p.name) for p in files]
    path = Path(spec)
    if path.is_file():
        return [_local_file(path, path.name)]
    if not path.exists():
        raise UserError(f"input {spec} does not exist")
    if not path.is_dir():
        raise UserError(f"input {spec} is neither a file nor a directory")
    found: list[Path] = []
    others: set[str] = set()
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        (found.append(p) if file_format(p.name) else others.add(p.suffix or p.name))
    if not found:
        what = f" (found only {', '.join(sorted(others)[:8])})" if others else " (it is empty)"
        raise UserError(f"no input files in {spec}{what}; supported are {SUPPORTED}")
    return [_local_file(p, str(p.relative_to(path))) for p in found]


_BATCH_CHARS = 1 << 20  # a yielded batch holds about this much text at most
MAX_UNDECODABLE_FRACTION = 0.001  # of a txt file's characters; beyond it the file is refused
MAX_UNDECODABLE_CHARS = 16  # ... once more than this many did not decode
_AHEAD = 1  # hub files downloaded ahead of the one being read
_READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, UnicodeDecodeError)
Batches = Iterator[tuple[list[str], int]]  # documents, with the bytes of the file read so far


@dataclass(frozen=True)
class ReadOptions:
    text_column: str = "text"
    txt_split: str = "file"  # file: one document per file; line: per line; paragraph: see _paragraph_docs
    doc_chars: int = 4000  # paragraph mode: documents are runs of paragraphs of about this many characters
    batch_rows: int = 256  # parquet rows per batch; jsonl/txt batches also stop at _BATCH_CHARS


class Fetcher:
    """Local paths of the input files, downloading hub files ahead of use so tokenizing does not wait.

    Downloads run in daemon threads: an error or Ctrl-C never waits for a prefetch to finish (the
    download cache resumes it next time).
    """

    def __init__(self, files: list[SourceFile], download: Callable[[SourceFile], Path]) -> None:
        self.files, self.download = files, download
        self._futures: dict[int, Future] = {}

    def _submit(self, i: int) -> None:
        if i >= len(self.files) or i in self._futures or self.files[i].local_path:
            return
        fut: Future = Future()
        f = self.files[i]

        def work() -> None:
            try:
                fut.set_result(self.download(f))
            except BaseException as e:  # handed to the caller of path()
                fut.set_exception(e)

        threading.Thread(target=work, name=f"prefetch-{i}", daemon=True).start()
        self._futures[i] = fut

    def path(self, i: int) -> Path:
        for j in range(i, i + _AHEAD + 1):
            self._submit(j)
        if self.files[i].local_path:
            return Path(self.files[i].local_path)
        return self._futures.pop(i).result()


class DocumentStream:
    """The numbered document stream over all input files, read from any file onwards."""

    def __init__(self, files: list[SourceFile], fetcher: Fetcher, opts: ReadOptions) -> None:
        self.files, self.fetcher, self.opts = files, fetcher, opts
        self.offsets = list(itertools.accumulate((f.size for f in files), initial=0))

    @property
    def total_bytes(self) -> int:
        return self.offsets[-1]

    def batches(
        self,
        start_file: int = 0,
        first_doc: int = 0,
        on_file_done: Callable[[int, int, int], None] | None = None,
    ) -> Iterator[tuple[int, list[str], int]]:
        """(index of the first document, documents, input bytes consumed so far) from `start_file` on."""
        g = first_doc
        for fi in range(start_file, len(self.files)):
            f = self.files[fi]
            file_first = g
            for texts, done in read_documents(self.fetcher.path(fi), f, self.opts):
                if texts:
                    yield g, texts, self.offsets[fi] + min(done, f.size)
                    g += len(texts)
            if on_file_done is not None:
                on_file_done(fi, file_first, g - file_first)
            yield g, [], self.offsets[fi + 1]

    def documents(self) -> Iterator[tuple[int, str]]:
        for g, texts, _ in self.batches():
            yield from enumerate(texts, g)


# ---- readers -------------------------------------------------------------------------------------


def _open_binary(path: Path, compression: str) -> tuple[io.BufferedIOBase, io.BufferedReader]:
    """(decompressed stream, raw file whose position tells how far into the file we are)."""
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw), raw
    if compression == "zstd":  # pyarrow's: the stdlib has none before 3.14
        import pyarrow as pa

        return io.BufferedReader(pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd")), raw
    return raw, raw


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def read_documents(path: Path, f: SourceFile, opts: ReadOptions) -> Batches:
    """Batches of non-empty documents of one file, each with the bytes of the file read so far."""
    reader = {"parquet": _read_parquet, "jsonl": _read_jsonl, "txt": _read_txt}[f.format]
    try:
        yield from reader(path, f, opts)
    except Exception as e:
        import pyarrow as pa  # its errors are ArrowException subclasses

        if not isinstance(e, (*_READ_ERRORS, pa.ArrowException)):
            raise
        raise UserError(f"cannot read {f.label}: {_one_line(e)} (is it corrupt or truncated?)") from None


def batched(docs: Iterable[str], opts: ReadOptions, tell: Callable[[], int]) -> Batches:
    """Batches of `opts.batch_rows` documents or about _BATCH_CHARS of text, each with `tell()` after it."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= opts.batch_rows or chars >= _BATCH_CHARS:
            yield batch, tell()
            batch, chars = [], 0
    if batch:
        yield batch, tell()


def _read_parquet(path: Path, f: SourceFile, opts: ReadOptions) -> Batches:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{f.label} is not a readable parquet file: {_one_line(e)}") from None
    names = pf.schema_arrow.names
    if opts.text_column not in names:
        raise UserError(
            f"{f.label} has no column '{opts.text_column}'; its columns are: {', '.join(names)} "
            "(choose one with --text-column)"
        )
    typ = pf.schema_arrow.field(opts.text_column).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or str(typ) == "string_view"):
        raise UserError(
            f"column '{opts.text_column}' of {f.label} holds {typ}, not text; choose --text-column"
        )
    groups = range(*f.row_groups) if f.row_groups else range(pf.num_row_groups)
    total_rows = max(1, sum(pf.metadata.row_group(g).num_rows for g in groups))
    rows = 0
    with pf:
        for batch in pf.iter_batches(
            batch_size=opts.batch_rows, columns=[opts.text_column], row_groups=groups, use_threads=False
        ):
            rows += batch.num_rows
            texts = [t for t in batch.column(0).to_pylist() if t]
            yield texts, f.size * rows // total_rows


def _read_jsonl(path: Path, f: SourceFile, opts: ReadOptions) -> Batches:
    stream, raw = _open_binary(path, f.compression)
    with raw, stream:
        yield from batched(_jsonl_texts(stream, f.label, opts.text_column), opts, raw.tell)


def _jsonl_texts(lines: Iterable[bytes], label: str, col: str) -> Iterator[str]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{label} line {lineno} is not valid JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise UserError(f"{label} line {lineno} is not a JSON object")
        if lineno == 1 and col not in obj:
            raise UserError(
                f"{label} has no field '{col}'; its fields are: {', '.join(obj) or '(none)'} "
                "(choose one with --text-column)"
            )
        text = obj.get(col)
        if text and isinstance(text, str):
            yield text


def _utf8_checked(docs: Iterable[str], label: str) -> Iterator[str]:
    """`docs`, counting characters that did not decode (U+FFFD from errors="replace"): a few are tolerated
    (a stray byte in a large text), a binary file or another encoding is refused, naming the file."""
    chars = bad = 0
    for doc in docs:
        chars += len(doc)
        bad += doc.count("\ufffd")
        if bad > MAX_UNDECODABLE_CHARS and bad > MAX_UNDECODABLE_FRACTION * chars:
            raise UserError(
                f"{label} is not UTF-8 text ({bad:,} of its first {chars:,} characters do not "
                "decode); convert it to UTF-8 or leave it out"
            )
        yield doc


def _read_txt(path: Path, f: SourceFile, opts: ReadOptions) -> Batches:
    stream, raw = _open_binary(path, f.compression)
    with raw, io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline=None) as text:
        if opts.txt_split == "paragraph":
            docs = _paragraph_docs(text, opts.doc_chars)
        else:  # a whole file or each line: blank ones are left out below
            docs = [text.read()] if opts.txt_split == "file" else (line.rstrip("\n") for line in text)
        yield from batched(_utf8_checked((d for d in docs if d.strip()), f.label), opts, raw.tell)


def _paragraph_docs(text: io.TextIOBase, doc_chars: int) -> Iterator[str]:
    """Paragraphs (separated by blank lines) joined by one blank line into documents of >= doc_chars."""
    doc: list[str] = []
    para: list[str] = []
    size = 0
    for line in itertools.chain(text, [""]):
        if line.strip():
            para.append(line)
            continue
        if para:
            p = "".join(para).rstrip("\n")
            para = []
            doc.append(p)
            size += len(p)
            if size >= doc_chars:
                yield "\n\n".join(doc)
                doc, size = [], 0
    if doc:
        yield "\n\n".join(doc)
