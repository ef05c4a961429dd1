"""Scoring text with a checkpoint: log-likelihoods of continuations, rolling log-likelihood of documents,
and greedy generation with stop strings. What `pretrain eval` needs, for lm-eval's tasks and for CORE.

Tokenization follows lm-eval's Hugging Face model: the continuation's tokens are those of
`context + continuation` after the context's own tokens (so a BPE merge across the boundary counts for
the continuation), and trailing spaces of the context move to the continuation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from app.data.tokenizer import Tokenizer
from app.tools.generation import TextStream
from app.trainer.model.generate import generate_stream
from app.trainer.model.gpt import GPT


class Scorer:
    def __init__(self, model: GPT, tok: Tokenizer, batch_size: int = 16) -> None:
        self.model, self.tok, self.batch_size = model, tok, batch_size
        self.window = model.cfg.seq_len
        self.device = model.tok_emb.weight.device

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:  # nothing to condition on: the document boundary is the context
            return [self.tok.eot_id], self.tok.encode(continuation)
        whole, ctx = self.tok.encode(context + continuation), self.tok.encode(context)
        return ctx, whole[len(ctx) :]

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per pair.
        The context is cut from the left to fit the window; batched with right padding (causal attention
        never looks right, so padding changes nothing)."""
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            rows = []
            for i in idx:
                ctx, cont = pairs[i][0], pairs[i][1][-self.window :]
                rows.append(((ctx + cont)[-(self.window + 1) : -1], cont))  # input: all but the last token
            x = pad_sequence([torch.tensor(inp, dtype=torch.long) for inp, _ in rows], batch_first=True)
            logp = F.log_softmax(self.model(x.to(self.device)).logits.float(), dim=-1)
            for r, (i, (inp, cont)) in enumerate(zip(idx, rows, strict=True)):
                lp = logp[r, len(inp) - len(cont) : len(inp)]  # positions predicting the continuation
                target = torch.tensor(cont, device=lp.device)
                total = lp.gather(-1, target[:, None]).sum().item()
                out[i] = (total, bool((lp.argmax(-1) == target).all()))
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(c, x) for c, x in requests])

    @torch.no_grad()
    def rolling(self, text: str) -> float:
        """log p(text) over disjoint windows, the first conditioned on the document boundary token."""
        ids = self.tok.encode(text)
        padded = [self.tok.eot_id, *ids]
        # a window's context is the token before it; its own tokens are context for each other (score())
        pairs = [([padded[i]], ids[i : i + self.window]) for i in range(0, len(ids), self.window)]
        return sum(lp for lp, _ in self.score(pairs))

    @torch.no_grad()
    def generate(self, context: str, until: str | list[str] | None, max_tokens: int) -> str:
        """Greedy continuation up to max_tokens, cut at the first stop string or the boundary token."""
        max_tokens = max(1, min(max_tokens, self.window - 1))
        ids = (self.tok.encode(context) or [self.tok.eot_id])[-(self.window - max_tokens) :]
        text = TextStream(self.tok, [until] if isinstance(until, str) else list(until or []))
        x = torch.tensor([ids], device=self.device)
        for nxt in generate_stream(self.model, x, max_tokens, temperature=0):
            token = int(nxt[0, 0])
            if token == self.tok.eot_id:
                break
            text.add(token)
            if text.stopped:
                break
        return text.text
