"""The serving engine: one worker thread owns the model and decodes the requests in flight together.

Continuous batching (docs/serving.md): a request joins as soon as a KV-cache slot is free and leaves when
it ends; each keeps its own sampling settings, stop strings and seeded generator, so its tokens are those
it would get alone. The HTTP handlers only queue jobs and read their events: slow clients never hold the model.

A job's events go back to the asyncio loop that asked for it: ("text", delta, logprob entries) (first the
prompt's text when it is echoed, then the completion's), then ("done", finish_reason) or ("error", message).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from app.data.tokenizer import Tokenizer
from app.tools.serve_api import RequestError
from app.trainer.model.generate import SlotCache, sample_next
from app.trainer.model.gpt import GPT


class TextStream:
    """Incremental detokenisation with stop strings.

    Text is released once it is complete UTF-8 (a byte-level BPE token can end inside a character) and
    cannot be the beginning of a stop string, so a streamed response never shows part of a stop string
    and the concatenated deltas always equal the final text.
    """

    def __init__(self, tok: Tokenizer, stops: list[str]) -> None:
        self.tok, self.stops = tok, [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text already released
        self.stopped = False

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = text[: max(min(hits), self.sent)]
            return self._release(len(self.text))
        self.text = text
        safe = len(text.rstrip("\ufffd"))  # an unfinished UTF-8 sequence decodes as U+FFFD for now
        for s in self.stops:  # hold back a tail that may grow into a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - k : safe] == s[:k]:
                    safe -= k
                    break
        return self._release(safe)

    def finish(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out


@dataclass(eq=False)
class Job:
    ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stops: list[str]
    seed: int
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None  # top-k logprobs per token (None: none)
    echo: bool = False  # the prompt's text (and logprobs) first
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0
    started: float = 0.0  # monotonic time the worker took the job
    first_token: float = 0.0
    text: TextStream | None = None  # decoding state (the worker's): the text so far,
    generator: torch.Generator | None = None  # the seeded sampling stream,
    last: int = 0  # the token to decode next

    def put(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class ServeMetrics:
    """Prometheus metrics of the server, on its own registry (served at GET /metrics)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        status = "API requests by HTTP status (499: the client hung up before the end)"
        self.requests = Counter("pretrain_serve_requests", status, ["status"], registry=r)
        why = "Requests turned away by reason: queue_full, shutting_down (503), missing/invalid_api_key (401)"
        self.rejected = Counter("pretrain_serve_rejected", why, ["reason"], registry=r)
        reasons = ("queue_full", "shutting_down", "missing_api_key", "invalid_api_key")
        for reason in reasons:  # series at 0 from the start, for panels and alerts
            self.rejected.labels(reason=reason)
        self.prompt_tokens = Counter("pretrain_serve_prompt_tokens", "Prompt tokens read", registry=r)
        self.completion_tokens = Counter("pretrain_serve_completion_tokens", "Tokens generated", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        seconds = partial(Histogram, registry=r, buckets=buckets)
        self.latency = seconds("pretrain_serve_request_seconds", "Request latency, queueing included")
        self.first_token = seconds("pretrain_serve_time_to_first_token_seconds", "Request to first token")
        self.in_flight = Gauge("pretrain_serve_requests_in_flight", "API requests being answered", registry=r)
        self.queue = Gauge("pretrain_serve_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.tps = Gauge("pretrain_serve_tokens_per_second", "Speed of the last finished request", registry=r)


class Engine:
    def __init__(
        self, model: GPT, tok: Tokenizer, metrics: ServeMetrics, max_queue: int = 64, max_batch: int = 16
    ) -> None:
        self.model, self.tok, self.metrics = model, tok, metrics
        self.device = model.tok_emb.weight.device
        self.max_queue, self.max_batch = max_queue, max_batch
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.active: set[Job] = set()  # submitted and not done (for a graceful shutdown)
        self.stopping = False  # the grace period is over: requests end as they come
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="generation", daemon=True)
        self.thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs, all or none: with the queue full, a 503 the client retries."""
        if self.jobs.qsize() + len(jobs) > self.max_queue:
            self.metrics.rejected.labels(reason="queue_full").inc()
            msg = f"{self.jobs.qsize()} requests are already waiting; retry later"
            raise RequestError(None, msg, 503, "queue_full")
        with self.lock:
            self.active.update(jobs)
            for job in jobs if self.stopping else []:
                job.cancelled.set()
        for job in jobs:
            self.jobs.put(job)
        self.metrics.queue.set(self.jobs.qsize())

    def cancel_all(self) -> None:
        """End every request now (finish_reason "cancelled"): the shutdown's grace period is over."""
        with self.lock:
            self.stopping = True
            for job in self.active:
                job.cancelled.set()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _end(self, job: Job, *event, slot: int | None = None) -> None:
        """Send a job's last event; free its batch slot, if it has one."""
        if slot is not None:
            self.batch.pop(slot, None)
            self.cache.free(slot)
        with self.lock:
            self.active.discard(job)
        job.put(*event)

    @torch.inference_mode()
    def _loop(self) -> None:
        self.cache = cache = SlotCache(self.model, self.max_batch)
        self.batch = batch = {}  # slot: the job decoded there
        while True:
            while len(batch) < self.max_batch:  # fill free slots; wait only when there is nothing to do
                try:
                    job = self.jobs.get(block=not batch)
                except queue.Empty:
                    break
                if job is None:
                    return
                if job.cancelled.is_set():  # the client went away while waiting, or shutdown
                    self._end(job, "done", "cancelled")
                    continue
                slot = min(set(range(self.max_batch)) - batch.keys())
                try:
                    self._start(job, slot)
                except Exception as e:  # one bad request must not kill the worker
                    self._end(job, "error", f"{type(e).__name__}: {e}", slot=slot)
            self.metrics.queue.set(self.jobs.qsize())
            if not batch:
                continue
            n = max(batch) + 1
            tokens = torch.tensor([batch[s].last if s in batch else 0 for s in range(n)], device=self.device)
            active = torch.tensor([s in batch for s in range(n)], device=self.device)
            try:
                logits = cache.step(tokens, active)
            except Exception as e:
                for slot in list(batch):
                    self._end(batch[slot], "error", f"{type(e).__name__}: {e}", slot=slot)
                continue
            for slot in list(batch):
                self._advance(slot, logits[slot])

    def _start(self, job: Job, slot: int) -> None:
        job.started = time.monotonic()
        entries, every = [], job.echo and job.logprobs is not None
        logits = self.cache.prefill(slot, job.ids, every=every)
        if every:  # the first token has no logprob (nothing before it)
            lp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            entries = [(self.tok.decode(job.ids[:1]), None, None)]
            entries += [self.entry(row, tok, job.logprobs) for row, tok in zip(lp, job.ids[1:], strict=True)]
            logits = logits[:, -1]
        if job.echo:
            job.put("text", self.tok.decode(job.ids), entries)
        job.generator = torch.Generator(device=self.device).manual_seed(job.seed)
        job.text = TextStream(self.tok, job.stops)
        self.batch[slot] = job
        self._advance(slot, logits[0])

    def _advance(self, slot: int, logits: torch.Tensor) -> None:
        """Sample the next token of the request in `slot` from its logits (vocab,), or end it."""
        job, reason = self.batch[slot], None
        if job.cancelled.is_set():
            reason = "cancelled"
        elif job.completion_tokens < job.max_tokens:
            token = int(sample_next(logits[None], job.temperature, job.top_k, job.top_p, job.generator))
            job.completion_tokens += 1
            job.first_token = job.first_token or time.monotonic()
            if token == self.tok.eot_id:  # the model ended the document
                reason = "stop"
            else:
                delta, entries = job.text.add(token), []
                if job.logprobs is not None:
                    entries = [self.entry(torch.log_softmax(logits.float(), dim=-1), token, job.logprobs)]
                if delta or entries:
                    job.put("text", delta, entries)
                reason = "stop" if job.text.stopped else None
                job.last = token
        if reason is None and job.completion_tokens >= job.max_tokens:
            reason = "length"
        if reason is None:
            return
        if rest := job.text.finish():
            job.put("text", rest, [])
        seconds = time.monotonic() - job.started
        if job.completion_tokens and seconds > 0:
            self.metrics.tps.set(job.completion_tokens / seconds)
        self._end(job, "done", reason, slot=slot)

    def entry(self, logprobs: torch.Tensor, token: int, k: int) -> tuple[str, float, dict[str, float]]:
        """OpenAI's logprobs of one token: (its text, its logprob, the top k and itself by text)."""
        top = logprobs.topk(k)
        best = {self.tok.decode([int(i)]): float(v) for v, i in zip(top.values, top.indices, strict=True)}
        text, chosen = self.tok.decode([token]), float(logprobs[token])
        return text, chosen, {**best, text: chosen}
