"""Generate text from a checkpoint: the config and tokenizer travel inside the checkpoint dir."""

from __future__ import annotations

import argparse

import torch

from app.config import config_from_dict
from app.data.tokenizer import load_tokenizer
from app.errors import UserError
from app.trainer import checkpoint as ckpt
from app.trainer.model import build_model


def load_for_inference(spec: str, device: str = "cpu"):
    """(model in eval mode, tokenizer, checkpoint info) from a run dir or step dir."""
    info = ckpt.resolve(spec, mode="size", warn=lambda m: print(m))
    cfg = config_from_dict(info.meta["config"])
    model = build_model(cfg.model, device)
    state = ckpt.load_model_state(info)
    ckpt.check_compatible(model, state, info.path)
    model.load_state_dict(state)
    model.eval()
    return model, load_tokenizer(info.path), info


def sample(
    spec: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    num_samples: int = 1,
    seed: int = 0,
) -> list[str]:
    if max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be > 0, got {max_new_tokens}")
    if not temperature >= 0:  # NaN too
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = all tokens), got {top_k}")
    if num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {num_samples}")
    model, tok, _ = load_for_inference(spec)
    ids = tok.encode(prompt) or [tok.eot_id]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_samples):
        x = torch.tensor([ids])
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None, generator=g)
        out.append(prompt + tok.decode(y[0, len(ids) :].tolist()))
    return out


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="RUN_DIR|CKPT_DIR",
        help="a run dir (its newest valid checkpoint) or a checkpoints/step_NNNNNN dir",
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
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="independent samples (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


def run(args: argparse.Namespace) -> int:
    for text in sample(
        args.checkpoint,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.num_samples,
        args.seed,
    ):
        print(text)
        print("-" * 40)
    return 0
