"""The serving engine: one worker thread owns the model and runs requests one at a time, in arrival order.

Why serialised, not batched: requests differ in prompt length, sampling settings and stop strings, and
a KV-cached decode of one sequence already keeps a CPU (or a small GPU model) busy; one owner of the
model also means no two requests ever share a cache or a random generator. The HTTP handlers only queue
jobs and read their events, so slow clients never hold the model.

A job's events go back to the asyncio loop that asked for it: ("text", delta) as text becomes final,
then ("done", finish_reason) or ("error", message).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from app.data.tokenizer import Tokenizer
from app.trainer.generate import generate_stream
from app.trainer.model import GPT


class Busy(Exception):
    """The queue is full: the client should retry later (HTTP 503)."""


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


@dataclass
class Job:
    ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stops: list[str]
    seed: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0
    started: float = 0.0  # monotonic time the worker took the job
    first_token: float = 0.0

    def put(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class ServeMetrics:
    """Prometheus metrics of the server, on its own registry (served at GET /metrics)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pretrain_serve_requests", "Completion requests by HTTP status", ["status"], registry=r
        )
        self.prompt_tokens = Counter("pretrain_serve_prompt_tokens", "Prompt tokens read", registry=r)
        self.completion_tokens = Counter(
            "pretrain_serve_completion_tokens", "Completion tokens generated", registry=r
        )
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.latency = Histogram(
            "pretrain_serve_request_seconds",
            "Completion request latency, queueing included",
            registry=r,
            buckets=buckets,
        )
        self.first_token = Histogram(
            "pretrain_serve_time_to_first_token_seconds",
            "Time from request to the first generated token",
            registry=r,
            buckets=buckets,
        )
        self.queue = Gauge("pretrain_serve_queue_depth", "Requests waiting for the model", registry=r)
        self.tps = Gauge(
            "pretrain_serve_tokens_per_second", "Generation speed of the last finished request", registry=r
        )


class Engine:
    def __init__(self, model: GPT, tok: Tokenizer, metrics: ServeMetrics, max_queue: int = 64) -> None:
        self.model, self.tok, self.metrics = model, tok, metrics
        self.device = model.tok_emb.weight.device
        self.max_queue = max_queue
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="generation", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.jobs.qsize() >= self.max_queue:
            raise Busy(f"{self.jobs.qsize()} requests are already waiting; retry later")
        self.jobs.put(job)
        self.metrics.queue.set(self.jobs.qsize())

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            self.metrics.queue.set(self.jobs.qsize())
            if job is None:
                return
            if job.cancelled.is_set():  # the client went away while waiting
                continue
            try:
                job.put("done", self.generate(job))
            except Exception as e:  # one bad request must not kill the worker
                job.put("error", f"{type(e).__name__}: {e}")

    @torch.inference_mode()
    def generate(self, job: Job) -> str:
        """Run one job to the end; returns its finish reason (length | stop | cancelled)."""
        job.started = time.monotonic()
        text = TextStream(self.tok, job.stops)
        g = torch.Generator(device=self.device).manual_seed(job.seed)
        x = torch.tensor([job.ids], device=self.device)
        stream = generate_stream(
            self.model, x, job.max_tokens, job.temperature, job.top_k or None, job.top_p, generator=g
        )
        reason = "length"
        for nxt in stream:
            token = int(nxt[0, 0])
            job.completion_tokens += 1
            job.first_token = job.first_token or time.monotonic()
            if job.cancelled.is_set():
                reason = "cancelled"
                break
            if token == self.tok.eot_id:  # the model ended the document
                reason = "stop"
                break
            if delta := text.add(token):
                job.put("text", delta)
            if text.stopped:
                reason = "stop"
                break
        if rest := text.finish():
            job.put("text", rest)
        seconds = time.monotonic() - job.started
        if seconds > 0:
            self.metrics.tps.set(job.completion_tokens / seconds)
        return reason
