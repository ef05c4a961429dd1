"""Generate text from a checkpoint: the config and tokenizer travel inside the checkpoint dir."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from app.config import config_from_dict
from app.data.tokenizer import load_tokenizer
from app.errors import UserError
from app.trainer import checkpoint as ckpt
from app.trainer.checkpoint_state import load_into
from app.trainer.generate import generate
from app.trainer.model import build_model


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
        warn(f"note: no usable checkpoint under {spec} has a val loss; using the latest")
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


def pick_device(choice: str) -> str:
    """--device auto | cpu | cuda as a device name; cuda asked for but not visible is a UserError."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible; use --device cpu")
    return "cuda" if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()) else "cpu"


def add_checkpoint_arguments(p: argparse.ArgumentParser, which: str, which_help: str) -> None:
    """--checkpoint and --which, shared by sample, serve and eval; `which` is the default."""
    chosen = "its newest valid checkpoint" if which == "latest" else "its best checkpoint"
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="RUN_DIR|CKPT_DIR",
        help=f"a run dir ({chosen}, see --which) or a checkpoints/step_NNNNNN dir",
    )
    other = "best" if which == "latest" else "latest"
    p.add_argument("--which", choices=(which, other), default=which, help=which_help)


MAX_NEW_TOKENS = 100_000  # a CPU samples a few hundred tokens a second: more would look like a hang


def consolidate(spec: str, path: Path, which: str = "latest", force: bool = False) -> Path:
    """The checkpoint's weights as one safetensors file (the same file `pretrain export` writes as
    final.safetensors)."""
    from app.tools.export import write_final

    path = Path(path)
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


def sample(
    spec: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    num_samples: int = 1,
    seed: int = 0,
    top_p: float = 1.0,
    which: str = "latest",
) -> list[str]:
    if not 0 < max_new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens must be in 1..{MAX_NEW_TOKENS:,}, got {max_new_tokens}")
    if not temperature >= 0:  # NaN too
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = all tokens), got {top_k}")
    if num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {num_samples}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    model, tok, _ = load_for_inference(spec, which=which)
    ids = tok.encode(prompt) or [tok.eot_id]
    g = torch.Generator().manual_seed(seed)  # one stream: the samples differ, and repeat with the seed
    kw = dict(temperature=temperature, top_k=top_k or None, top_p=top_p, generator=g)
    ys = [generate(model, torch.tensor([ids]), max_new_tokens, **kw) for _ in range(num_samples)]
    return [prompt + tok.decode(y[0, len(ids) :].tolist()) for y in ys]


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(
        p,
        "latest",
        "for a run dir: the newest checkpoint, or the one with the lowest val loss (default latest)",
    )
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument(
        "--max-new-tokens", type=int, default=200, metavar="N", help="tokens to generate (default 200)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy (default 0.8)"
    )
    p.add_argument(
        "--top-k", type=int, default=50, help="sample among the k likeliest tokens (default 50; 0 = all)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens with this much probability (default 1.0 = off)",
    )
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="independent samples (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--consolidate",
        metavar="FILE|DIR",
        help="also write the checkpoint's weights as one FILE.safetensors (any other path is a dir that gets "
        "final.safetensors), assembled from the shards of any world size, one tensor at a time",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --consolidate file")


def run(args: argparse.Namespace) -> int:
    if args.consolidate:
        path = consolidate(args.checkpoint, Path(args.consolidate), args.which, args.force)
        print(f"consolidated weights: {path}")
    for text in sample(
        args.checkpoint,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.num_samples,
        args.seed,
        args.top_p,
        args.which,
    ):
        print(text)
        print("-" * 40)
    return 0
