"""Training recipes: the deep-supervision objective against a hand-computed case, its logged terms, the
two-phase looped presets, `pretrain plan --preset` (without torch) and `pretrain train --gpu-type`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from app.cli import main as cli_main
from app.config import LoopConfig, ModelConfig, load_config
from app.trainer.model.gpt import build_model, count_parameters
from app.trainer.model.supervision import loop_weights, monotone, objective, refinement
from app.trainer.parallel import layout, memory
from tests.conftest import FAST, REPO, cli_env, pretrain, train_rows

# ---------------------------------------------------------------- the formula, by hand


def test_objective_matches_the_hand_computed_case():
    # L = (2.0, 1.5, 1.2), base 2: w = (1, 2, 4) / 7
    #   S = (2.0 + 3.0 + 4.8) / 7 = 1.4
    #   I = ((1 - 1.5/2.0) + (1 - 1.2/1.5)) / 2 = (0.25 + 0.2) / 2 = 0.225
    #   loss = S - 1.0 * I = 1.175
    lp = LoopConfig(recurrence=3, supervision_weight_base=2.0, improvement_reward_scale=1.0)
    w = loop_weights(lp, 3)
    assert w == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    losses = torch.tensor([2.0, 1.5, 1.2], dtype=torch.float64, requires_grad=True)
    t = objective(list(losses), w, 1.0)
    assert float(t.supervision.detach()) == pytest.approx(1.4)
    assert float(t.improvement.detach()) == pytest.approx(0.225)
    assert float(t.total.detach()) == pytest.approx(1.175)
    # the previous read-out is a fixed bar (no gradient through the denominator):
    #   dloss/dL0 = 1/7; dL1 = 2/7 + 1/2 * 1/2.0; dL2 = 4/7 + 1/2 * 1/1.5   (extra pull on later loops)
    t.total.backward()
    assert losses.grad.tolist() == pytest.approx([1 / 7, 2 / 7 + 0.25, 4 / 7 + 1 / 3])
    # floats give the same numbers (the report logs with them)
    f = objective([2.0, 1.5, 1.2], w, 1.0)
    assert (f.total, f.supervision, f.improvement) == pytest.approx((1.175, 1.4, 0.225))
    assert refinement([2.0, 1.5, 1.2]) == pytest.approx(0.4)
    assert monotone([2.0, 1.5, 1.2]) and not monotone([2.0, 2.1, 1.2]) and not monotone([2.0, 2.0, 1.9])


def test_explicit_loss_weights_override_the_base_and_base_one_is_equal():
    assert loop_weights(LoopConfig(loss_weights=[1, 1, 2], supervision_weight_base=10.0), 3) == [
        0.25,
        0.25,
        0.5,
    ]
    assert loop_weights(LoopConfig(), 4) == [0.25] * 4
    assert loop_weights(LoopConfig(supervision_weight_base=5.0), 4) == pytest.approx(
        [1 / 156, 5 / 156, 25 / 156, 125 / 156]
    )


def looped(**loop) -> ModelConfig:
    cfg = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_head=4)
    cfg.loop = LoopConfig(prelude=1, recurrent=1, coda=1, recurrence=3, deep_supervision=True, **loop)
    return cfg


def test_the_model_trains_on_the_formula_and_evaluates_the_last_read_out():
    torch.manual_seed(0)
    model = build_model(looped(supervision_weight_base=3.0, improvement_reward_scale=0.5))
    x = torch.randint(0, 64, (2, 16))
    out = model(x, x)
    L = [float(v) for v in out.loop_losses]
    w = [1 / 13, 3 / 13, 9 / 13]
    improvement = ((1 - L[1] / L[0]) + (1 - L[2] / L[1])) / 2
    assert float(out.loss.detach()) == pytest.approx(
        sum(wi * li for wi, li in zip(w, L, strict=True)) - 0.5 * improvement
    )
    model.eval()
    ev = model(x, x)
    assert float(ev.loss.detach()) == pytest.approx(
        L[-1]
    )  # val loss is the prediction's loss, not the objective


def test_a_looped_run_logs_each_term(tmp_path):
    run = tmp_path / "run"
    loop = [
        "model.loop.prelude=1",
        "model.loop.recurrent=1",
        "model.loop.coda=1",
        "model.loop.recurrence=3",
        "model.loop.deep_supervision=true",
        "model.loop.supervision_weight_base=5",
        "model.loop.improvement_reward_scale=1",
    ]
    sets = [a for s in loop for a in ("--set", s)]
    proc = pretrain("train", "--out", str(run), "--max-steps", "3", *FAST, *sets)
    assert proc.returncode == 0, proc.stderr
    row = train_rows(run)[-1]
    L = row["loop_losses"]
    w = [1 / 31, 5 / 31, 25 / 31]
    s = sum(wi * li for wi, li in zip(w, L, strict=True))
    i = ((1 - L[1] / L[0]) + (1 - L[2] / L[1])) / 2
    assert row["supervision_loss"] == pytest.approx(s, rel=1e-6)
    assert row["improvement_reward"] == pytest.approx(i, rel=1e-6, abs=1e-9)
    assert row["loss"] == pytest.approx(s - i, rel=1e-5)  # the objective trained on
    assert row["refinement"] == pytest.approx((L[0] - L[2]) / L[0])
    assert row["loop_monotone"] == (L[0] > L[1] > L[2])


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("model.loop.supervision_weight_base", "0", "supervision_weight_base must be > 0"),
        ("model.loop.improvement_reward_scale", "-1", "improvement_reward_scale must be >= 0"),
        ("optim.name", "sgd", "optim.name='sgd' is not valid"),
        ("optim.matrix_lr", "-0.1", "optim.matrix_lr must be >= 0"),
    ],
)
def test_bad_recipe_keys_are_one_line_errors(capsys, key, value, needle):
    assert cli_main(["train", "--set", f"{key}={value}", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and needle in err


# ---------------------------------------------------------------- presets


def test_the_two_phase_presets_carry_the_reference_recipes():
    base = load_config("looped-546m")
    fast, extreme = load_config("looped-546m-fast"), load_config("looped-546m-extreme")
    total = count_parameters(base.model).total
    for cfg in (fast, extreme):
        assert count_parameters(cfg.model).total == total == 546_501_888
        assert cfg.model.effective_depth == 15 and cfg.model.loop.loss_weights == []
        assert cfg.optim.name == "muon" and cfg.train.batch_tokens == 1_048_576
    got = [
        (
            c.model.loop.supervision_weight_base,
            c.model.loop.improvement_reward_scale,
            c.optim.matrix_lr,
            c.optim.embedding_lr,
            c.train.max_steps,
        )
        for c in (fast, extreme)
    ]
    assert got == [(5.0, 1.0, 1e-3, 1e-2, 1000), (10.0, 2.0, 5e-4, 5e-3, 6000)]  # phase 2: 5000 after 1000


# ---------------------------------------------------------------- plan and layout


def test_plan_never_imports_torch():
    code = (
        "import sys; from app.cli import main; "
        "rc = main(['plan', '--preset', 'looped-546m-fast']); "
        "rc2 = main(['plan', '--budget-usd', '35', '--gpu', 'h100']); "
        "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH', rc, rc2)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("NO_TORCH 0 0"), proc.stdout[-500:]


def test_plan_table_per_gpu_type_and_count():
    proc = pretrain("plan", "--preset", "looped-546m-fast")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [
        (n, g) for n in ("8", "4") for g in ("b200", "h200", "h100-sxm", "a100-80gb")
    ]
    by = {(r[0], r[1]): r for r in rows}
    # micro x accum covers the preset's global batch: 1,048,576 tokens = 512 sequences of 2048
    for (n, _), r in by.items():
        assert int(r[2]) * int(r[4]) * int(n) == 512
    # half the GPUs take twice as long at the same cost; an A100 is slower than an H100
    h8, h4 = by[("8", "h100-sxm")], by[("4", "h100-sxm")]
    assert float(h4[-3]) == pytest.approx(2 * float(h8[-3]), rel=0.02)
    assert h4[-1] == h8[-1]
    assert float(by[("8", "a100-80gb")][-3]) > float(h8[-3])
    # phase 2 from phase 1's checkpoint: 5000 steps
    ext = pretrain(
        "plan", "--preset", "looped-546m-extreme", "--from-step", "1000", "--gpu", "h100", "--gpus", "8"
    )
    assert "5,000 steps from step 1000" in ext.stdout and "--resume" in ext.stdout
    bad = pretrain("plan")
    assert bad.returncode == 2 and "--preset" in bad.stderr


def test_the_layout_is_the_largest_micro_batch_that_fits():
    cfg = load_config("looped-546m-fast")
    for gpu, gpus in [("h100-sxm", 8), ("b200", 4), ("a100-80gb", 4)]:
        lay = layout.fit(cfg, gpu, gpus)
        device = memory.GPU_MEMORY_GB[gpu] * memory.GB * memory.HEADROOM
        assert lay.fits and lay.micro_batch * lay.accum * gpus * 2048 == cfg.train.batch_tokens
        trial = load_config("looped-546m-fast")
        trial.train.micro_batch_size = lay.micro_batch
        assert memory.estimates(trial, gpus, cuda=True)[lay.mode].total <= device
        trial.train.micro_batch_size = lay.micro_batch * 2  # the next divisor up does not fit
        assert memory.estimates(trial, gpus, cuda=True)[lay.mode].total > device
    # a model that fits nowhere plain gets activation checkpointing, then "does not fit"
    big = load_config("char-d64")
    assert layout.fit(big, "a100-80gb", 8).checkpointing
    assert not layout.fit(big, "a100-80gb", 1).fits


def test_train_gpu_type_picks_the_layout(capsys):
    common = ["train", "--preset", "looped-546m-fast", "--gpus", "4", "--print-config"]
    assert cli_main([*common, "--gpu-type", "h100"]) == 0
    out = capsys.readouterr().out
    assert "# batch layout for --gpu-type: 4 x h100-sxm: micro-batch 16 x accumulation 8" in out
    assert "micro_batch_size: 16\n" in out and "gpu_type: h100" in out
    # an explicit micro-batch wins
    assert cli_main([*common, "--gpu-type", "h100", "--set", "train.micro_batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert "micro_batch_size: 2\n" in out and "batch layout" not in out
    assert cli_main([*common, "--gpu-type", "tpu"]) == 2
    assert "unknown GPU type 'tpu'" in capsys.readouterr().err


def test_muon_memory_estimate_counts_one_moment_for_matrices():
    cfg = load_config("tiny", overrides=["model.vocab_size=512", "optim.name=muon"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    from app.trainer.optimization.optimizer import build_optimizer

    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    x = torch.randint(0, 512, (2, 32))
    model(x, x).loss.backward()
    opt.step()
    state_bytes = sum(v.nbytes for e in opt.state.values() for v in e.values() if v.dim() > 0)
    est = memory.estimate(cfg.model, 2, "ddp", 1, cuda=False, optimizer="muon")
    assert est.optimizer == state_bytes
    assert est.optimizer < memory.estimate(cfg.model, 2, "ddp", 1, cuda=False).optimizer
