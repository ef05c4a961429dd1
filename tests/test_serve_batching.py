"""Continuous batching: sequences decoded together in one KV cache (app/trainer/generate.SlotCache), and
the serving engine on top of it, give each request the tokens it would get alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.trainer.model.generate import SlotCache, generate
from tests.test_generate import CASES, model_for


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_batch_with_late_joiners_decodes_each_sequence_as_alone(case):
    """Prompts of different lengths in slots 0, 2, 3 and 5; two join after three steps of the others,
    so each row sits at its own position; greedy tokens equal generate() on each prompt alone."""
    torch.manual_seed(0)
    model = model_for(**CASES[case])
    prompts = [[1, 2, 3], [9] * 11, [4, 5, 6, 7, 8, 200], [17]]
    steps = 12
    want = [generate(model, torch.tensor([p]), steps, temperature=0)[0, len(p) :].tolist() for p in prompts]
    cache = SlotCache(model, 6)
    last, active = torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.bool)
    got: dict[int, list[int]] = {}
    joins = {0: [(0, prompts[0]), (3, prompts[2])], 3: [(2, prompts[1]), (5, prompts[3])]}
    with torch.inference_mode():
        for t in range(steps + 3):
            for slot, p in joins.get(t, []):
                got[slot] = [int(cache.prefill(slot, p).argmax())]
                last[slot], active[slot] = got[slot][0], True
            logits = cache.step(last, active)
            for slot in got:
                if len(got[slot]) < steps:
                    got[slot].append(int(logits[slot].argmax()))
                    last[slot] = got[slot][-1]
    assert [got[0], got[2], got[3], got[5]] == [want[0], want[1], want[2], want[3]]


def run_jobs(engine, prompts, **kw):
    """Submit every prompt at once (they share the batch); each job's text and finish reason."""
    from app.tools.generation import Job

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(ids=p, stops=[], loop=loop, **kw) for p in prompts]
        engine.submit(jobs)
        out = []
        for job in jobs:
            parts = []
            while (event := await job.events.get())[0] == "text":
                parts.append(event[1])
            out.append(("".join(parts), event[1]))
        return out

    return asyncio.run(main())


@pytest.fixture(scope="module")
def checkpoint():
    from app.tools.sample import load_for_inference
    from tests.inference_helpers import trained_run

    return load_for_inference(str(trained_run()), which="best")[:2]


def test_the_engine_batches_requests_and_each_gets_its_own_greedy_text(checkpoint):
    from app.tools.generation import Engine, ServeMetrics

    model, tok = checkpoint
    prompts = [
        tok.encode(p) for p in ("ROMEO:\n", "JULIET: O Romeo, Romeo", "KING", "First Citizen:\nBefore")
    ]
    engine = Engine(model, tok, ServeMetrics(), max_batch=3)  # fewer slots than requests: one waits
    try:
        got = run_jobs(engine, prompts * 2, max_tokens=12, temperature=0, top_k=0, top_p=1.0, seed=0)
    finally:
        engine.close()
    for ids, (text, reason) in zip(prompts * 2, got, strict=True):
        out = generate(model, torch.tensor([ids]), 12, temperature=0)[0, len(ids) :].tolist()
        out = out[: out.index(tok.eot_id)] if tok.eot_id in out else out
        assert text == tok.decode(out) and reason in ("length", "stop")


def test_cancel_all_ends_queued_and_running_requests(checkpoint):
    from app.tools.generation import Engine, ServeMetrics

    model, tok = checkpoint
    engine = Engine(model, tok, ServeMetrics(), max_batch=1)
    try:
        engine.cancel_all()  # as the drain does once the grace period is over
        got = run_jobs(
            engine, [tok.encode("ROMEO:")] * 3, max_tokens=40, temperature=0, top_k=0, top_p=1.0, seed=0
        )
    finally:
        engine.close()
    assert [reason for _, reason in got] == ["cancelled"] * 3
