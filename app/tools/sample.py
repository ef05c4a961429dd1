"""Generate text from a checkpoint: the config and tokenizer travel inside the checkpoint dir."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import torch

from app.config import config_from_dict
from app.data.tokenizer import load_tokenizer
from app.errors import UserError
from app.trainer.checkpoint import store as ckpt
from app.trainer.checkpoint.state import load_into
from app.trainer.model.generate import generate
from app.trainer.model.gpt import build_model


def resolve_checkpoint(spec: str, which: str = "latest", warn=ckpt.warn_stderr) -> ckpt.CheckpointInfo:
    """A step dir as given; a run dir's latest, or its best (lowest val loss among the checkpoints that
    verify; latest when none has one). Verified in the run's `checkpoint.verify` mode (sha256 by default)
    over the files inference reads (the optimizer state is not hashed): a damaged checkpoint is skipped
    with a warning, never loaded."""
    mode = ckpt.configured_verify(spec)
    if which == "best" and not (Path(spec) / ckpt.META).exists() and Path(spec).is_dir():
        best = ckpt.resolve_best(Path(spec), mode, warn, hash_only=ckpt.for_inference)
        if best is not None:
            return best
        latest = ckpt.resolve(spec, mode, warn, hash_only=ckpt.for_inference)  # none at all: the one error
        warn(f"note: no usable checkpoint under {spec} has a val loss; using the latest")
        return latest
    return ckpt.resolve(spec, mode, warn, hash_only=ckpt.for_inference)


def load_for_inference(spec: str, device: str = "cpu", which: str = "latest", warn=ckpt.warn_stderr):
    """(model in eval mode, tokenizer, checkpoint info) from a run dir or step dir. The weights are read
    tensor by tensor into the model, from the shards of whatever world size wrote them: memory stays at
    the model plus one tensor."""
    info = resolve_checkpoint(spec, which, warn)
    cfg = config_from_dict(info.meta["config"])
    model = build_model(cfg.model, device)
    ckpt.check_compatible(model, ckpt.load_model_shapes(info), info.path)
    load_into(info, model, None)
    model.eval()
    return model, load_tokenizer(info.path), info


def require_extra(extra: str, *modules: str) -> None:
    """Import `pretrain EXTRA`'s optional dependencies now: a missing one is a one-line error."""
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError as e:
        hint = f"pip install 'pretrain[{extra}]' (make setup installs it)"
        raise UserError(f"pretrain {extra} needs the {extra} extra ({e.name} is missing): {hint}") from None


def pick_device(choice: str) -> str:
    """--device auto | cpu | cuda as a device name; cuda asked for but not visible is a UserError."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible; use --device cpu")
    return "cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu"


def add_checkpoint_arguments(p: argparse.ArgumentParser, which: str) -> None:
    """--checkpoint and --which, shared by sample, serve and eval; `which` is the default."""
    where = f"a run dir (its {which} checkpoint, see --which) or a checkpoints/step_NNNNNN dir"
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR|CKPT_DIR", help=where)
    both = "for a run dir: latest = the newest checkpoint, best = the lowest val loss (else latest)"
    p.add_argument("--which", choices=("latest", "best"), default=which, help=f"{both}; default {which}")


MAX_NEW_TOKENS = 100_000  # a CPU samples a few hundred tokens a second: more would look like a hang


def consolidate(spec: str, path: Path, which: str = "latest", force: bool = False) -> Path:
    """The checkpoint's weights as one safetensors file (`pretrain export`'s final.safetensors)."""
    from app.tools.export import write_final

    if path.is_dir() or path.suffix != ".safetensors":
        path = path / "final.safetensors"
    if path.exists() and not force:
        raise UserError(f"--consolidate {path} exists; choose a new path, or add --force to replace it")
    info = resolve_checkpoint(spec, which)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_final(path, info)
    except OSError as e:
        raise UserError(f"cannot write --consolidate {path}: {e.strerror}") from None
    return path


def sample(args: argparse.Namespace) -> list[str]:
    if not 0 < args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS:,}, got {args.max_new_tokens}")
    if not args.temperature >= 0:  # NaN too
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = all tokens), got {args.top_k}")
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {args.num_samples}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    model, tok, _ = load_for_inference(args.checkpoint, which=args.which)
    ids = tok.encode(args.prompt) or [tok.eot_id]
    g = torch.Generator().manual_seed(args.seed)  # one stream: the samples differ, and repeat with the seed
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=g)
    ys = [generate(model, torch.tensor([ids]), args.max_new_tokens, **kw) for _ in range(args.num_samples)]
    return [args.prompt + tok.decode(y[0, len(ids) :].tolist()) for y in ys]


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(p, "latest")
    add = p.add_argument
    add("--prompt", default="\n", help="text to continue (default: a newline)")
    add("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to generate (default 200)")
    add("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)")
    add("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default 50; 0 = all)")
    nucleus = "nucleus sampling: the smallest set of tokens with this much probability (default 1.0 = off)"
    add("--top-p", type=float, default=1.0, help=nucleus)
    add("--num-samples", type=int, default=1, metavar="N", help="independent samples (default 1)")
    add("--seed", type=int, default=0, help="sampling seed (default 0)")
    weights = "also write the weights, from the shards of any world size, as one FILE.safetensors"
    add("--consolidate", metavar="FILE|DIR", help=f"{weights} (another path: DIR/final.safetensors)")
    add("--force", action="store_true", help="replace an existing --consolidate file")


def run(args: argparse.Namespace) -> int:
    if args.consolidate:
        path = consolidate(args.checkpoint, Path(args.consolidate), args.which, args.force)
        print(f"consolidated weights: {path}")
    for text in sample(args):
        print(text)
        print("-" * 40)
    return 0
