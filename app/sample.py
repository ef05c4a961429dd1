"""Generate text from a checkpoint: the config and tokenizer travel inside the checkpoint dir."""

from __future__ import annotations

import torch

from app import checkpoint as ckpt
from app.config import config_from_dict
from app.data.tokenizer import load_tokenizer
from app.errors import UserError
from app.model import build_model


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
    model, tok, _ = load_for_inference(spec)
    ids = tok.encode(prompt) or [tok.eot_id]
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_samples):
        x = torch.tensor([ids])
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None, generator=g)
        out.append(prompt + tok.decode(y[0, len(ids) :].tolist()))
    return out
