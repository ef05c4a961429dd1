"""A data dir's JSON files: manifest.json, its table of contents (tokenizer, shards, split rule), which
the trainer reads with the shards and nothing else; and prepare_state.json, what a re-run of `pretrain
prepare` resumes from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from app.data.shards import ShardInfo
from app.errors import UserError
from app.files import atomic_write_json

MANIFEST = "manifest.json"
STATE = "prepare_state.json"
MANIFEST_VERSION = 2
SPLITS = ("train", "val")


def from_dict(cls, data: dict):
    """Build a dataclass from JSON, ignoring keys a newer version may have added."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def _with_shards(data: dict) -> dict:
    return data | {s: [from_dict(ShardInfo, x) for x in data.get(s, [])] for s in SPLITS}


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
        tokens = self.tokens(name)
        return sum(s.bytes for s in self.split(name)) / tokens if tokens else 0.0

    def save(self, directory: Path) -> None:
        atomic_write_json(Path(directory) / MANIFEST, asdict(self), indent=1)

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
        return from_dict(cls, _with_shards(data))


@dataclass
class FileRecord:
    """An input file read to its end: how many documents it holds and where they start."""

    name: str
    fingerprint: str
    first_doc: int
    documents: int

    @property
    def end(self) -> int:
        """Index of the document after its last one."""
        return self.first_doc + self.documents


@dataclass
class PrepareState:
    settings: dict
    tokenizer_sha256: str
    inputs: list[list[str]] = field(default_factory=list)  # [name, fingerprint] of every input file
    files: list[FileRecord] = field(default_factory=list)  # completed files, in order, from the first
    train: list[ShardInfo] = field(default_factory=list)
    val: list[ShardInfo] = field(default_factory=list)
    complete: bool = False
    first_doc: int = 0  # index of the first document (a share of a sharded prepare starts further on)
    plan: str = ""  # a share's: digest of the inputs, settings and share count it was made for

    def save(self, directory: Path) -> None:
        atomic_write_json(Path(directory) / STATE, asdict(self))  # compact: rewritten after every shard

    @classmethod
    def load(cls, directory: Path) -> PrepareState | None:
        try:
            data = _with_shards(json.loads((Path(directory) / STATE).read_text()))
            data["files"] = [from_dict(FileRecord, r) for r in data.get("files", [])]
            return from_dict(cls, data)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):  # none or unreadable: start over
            return None  # (shards are rewritten atomically)


def is_val_document(index: int, val_fraction: float) -> bool:
    """Deterministic document-level split: every round(1/f)-th document goes to validation."""
    return index % val_period(val_fraction) == val_period(val_fraction) - 1


def val_period(val_fraction: float) -> int:
    return max(2, round(1 / val_fraction))
