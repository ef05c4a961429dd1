"""Tokenizers: a byte-level BPE (HF `tokenizers`) or a character vocabulary, behind one interface.

Both save to one `tokenizer.json` beside the shards; `load_tokenizer` tells them apart by content.
Every tokenizer has a document-boundary token `<|endoftext|>` placed after each document. Text
inside documents never produces the boundary id (a literal "<|endoftext|>" in a document is encoded
as ordinary text), so the boundary token always means "a document ended here".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.errors import UserError

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MIN_BPE_VOCAB = 257  # 256 byte symbols + the boundary token
_CHAR_KEY = "pretrain_char_vocab"
_ENCODE_SLICE = 128


@dataclass
class EncodedDocs:
    """Token ids of a batch of documents, each followed by the boundary token, as one flat array."""

    tokens: np.ndarray  # uint16/uint32, all documents concatenated
    lengths: np.ndarray  # int64 tokens per document (boundary token included)
    nbytes: np.ndarray  # int64 UTF-8 bytes per document (for bits per byte)


class Tokenizer:
    """What the data pipeline, trainer and sampler need from a tokenizer. Subclasses define `encode_batch`,
    `encode_docs` (documents -> EncodedDocs, the shard layout), `decode(ids)` and `to_json()`."""

    kind: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def save(self, directory: Path) -> Path:
        """Write `tokenizer.json` atomically (a crash never leaves a half-written tokenizer)."""
        path = Path(directory) / TOKENIZER_FILE
        tmp = path.with_name(f".{TOKENIZER_FILE}.tmp")
        tmp.write_text(self.to_json(), encoding="utf-8")
        os.replace(tmp, path)
        return path

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def describe(self) -> dict:
        """The manifest's record of this tokenizer."""
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eot_id": self.eot_id,
            "sha256": self.sha256(),
        }


def _utf8_lengths(texts: list[str]) -> np.ndarray:
    return np.fromiter(
        (len(t.encode("utf-8", "surrogatepass")) for t in texts), dtype=np.int64, count=len(texts)
    )


class BPETokenizer(Tokenizer):
    kind = "bpe"

    def __init__(self, tok) -> None:  # tok: tokenizers.Tokenizer
        self.tok, self.eot_id = tok, tok.token_to_id(EOT)
        if self.eot_id is None:
            raise UserError(f"tokenizer has no document-boundary token {EOT}; add it as a special token")
        self.vocab_size = tok.get_vocab_size()
        self._data_tok = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_docs(self, texts: list[str], dtype: np.dtype) -> EncodedDocs:
        """In slices of _ENCODE_SLICE documents: HF `Encoding` objects cost ~100 bytes per token, so this
        bounds memory whatever the batch size."""
        if self._data_tok is None:
            from tokenizers import Tokenizer as HFTokenizer

            self._data_tok = HFTokenizer.from_str(self.tok.to_str())
            self._data_tok.encode_special_tokens = True  # document text never yields the boundary id
        tokens, lengths = [np.zeros(0, dtype)], [np.zeros(0, np.int64)]
        for i in range(0, len(texts), _ENCODE_SLICE):
            encoded = self._data_tok.encode_batch(texts[i : i + _ENCODE_SLICE], add_special_tokens=False)
            ids = [e.ids for e in encoded]
            n = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
            flat = itertools.chain.from_iterable((*x, self.eot_id) for x in ids)
            tokens.append(np.fromiter(flat, dtype=dtype, count=int(n.sum())))
            lengths.append(n)
        return EncodedDocs(np.concatenate(tokens), np.concatenate(lengths), _utf8_lengths(texts))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()


class CharTokenizer(Tokenizer):
    """One id per character of its alphabet; id 0 is the boundary token, id 1 unknown characters."""

    kind = "char"

    def __init__(self, chars: str) -> None:
        self.chars = "".join(sorted(set(chars)))
        self.stoi = {c: i + 2 for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars) + 2
        self.eot_id = 0
        self._codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted

    def _ids(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        if not self._codes.size:
            return np.ones(codes.size, dtype=np.int64)
        pos = np.searchsorted(self._codes, codes)
        known = self._codes[np.minimum(pos, self._codes.size - 1)] == codes
        return np.where(known, pos + 2, 1)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._ids(t).tolist() for t in texts]

    def encode_docs(self, texts: list[str], dtype: np.dtype) -> EncodedDocs:
        boundary = np.zeros(1, dtype=np.int64)  # id 0
        parts = [a for t in texts for a in (self._ids(t), boundary)]
        flat = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
        lengths = np.fromiter((len(t) + 1 for t in texts), dtype=np.int64, count=len(texts))
        return EncodedDocs(flat, lengths, _utf8_lengths(texts))

    def decode(self, ids: list[int]) -> str:
        table = {0: EOT, 1: "\ufffd"} | {i: c for c, i in self.stoi.items()}
        return "".join(table.get(int(i), "\ufffd") for i in ids)

    def to_json(self) -> str:
        return json.dumps({_CHAR_KEY: self.chars, "eot": EOT}, ensure_ascii=False)


def check_bpe_vocab(vocab_size: int) -> None:
    if vocab_size < MIN_BPE_VOCAB:
        raise UserError(
            f"--vocab-size {vocab_size} is too small for a byte-level BPE; use >= {MIN_BPE_VOCAB}"
        )


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) with the boundary token as a special."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_bpe_vocab(vocab_size)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def train_char(texts: Iterable[str], alphabet: str = "") -> CharTokenizer:
    """The characters seen in `texts`, or a fixed `alphabet` (other characters become the unknown id)."""
    if alphabet:
        return CharTokenizer(alphabet)
    seen: set[str] = set()
    for t in texts:
        seen.update(t)
    return CharTokenizer("".join(seen))


def tokenizer_from_json(text: str, source: str = "tokenizer.json") -> Tokenizer:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise UserError(f"{source} is not valid JSON; re-run `pretrain prepare`") from None
    if isinstance(data, dict) and _CHAR_KEY in data:
        return CharTokenizer(data[_CHAR_KEY])
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise UserError(f"{source} is not a valid HF tokenizers file: {str(e).splitlines()[0]}") from None
    if tok.token_to_id(EOT) is None:  # adopt a tokenizer without one: the boundary token becomes a special
        tok.add_special_tokens([EOT])
    return BPETokenizer(tok)


def load_tokenizer(directory_or_file: Path) -> Tokenizer:
    path = Path(directory_or_file)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        raise UserError(f"no tokenizer at {path}; prepare the data with `pretrain prepare`") from None
    return tokenizer_from_json(text, str(path))


# ---- parallel encoding ---------------------------------------------------------------------------
# Workers are spawned processes, each with its own copy of the tokenizer running on one core. Results
# come back in submission order, so the output never depends on the number of workers.

_WORKER: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    try:  # Linux: SIGKILL when the parent dies (e.g. SIGKILL'd), instead of lingering
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)
    except (OSError, AttributeError):
        pass
    _WORKER = tokenizer_from_json(tokenizer_json)


def _encode_in_worker(texts: list[str], dtype: str) -> EncodedDocs:
    assert _WORKER is not None
    return _WORKER.encode_docs(texts, np.dtype(dtype))


class ParallelEncoder:
    """`encode_docs` over a stream of batches on N cores, in order, with bounded memory.

    At most `2 * workers` batches are in flight, so reading never runs ahead of tokenizing (a plain
    `Pool.imap` would read the whole input into its task queue).
    """

    def __init__(self, tokenizer: Tokenizer, workers: int, dtype: np.dtype) -> None:
        self.tokenizer, self.workers, self.dtype = tokenizer, max(1, workers), np.dtype(dtype)
        self._pool = None
        if self.workers > 1:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")  # no fork: the parent may hold threads (downloads, progress)
            self._pool = ctx.Pool(self.workers, initializer=_init_worker, initargs=(tokenizer.to_json(),))

    def map(self, batches: Iterable[tuple[object, list[str]]]) -> Iterator[tuple[object, EncodedDocs]]:
        """(meta, texts) -> (meta, encoded), in input order; `meta` stays in this process."""
        if self._pool is None:
            old = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, as asked
            try:
                yield from ((meta, self.tokenizer.encode_docs(texts, self.dtype)) for meta, texts in batches)
            finally:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
                if old is not None:
                    os.environ["TOKENIZERS_PARALLELISM"] = old
            return
        from collections import deque

        pending: deque = deque()
        try:
            for meta, texts in batches:
                pending.append((meta, self._pool.apply_async(_encode_in_worker, (texts, self.dtype.str))))
                if len(pending) >= 2 * self.workers:
                    m, r = pending.popleft()
                    yield m, r.get()
        except Exception:  # reading failed: hand back what was read before it, then raise
            yield from ((m, r.get()) for m, r in pending)
            raise
        yield from ((m, r.get()) for m, r in pending)

    def __enter__(self) -> ParallelEncoder:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
