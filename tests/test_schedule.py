"""LR schedules, weight-decay groups, and the budget-driven WSD decay end to end."""

from __future__ import annotations

import math

import pytest

from app.config import OptimConfig, ScheduleConfig
from app.trainer.model import build_model
from app.trainer.optim import param_groups
from app.trainer.schedule import DecayPlan, budget_decay_steps, lr_at
from tests.conftest import FAST, pretrain, train_rows

OPT = OptimConfig(lr=1.0, min_lr=0.1)


def test_warmup_then_cosine_to_min_lr():
    s = ScheduleConfig(name="cosine", warmup_steps=10)
    assert lr_at(0, s, OPT, 110) == pytest.approx(0.1)
    assert lr_at(9, s, OPT, 110) == pytest.approx(1.0)
    assert lr_at(60, s, OPT, 110) == pytest.approx(0.55)  # half way: (peak + floor) / 2
    assert lr_at(110, s, OPT, 110) == pytest.approx(0.1)
    lrs = [lr_at(i, s, OPT, 110) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    s = ScheduleConfig(name="wsd", warmup_steps=0, decay_fraction=0.2)
    assert [lr_at(i, s, OPT, 100) for i in (0, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_at(89, s, OPT, 100) == pytest.approx(0.55)
    assert lr_at(99, s, OPT, 100) == pytest.approx(0.1)
    # A budget-driven decay replaces the fixed one.
    plan = DecayPlan(start_step=30, steps=10)
    assert lr_at(29, s, OPT, 100, plan) == 1.0
    assert lr_at(39, s, OPT, 100, plan) == pytest.approx(0.1)
    assert lr_at(80, s, OPT, 100, plan) == pytest.approx(0.1)


def test_budget_decay_starts_when_the_remaining_budget_is_the_decay_fraction_of_the_run():
    # 100 steps done at 1 s/step; with f = 0.2 the decay should be the last 25 steps (20% of 125).
    assert (
        budget_decay_steps(100, seconds_to_cap=26, step_seconds=1, reserve_seconds=0, decay_fraction=0.2) == 0
    )
    assert (
        budget_decay_steps(100, seconds_to_cap=25, step_seconds=1, reserve_seconds=0, decay_fraction=0.2)
        == 25
    )
    assert (
        budget_decay_steps(100, seconds_to_cap=30, step_seconds=1, reserve_seconds=5, decay_fraction=0.2)
        == 25
    )
    assert budget_decay_steps(0, 10, 1, 0, 0.2) == 0  # nothing measured yet


def test_no_weight_decay_on_norms_and_embeddings():
    from app.config import ModelConfig, OptimConfig

    model = build_model(ModelConfig(vocab_size=64, seq_len=8, n_layer=1, d_model=16, n_head=2))
    groups = param_groups(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = [p for g in groups if g["weight_decay"] == 0.0 for p in g["params"]]
    decay = [p for g in groups if g["weight_decay"] == 0.1 for p in g["params"]]
    assert {names[id(p)] for p in no_decay} == {
        "tok_emb.weight",
        "blocks.0.attn_norm.weight",
        "blocks.0.mlp_norm.weight",
        "norm.weight",
    }
    assert len(decay) + len(no_decay) == len(names)
    assert all(p.dim() == 2 for p in decay)


@pytest.mark.slow  # over 10 s: `make test-slow`, which CI runs too
def test_budget_drives_the_wsd_decay_and_ends_annealed_inside_the_cap(tmp_path):
    """A $0.02 cap at $3.60/GPU-hour (about 20 s of training): the watcher's projection starts the LR
    decay before the graceful stop, so the last checkpoint is annealed, and the spend stays under the cap."""
    run = tmp_path / "run"
    proc = pretrain(
        "train",
        "--out",
        str(run),
        *FAST,
        "--max-steps",
        "1000000",
        "--budget-cap-usd",
        "0.02",
        "--price-per-gpu-hour",
        "3.6",
        "--gpus",
        "1",
        "--set",
        "schedule.name=wsd",
        "--set",
        "schedule.warmup_steps=5",
        "--set",
        "budget.decay_fraction=0.3",
        "--set",
        "budget.poll_seconds=0.5",
        "--set",
        "budget.margin_seconds=1",
        "--set",
        "optim.lr=0.002",
        "--set",
        "optim.min_lr=0.0002",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "budget: starting the LR decay now" in proc.stdout
    rows = train_rows(run)
    lrs = [r["lr"] for r in rows]
    assert max(lrs) == pytest.approx(0.002)
    assert lrs[-1] < 0.002 * 0.6  # well into the decay when the budget stopped the run
    assert all(
        a >= b for a, b in zip(lrs[lrs.index(max(lrs)) + 1 :], lrs[lrs.index(max(lrs)) + 2 :], strict=False)
    )
    import json

    state = json.loads((run / "budget" / "state.json").read_text())
    assert state["spent_usd"] <= 0.02
    assert not math.isnan(rows[-1]["loss"])
