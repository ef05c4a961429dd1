"""lm-eval's own API client (`local-completions`) against `pretrain serve` with an API key (lm-eval sends
$OPENAI_API_KEY): multiple-choice tasks (local task YAMLs over local jsonl files) scored through
/v1/completions (token ids, `echo`, `logprobs`) give, per choice, the log-likelihoods that `pretrain eval`
computes in-process, and the known accuracies."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.test_eval import known, offline_mc_tasks  # noqa: F401 (known: the fixture)
from tests.test_serve import start_server, stop_server

pytest.importorskip("lm_eval", reason="the eval tests need the eval extra (make setup)")
# lm-eval's API models count a continuation's tokens with a Hugging Face tokenizer of their own
pytest.importorskip("transformers", reason="lm-eval's API models need transformers (the eval extra)")


def per_choice(res: dict, task: str) -> list[list[float]]:
    """Each document's log-likelihood per choice, in document order (lm-eval's logged samples)."""
    docs = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in docs]


@pytest.mark.slow  # a server, lm-eval twice (~30 s on 2 cores)
def test_lm_eval_local_completions_through_pretrain_serve(known, tmp_path, monkeypatch):  # noqa: F811
    import lm_eval
    from lm_eval.tasks import TaskManager

    from app.tools.eval import make_lm
    from app.tools.sample import load_for_inference
    from app.tools.scoring import Scorer

    run, items = known
    tasks = offline_mc_tasks(tmp_path, items, monkeypatch)
    model, tok, info = load_for_inference(str(run), which="best")
    hf_tokenizer = tmp_path / "tokenizer"  # our tokenizer.json, as transformers loads it
    hf_tokenizer.mkdir()
    shutil.copy(info.path / "tokenizer.json", hf_tokenizer)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (hf_tokenizer / "tokenizer_config.json").write_text(json.dumps(config))

    def evaluate(lm, model_args=None) -> dict:
        return lm_eval.simple_evaluate(
            model=lm,
            model_args=model_args,
            tasks=["greedy_mc", "decoy_mc"],
            task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )

    key = "sk-eval-key"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    url, proc = start_server(
        "--checkpoint", str(info.path), "--model-name", "tiny", env={"PRETRAIN_API_KEY": key}
    )
    try:
        served = evaluate(
            "local-completions",
            {
                "model": "tiny",
                "base_url": f"{url}/v1/completions",
                "tokenizer": str(hf_tokenizer),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "max_length": model.cfg.seq_len,
                "max_retries": 1,
            },
        )
    finally:
        stop_server(proc)
    assert served["results"]["greedy_mc"]["acc,none"] == 1.0  # the model's own greedy continuation
    assert served["results"]["decoy_mc"]["acc,none"] == 0.0  # never a random-token decoy
    local = evaluate(make_lm(Scorer(model, tok)))
    for task in ("greedy_mc", "decoy_mc"):
        got, want = per_choice(served, task), per_choice(local, task)
        assert len(got) == len(items) and all(len(g) == 4 for g in got)
        assert got == [pytest.approx(w, abs=1e-4) for w in want]
