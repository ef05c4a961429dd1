"""Resume state of `pretrain prepare` (prepare_state.json) and the plan of what a re-run keeps (how
resuming works: app/data/prepare.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from app.data.inputs import SourceFile
from app.data.manifest import SPLITS, from_dict
from app.data.settings import PrepareConfig
from app.data.shards import ShardInfo, verify_shard
from app.files import atomic_write_json

STATE = "prepare_state.json"


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

    def save(self, directory: Path) -> None:
        atomic_write_json(Path(directory) / STATE, asdict(self))  # compact: rewritten after every shard

    @classmethod
    def load(cls, directory: Path) -> PrepareState | None:
        try:
            data = json.loads((Path(directory) / STATE).read_text())
            data["files"] = [from_dict(FileRecord, r) for r in data.get("files", [])]
            for s in SPLITS:
                data[s] = [from_dict(ShardInfo, x) for x in data.get(s, [])]
            return from_dict(cls, data)
        except (OSError, ValueError, TypeError, KeyError):  # none, or unreadable: start over
            return None  # (shards are rewritten atomically)


@dataclass
class Plan:
    kept: dict[str, list[ShardInfo]]
    files: list[FileRecord]  # completed-file records still valid
    start_file: int
    first_doc: int
    resume: dict[str, tuple[int, int]]  # per split: position of the next token to write
    up_to_date: bool


def plan(
    state: PrepareState | None,
    files: list[SourceFile],
    cfg: PrepareConfig,
    out: Path,
    dtype: np.dtype,
    log,
) -> Plan:
    if state is None:
        state = PrepareState({}, "")  # nothing to keep
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
    kept: dict[str, list[ShardInfo]] = {}
    for s in SPLITS:
        good: list[ShardInfo] = []
        for info in getattr(state, s):
            if limit is not None and last_doc(info) >= limit:
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
        if r.end > start_doc:
            break
        start_file, first_doc = i + 1, r.end
    return Plan(kept, records[:start_file], start_file, first_doc, resume, up_to_date)  # type: ignore[arg-type]


def last_doc(info: ShardInfo) -> int:
    """Index of the document holding a shard's last token."""
    g, offset = info.end
    return g if offset > 0 else g - 1
