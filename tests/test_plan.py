"""The Chinchilla planner: the optimum is an optimum, D ~ 20 N in order of magnitude, loss falls with money."""

from __future__ import annotations

import argparse

import pytest

from app.errors import UserError
from app.tools import plan as P


def test_compute_optimal_spends_the_compute_and_minimises_the_loss():
    for flops in (1e17, 1e19, 1e21, 1e23):
        n, d = P.compute_optimal(flops)
        assert 6 * n * d == pytest.approx(flops, rel=1e-9)
        best = P.CHINCHILLA.loss(n, d)
        for f in (0.5, 0.8, 1.25, 2.0):  # any other split of the same compute is worse
            assert P.CHINCHILLA.loss(n * f, d / f) > best


@pytest.mark.parametrize("budget", [1, 35, 1000, 100_000])
def test_tokens_per_parameter_is_about_twenty(budget):
    p = P.make_plan(budget, "a100-80gb", 8)
    assert 5 < p.tokens_per_param < 100  # Hoffmann's rule of thumb is ~20; this fit drifts up with scale


def test_loss_is_monotone_in_budget_and_params_grow():
    plans = [P.make_plan(b, "h100-sxm", 8) for b in (1, 10, 100, 1000, 10_000, 100_000)]
    losses = [p.loss for p in plans]
    assert losses == sorted(losses, reverse=True) and len(set(losses)) == len(losses)
    assert all(b.params > a.params and b.tokens > a.tokens for a, b in zip(plans, plans[1:], strict=False))
    assert all(p.loss > P.E for p in plans)


def test_hours_and_flops_follow_price_peak_and_mfu():
    p = P.make_plan(35, "a100-80gb", 1)
    assert p.price_per_gpu_hour == 1.79 and p.peak_tflops == 312.0 and p.mfu == P.DEFAULT_MFU
    assert p.hours == pytest.approx(35 / 1.79)
    assert p.flops == pytest.approx(p.hours * 3600 * 312e12 * 0.4)
    q = P.make_plan(35, "a100-80gb", 4, price=1.0, mfu=0.5)
    assert q.hours == pytest.approx(35 / 4) and q.flops == pytest.approx(35 * 3600 * 312e12 * 0.5)
    # the $35 one-day seed run: a ~200M model on ~7B tokens, loss about 3
    assert 1e8 < p.params < 4e8 and 3e9 < p.tokens < 1.5e10 and 2.8 < p.loss < 3.2


def test_gpu_names_are_normalised():
    assert P.make_plan(10, "H100", 1).gpu == "h100-sxm"
    assert P.make_plan(10, "NVIDIA A100-SXM4-40GB", 1).gpu == "a100-40gb"


def test_bad_input_is_a_user_error():
    for kwargs, needle in [
        (dict(budget_usd=0, gpu="h100", gpus=1), "--budget-usd"),
        (dict(budget_usd=10, gpu="h100", gpus=0), "--gpus"),
        (dict(budget_usd=10, gpu="h100", gpus=1, mfu=1.5), "--mfu"),
        (dict(budget_usd=10, gpu="tpu-v5", gpus=1), "unknown GPU type 'tpu-v5'"),
        (dict(budget_usd=10, gpu="tpu-v5", gpus=1, price=1.0), "--peak-tflops"),
    ]:
        with pytest.raises(UserError, match=needle):
            P.make_plan(**kwargs)
    assert P.make_plan(10, "tpu-v5", 1, price=1.0, peak=400).flops > 0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--budget-usd", "35", "--gpus", "100000000000"], "needs at least one minute on every GPU"),
        (["--budget-usd", "1e-300"], "needs at least one minute on every GPU"),
        (["--budget-usd", "35", "--mfu", "1e-9"], "outside what the Chinchilla fit covers"),
        (["--budget-usd", "1e11"], "outside what the Chinchilla fit covers"),
    ],
    ids=["more-gpus-than-a-minute", "budget-under-a-gpu-minute", "compute-below-the-fit", "above-the-fit"],
)
def test_what_cannot_be_planned_is_refused_in_one_line(argv, needle, capsys):
    """A plan of 0.00 hours, or a loss of 2e46 from a budget of 1e-300 dollars, is no plan: exit 2, one line."""
    assert P.main([*argv, "--gpu", "h100-sxm"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert needle in captured.err


def test_a_budget_of_one_gpu_minute_is_planned():
    p = P.make_plan(2.5 / 60 * 8, "h100-sxm", 8, price=2.5)
    assert p.hours * 60 == pytest.approx(1.0) and P.E < p.loss < 10


def test_presets_are_counted_from_the_model():
    counts = P.preset_params()
    assert {"tiny", "x1-50m", "gpt2-124m", "looped-546m", "char-d64"} <= set(counts)
    assert counts["gpt2-124m"] == pytest.approx(124e6, rel=0.02)
    assert counts["looped-546m"] == pytest.approx(546e6, rel=0.02)
    assert P.nearest_preset(130e6, counts)[0] == "gpt2-124m"
    assert P.nearest_preset(1e3, counts)[0] == "tiny"


def test_nearest_is_in_log_space():
    presets = {"small": 1e6, "big": 1e8}
    assert P.nearest_preset(9e6, presets)[0] == "small" and P.nearest_preset(11e6, presets)[0] == "big"


def test_cli_prints_the_plan_and_a_table(capsys):
    parser = argparse.ArgumentParser()
    P.add_arguments(parser)
    assert P.run(parser.parse_args(["--budget-usd", "35", "--gpu", "a100-80gb", "--gpus", "1"])) == 0
    out = capsys.readouterr().out
    for needle in (
        "hours ",
        "tokens D",
        "params N",
        "predicted loss",
        "nearest preset  gpt2-124m",
        "across GPU types",
    ):
        assert needle in out, needle
    table = out.split("across GPU types")[1].splitlines()[2:]
    assert [row.split()[0] for row in table if row.strip()] == P.pricing.priced()
    assert P.main(["--budget-usd", "35", "--gpu", "nope"]) == 2
    assert "unknown GPU type 'nope'" in capsys.readouterr().err


def test_preset_plan_gives_the_checkpoint_and_volume_size(capsys):
    assert P.main(["--preset", "gpt2-124m", "--gpu", "h100-sxm", "--gpus", "8"]) == 0
    out, params = capsys.readouterr().out, P.preset_params()["gpt2-124m"]
    assert f"checkpoint: {12 * params / 1e9:.2f} GB each" in out
    assert (
        f"at least {5 * 12 * params / 1e9:.2f} GB (checkpoint.keep_last=3 + 1 best + 1 being written)" in out
    )


def test_the_checkpoint_size_estimate_is_what_a_save_writes(tmp_path):
    """memory.checkpoint_bytes (what plan, --print-config and the space warnings use) against the bytes of
    a real checkpoint of the same model, optimizer state included: within the JSON files' few KB."""
    import torch

    from app.config import load_config
    from app.trainer.checkpoint.writer import CheckpointWriter
    from app.trainer.model.gpt import build_model
    from app.trainer.optimization.optimizer import build_optimizer
    from app.trainer.parallel.memory import checkpoint_bytes

    cfg = load_config(
        overrides=["model.vocab_size=512", "model.n_layer=2", "model.d_model=64", "model.n_head=4"]
    )
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))  # the preset's: Muon keeps one moment
    x = torch.zeros(1, 4, dtype=torch.long)
    model(x, x).loss.backward()
    opt.step()
    saved = CheckpointWriter(tmp_path, 0, 1).save(1, model, opt, {"step": 1}, {})
    assert checkpoint_bytes(cfg) <= saved.bytes < checkpoint_bytes(cfg) + 100_000


def test_the_prepares_cpu_time_is_counted_apart_from_the_gpu_budget(capsys):
    """The tokens the run reads, at the reference rate per core, on the prepare pod's cores at the CPU price:
    a line of its own, which changes nothing in the GPU plan."""
    args = ["--budget-usd", "35", "--gpu", "a100-80gb"]
    assert P.main(args) == 0
    out = capsys.readouterr().out
    plan = P.make_plan(35, "a100-80gb", 1)
    (line,) = [x for x in out.splitlines() if x.strip().startswith("prepare (CPU)")]
    core_hours = plan.tokens / P.PREPARE_TOKENS_PER_CORE_SECOND / 3600
    assert f"{core_hours:,.1f} core-hours, {core_hours / 16:,.2f} h on 16 cores" in line
    assert f"${core_hours * P.DEFAULT_CPU_PRICE:,.2f} at $0.05/core-hour" in line
    assert (
        P.main([*args, "--cpu-price-per-hour", "0.02", "--prepare-cores", "64", "--prepare-tokens", "10B"])
        == 0
    )
    other = capsys.readouterr().out
    (line,) = [x for x in other.splitlines() if x.strip().startswith("prepare (CPU)")]
    core_hours = 10e9 / P.PREPARE_TOKENS_PER_CORE_SECOND / 3600
    assert "10B tokens (the corpus)" in line and f"${core_hours * 0.02:,.2f} at $0.02/core-hour" in line
    assert f"{core_hours / 64:,.2f} h on 64 cores" in line
    assert [x for x in out.splitlines() if "prepare (CPU)" not in x] == [
        x for x in other.splitlines() if "prepare (CPU)" not in x
    ]
    assert (
        P.main(["--preset", "gpt2-124m", "--gpu", "h100-sxm", "--gpus", "8", "--prepare-tokens", "9B"]) == 0
    )
    assert "prepare (CPU)   9B tokens (the corpus)" in capsys.readouterr().out
    for bad, needle in (
        (["--cpu-price-per-hour", "-1"], "--cpu-price-per-hour must be a number >= 0, got -1.0"),
        (["--prepare-cores", "0"], "--prepare-cores must be >= 1, got 0"),
        (["--prepare-tokens", "lots"], "--prepare-tokens: expected a whole number up to 10^18 like 50000000"),
        (["--prepare-tokens", "inf"], "got 'inf'"),
        (["--prepare-tokens", "1e400"], "got '1e400'"),
    ):
        assert P.main([*args, *bad]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------- the final loss a recipe is predicted at


def test_plan_preset_states_the_fit_its_constants_and_its_error(capsys):
    parser = argparse.ArgumentParser()
    P.add_arguments(parser)
    for preset, fit in (("tiny-speedrun", P.EMBEDDED_TINY), ("gpt2-124m", P.CHINCHILLA)):
        assert P.run(parser.parse_args(["--preset", preset])) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "predicted final loss" in x)
        assert fit.name in line and fit.formula() in line and fit.error in line


def test_a_recipe_predicts_as_the_classic_one_on_more_tokens():
    from app.config import load_config

    classic = load_config("gpt2-124m")
    record = load_config("gpt2-124m-speedrun")
    before = P.predict_final_loss(classic, 1e9)
    after = P.predict_final_loss(record, 1e9)
    assert before.multiplier == 1 and before.fit is after.fit is P.CHINCHILLA
    assert after.multiplier == P.MULTIPLIER_RECORD
    # the value tables and the untied head are not counted as N: the record's model is GPT-2 small's size
    assert after.params == pytest.approx(before.params, rel=0.01)
    assert after.loss == pytest.approx(P.CHINCHILLA.loss(after.params, P.MULTIPLIER_RECORD * 1e9))
    assert after.loss < before.loss
    # tiny's shape on the embedded corpus takes the fit measured there; AdamW on it is the classic recipe
    tiny = P.predict_final_loss(load_config("tiny", overrides=["optim.name=adamw"]))
    assert tiny.fit is P.EMBEDDED_TINY and tiny.multiplier == 1
    assert tiny.tokens == 800 * 16 * 128  # the preset's planned steps x tokens per step


def test_the_quality_benchmark_fit_recovers_a_power_law():
    """bench_quality --fit's least squares (the constants of EMBEDDED_TINY), on a known L(D)."""
    from benchmarks.bench_quality import equivalent_tokens, fit_power_law

    points = [(tokens, 2.5 + 40.0 / tokens**0.35) for tokens in (204_800, 409_600, 819_200, 1_638_400)]
    e, b, beta = fit_power_law(points)
    assert (e, b, beta) == pytest.approx((2.5, 40.0, 0.35), rel=1e-6)
    assert equivalent_tokens(2.5 + 40.0 / 1e6**0.35, e, b, beta) == pytest.approx(1e6, rel=1e-6)
    assert equivalent_tokens(2.4, e, b, beta) == float("inf")  # below the floor: never
