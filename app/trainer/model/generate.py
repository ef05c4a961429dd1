"""Generation from a GPT: a KV cache, one-token decode steps, sampling, streaming.

Kept out of model.py so the model reads as training sees it; the model's only hook is the optional `kv`
argument of its attention, through which a step stores and reads the keys and values of earlier positions
and gets the mask to attend with. Every step runs the blocks through GPT.run_block, as training does, so
whatever the model switches feed a block (value embeddings, the embedding, U-net skips) is there at every
decoded position.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from app.trainer.model.gpt import GPT


class LayerKV:
    """One attention call's keys and values for the positions seen so far (preallocated to the window)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v  # (batch, kv heads, window, head dim)
        self.n = 0  # positions filled

    def append(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store the new positions; all keys and values so far, and the mask for the new queries."""
        t = k.size(2)
        self.k[:, :, self.n : self.n + t] = k
        self.v[:, :, self.n : self.n + t] = v
        self.n += t
        # Query i sits at position (n - t + i) and sees keys up to there: nothing to mask for one new
        # token, the usual causal mask (is_causal, no tensor) for a first chunk, an offset triangle after it.
        mask = (
            None
            if t in (1, self.n)
            else torch.ones(t, self.n, dtype=torch.bool, device=k.device).tril(self.n - t)
        )
        return self.k[:, :, : self.n], self.v[:, :, : self.n], mask


class RowKV:
    """One layer of the server's continuous batch for one step: row r writes its new key and value at its
    own position pos[r] and attends to its own first pos[r] + 1 positions only."""

    def __init__(self, layer: LayerKV, pos: torch.Tensor, mask: torch.Tensor) -> None:
        self.layer, self.pos, self.mask = layer, pos, mask

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = k.size(0)
        rows = torch.arange(n, device=k.device)
        self.layer.k[rows, :, self.pos] = k[:, :, 0]
        self.layer.v[rows, :, self.pos] = v[:, :, 0]
        return self.layer.k[:n], self.layer.v[:n], self.mask


def new_cache(model: GPT, batch: int) -> list[LayerKV]:
    """An empty KV cache: one LayerKV per block run (a recurrent block sees new inputs each loop)."""
    cfg, w = model.cfg, model.tok_emb.weight
    shape = (batch, cfg.kv_heads, cfg.seq_len, cfg.d_model // cfg.n_head)
    return [LayerKV(w.new_zeros(shape), w.new_zeros(shape)) for _ in model.run_order()]


def run_cached(
    model: GPT, idx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list
) -> torch.Tensor:
    """The last hidden states of `idx` at the positions cos/sin give, each block run reading and extending
    its layer of `cache`."""
    h, stream = model.embed(idx)
    for i, kv in zip(model.run_order(), cache, strict=True):
        h = model.run_block(i, h, cos, sin, stream, kv)
    return h


def decode(model: GPT, idx: torch.Tensor, cache: list[LayerKV], every: bool = False) -> torch.Tensor:
    """Logits (B, vocab) of the token after `idx`, given the positions already in `cache`: the same
    read-out as model(idx, last_only=True) on the whole sequence, at the cost of `idx` alone.
    every=True: the logits after each position of `idx`, (B, T, vocab)."""
    pos, t = cache[0].n, idx.size(1)
    h = run_cached(model, idx, model.rope_cos[pos : pos + t], model.rope_sin[pos : pos + t], cache)
    return model.logits(h) if every else model.logits(h[:, -1:])[:, -1]


class SlotCache:
    """The KV cache of up to `slots` sequences decoded together, each at its own length (the server's
    continuous batch). A prompt is encoded alone into its slot (the same pass as generate_stream's);
    then one step decodes one token for every slot below the highest in use, each row attending to its
    own positions only (a padding mask), at its own RoPE position."""

    def __init__(self, model: GPT, slots: int) -> None:
        self.model, self.layers = model, new_cache(model, slots)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=model.tok_emb.weight.device)

    def prefill(self, slot: int, ids: list[int], every: bool = False) -> torch.Tensor:
        """Encode a prompt into `slot`; the logits after its last token (1, vocab), or after each."""
        # a batch-1 cache whose tensors are this slot's rows
        views = [LayerKV(layer.k[slot : slot + 1], layer.v[slot : slot + 1]) for layer in self.layers]
        self.lengths[slot] = len(ids)
        return decode(self.model, torch.tensor([ids], device=self.lengths.device), views, every)

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def step(self, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """tokens (n,): the last token of slots 0..n-1; active (n,) bool. Logits (n, vocab)."""
        model, n = self.model, tokens.size(0)
        pos = self.lengths[:n]
        # one position per row: (n, 1, 1, head_dim / 2) broadcasts over the heads of (n, heads, 1, head_dim)
        cos, sin = model.rope_cos[pos][:, None, None], model.rope_sin[pos][:, None, None]
        window = self.layers[0].k.size(2)
        mask = (torch.arange(window, device=pos.device) <= pos[:, None])[:, None, None]
        rows = [RowKV(layer, pos, mask) for layer in self.layers]
        h = run_cached(model, tokens[:, None], cos, sin, rows)
        self.lengths[:n] += active
        return model.logits(h)[:, -1]


@torch.no_grad()
def generate_stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield the sampled tokens (B, 1), one step at a time, for streaming.

    With the KV cache a step runs the model on one new token. The window is cfg.seq_len positions (the
    RoPE table); when it is full the context slides by a quarter window: the newest 3/4 are re-encoded in
    one pass and decoding goes on. Without the cache every step re-reads the whole (cropped) context;
    inside the window both give the same tokens.
    """
    window = model.cfg.seq_len
    cache: list[LayerKV] | None = None
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model(idx[:, -window:], last_only=True).logits[:, -1]
        elif cache is None or cache[0].n == window:
            keep = window if cache is None else window - window // 4
            cache = new_cache(model, idx.size(0))
            logits = decode(model, idx[:, -keep:], cache)
        else:
            logits = decode(model, idx[:, -1:], cache)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        idx = torch.cat([idx, nxt], dim=1)
        yield nxt


@torch.no_grad()
def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
    """idx (B, T) followed by max_new_tokens sampled tokens; `sampling` as in generate_stream."""
    new = list(generate_stream(model, idx, max_new_tokens, **sampling))
    return torch.cat([idx, *new], dim=1)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from logits (B, vocab): greedy at temperature 0, else softmax(logits / T) over
    the top_k likeliest tokens (0 or None: all) within the smallest set whose probability reaches top_p."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # tokens after the nucleus (the first always stays)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
