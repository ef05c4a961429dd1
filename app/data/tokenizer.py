"""Tokenizers: a byte-level BPE (HF `tokenizers`) or a character vocabulary, behind one interface.

Both save to one `tokenizer.json` beside the shards; `load_tokenizer` tells them apart by content.
Every tokenizer has a document-boundary token `<|endoftext|>` placed between documents.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from app.errors import UserError

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
_CHAR_KEY = "pretrain_char_vocab"


class Tokenizer:
    """What the data pipeline, trainer and sampler need from a tokenizer."""

    kind: str
    vocab_size: int
    eot_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def to_json(self) -> str:
        raise NotImplementedError

    def save(self, directory: Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.write_text(self.to_json())
        return path

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


class BPETokenizer(Tokenizer):
    kind = "bpe"

    def __init__(self, tok) -> None:  # tok: tokenizers.Tokenizer
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise UserError(f"tokenizer has no document-boundary token {EOT}; add it as a special token")
        self.eot_id = eot

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()


class CharTokenizer(Tokenizer):
    """One id per character seen in training text; id 0 is the boundary token, id 1 unknown characters."""

    kind = "char"

    def __init__(self, chars: str) -> None:
        self.chars = "".join(sorted(set(chars)))
        self.stoi = {c: i + 2 for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars) + 2
        self.eot_id = 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        get = self.stoi.get
        return [[get(c, 1) for c in t] for t in texts]

    def decode(self, ids: list[int]) -> str:
        table = {0: EOT, 1: "\ufffd"} | {i: c for c, i in self.stoi.items()}
        return "".join(table.get(int(i), "\ufffd") for i in ids)

    def to_json(self) -> str:
        return json.dumps({_CHAR_KEY: self.chars, "eot": EOT}, ensure_ascii=False)


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) with the boundary token as a special."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

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


def train_char(texts: Iterable[str]) -> CharTokenizer:
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
        return BPETokenizer(HFTokenizer.from_str(text))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise UserError(f"{source} is not a valid HF tokenizers file: {str(e).splitlines()[0]}") from None


def load_tokenizer(directory_or_file: Path) -> Tokenizer:
    path = Path(directory_or_file)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    try:
        text = path.read_text()
    except OSError:
        raise UserError(f"no tokenizer at {path}; prepare the data with `pretrain prepare`") from None
    return tokenizer_from_json(text, str(path))


def iter_batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for it in items:
        batch.append(it)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
