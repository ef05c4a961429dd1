"""FP8 without a GPU: train.fp8=emulate runs torchao's float8 training with its emulation switch (the same
dynamic scaling and float8 rounding, the matmuls in software), so the FP8 path is trained, checkpointed and
resumed for real on CPU: in one process and on 2 gloo ranks under FSDP2."""

from __future__ import annotations

import copy
import dataclasses
import signal

import pytest
import torch

from app.config import ModelConfig
from app.errors import ConfigError
from app.trainer.checkpoint import store as ckpt
from app.trainer.model.gpt import build_model
from tests.conftest import CLASSIC, losses_by_step, pretrain, spawn_train, torchrun, wait_for_step
from tests.conftest import FAST as SMALL

# the layer counts below are a SwiGLU model's (7 linears a block)
FAST = [*SMALL, *CLASSIC]

float8 = pytest.importorskip("torchao.float8", reason="train.fp8 needs torchao (pip install torchao)")

EMULATE = ["--set", "train.fp8=emulate"]
# FP8 (e4m3 forward, e5m2 gradients) rounds each matmul input to 3 or 2 mantissa bits: a linear's output
# is off by ~3.5% (relative norm), yet over 50 steps the loss stays within this of the fp32 run's
# (measured: 9e-5 at most on FAST).
LOSS_RTOL = 1e-2
CFG = ModelConfig(vocab_size=256, seq_len=32, n_layer=2, d_model=64, n_head=4, n_kv_head=2)


def weights(run, step):
    info, why = ckpt.verify(run / "checkpoints" / f"step_{step:06d}")
    assert info is not None, why
    return ckpt.load_model_state(info)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def assert_identical(a, b, steps):
    wa, wb = weights(a, steps), weights(b, steps)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs"
    la, lb = losses_by_step(a), losses_by_step(b)
    assert [la[s] for s in range(1, steps + 1)] == [lb[s] for s in range(1, steps + 1)]


def assert_follows(fp8_run, fp32_run, steps):
    a, b = losses_by_step(fp8_run), losses_by_step(fp32_run)
    for s in range(1, steps + 1):
        assert abs(a[s] - b[s]) <= LOSS_RTOL * b[s], f"step {s}: fp8 {a[s]} vs fp32 {b[s]}"
    assert any(a[s] != b[s] for s in range(1, steps + 1)), "fp8 changed nothing: were the layers swapped?"


# ---------------------------------------------------------------- fast: in one process


def test_emulate_swaps_the_eligible_linears_and_keeps_parameter_names():
    from app.trainer.parallel.fp8 import convert_to_fp8

    torch.manual_seed(0)
    model = build_model(CFG)
    names = list(model.state_dict())
    lines = []
    converted = convert_to_fp8(model, torch.device("cpu"), lines.append, mode="emulate")
    assert converted == 7 * CFG.n_layer  # wq wk wv wo, w_gate w_up w_down; not the head
    assert lines == [f"fp8: {converted} of {converted + 1} linear layers run in float8 (torchao, emulated)"]
    assert type(model.blocks[0].attn.wq).__name__ == "Float8Linear"
    assert type(model.head) is torch.nn.Linear and model.head.weight is model.tok_emb.weight
    assert list(model.state_dict()) == names  # checkpoints do not change
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    model(x, x).loss.backward()
    assert model.blocks[0].attn.wq.weight.grad is not None


def test_relu2_keeps_w_down_out_of_float8_and_says_so():
    """The ReLU² MLP (the speedrun presets'): every block linear but w_down runs in float8; the head and
    w_down keep the run's precision (bf16 on a GPU)."""
    from app.trainer.parallel.fp8 import convert_to_fp8

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(CFG, mlp="relu2"))
    lines = []
    converted = convert_to_fp8(model, torch.device("cpu"), lines.append, mode="emulate")
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    in_float8 = {name for name, kind in kinds.items() if kind == "Float8Linear"}
    matrices = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_up")
    assert in_float8 == {f"blocks.{b}.{m}" for b in range(CFG.n_layer) for m in matrices}
    assert converted == 5 * CFG.n_layer
    assert {kinds[f"blocks.{b}.mlp.w_down"] for b in range(CFG.n_layer)} == {"Linear"}
    assert kinds["head"] == "Linear"
    assert lines == [
        f"fp8: {converted} of {len(kinds)} linear layers run in float8 (torchao, emulated); mlp.w_down stays "
        "out of float8 (its input relu(x)^2 spans too wide a range for one scale)"
    ]


def _per_token_error(layer: torch.nn.Module, x: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = layer(x).double()
    return (out - exact).norm(dim=1) / exact.norm(dim=1)


def test_tensorwise_float8_loses_the_quiet_tokens_of_a_relu2_input_and_bf16_keeps_them():
    """Why w_down stays out of float8 under ReLU²: a realistic input has tokens of very different
    magnitudes (trained transformers grow a few tokens with activations many times the median's), and
    squaring squares that spread. Tensorwise e4m3 scaling takes one scale from the largest value, so the
    quietest tokens' relu(x)^2 falls under float8's smallest steps: their w_down outputs are lost, while
    relu(x) of the same pre-activations (the spread not squared) keeps every token near float8's usual
    3.5% error, and bf16 (what w_down keeps) within 0.5%."""
    from app.trainer.parallel.fp8 import load_float8

    float8 = load_float8()
    torch.manual_seed(0)
    d_ff, tokens = 256, 2048
    w_down = build_model(dataclasses.replace(CFG, mlp="relu2", d_ff=d_ff)).blocks[0].mlp.w_down
    in_float8 = torch.nn.Sequential(copy.deepcopy(w_down))
    float8.convert_to_float8_training(in_float8, config=float8.Float8LinearConfig(emulate=True))
    assert type(in_float8[0]).__name__ == "Float8Linear"
    # per-token magnitudes spread log-normally: the largest token about 17x the median one
    pre = torch.randn(tokens, d_ff) * torch.exp(torch.randn(tokens, 1))
    worst = {}
    for name, x in (("relu", torch.relu(pre)), ("relu2", torch.relu(pre).square())):
        exact = x.double() @ w_down.weight.detach().double().T
        worst[f"{name} float8"] = float(_per_token_error(in_float8, x, exact).max())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            worst[f"{name} bf16"] = float(_per_token_error(w_down, x, exact).max())
    print(worst)
    assert worst["relu float8"] < 0.1 and worst["relu bf16"] < 0.005  # float8's usual rounding, every token
    assert worst["relu2 float8"] > 0.5  # a quiet token's output mostly gone
    assert worst["relu2 bf16"] < 0.005  # what the ReLU² model's w_down runs in


def test_residual_init_scaling_survives_the_fp8_swap():
    """The FSDP path builds on the meta device, swaps in Float8Linear, then runs the init: the residual
    projections (attn.wo, mlp.w_down) must still get std x 1/sqrt(2 x depth)."""
    model = build_model(CFG, "meta")
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig(emulate=True))
    assert type(model.blocks[0].attn.wo).__name__ == "Float8Linear"
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.reset_parameters()
    scaled = CFG.init_std / (2 * CFG.effective_depth) ** 0.5
    for block in model.blocks:
        for plain in (block.attn.wq, block.mlp.w_up):
            assert abs(float(plain.weight.detach().std()) - CFG.init_std) < 0.1 * CFG.init_std
        for residual in (block.attn.wo, block.mlp.w_down):
            assert abs(float(residual.weight.detach().std()) - scaled) < 0.1 * scaled, (
                "residual init scaling lost"
            )


def test_fp8_values_and_refusals_are_one_line(tmp_path):
    from app.trainer.parallel.fp8 import check_fp8_device, fp8_mode

    assert [fp8_mode(v) for v in (True, "True", "no", "emulate")] == ["true", "true", "false", "emulate"]
    with pytest.raises(ConfigError, match="choose one of: false, true, emulate"):
        fp8_mode("maybe")
    with pytest.raises(ConfigError, match="train.fp8=emulate"):
        check_fp8_device(torch.device("cpu"))
    proc = pretrain(
        "train", "--out", str(tmp_path / "r"), "--max-steps", "1", *FAST, "--set", "train.fp8=maybe"
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "train.fp8" in proc.stderr


# ---------------------------------------------------------------- slow: real runs, 1 process and 2 FSDP2 ranks


@pytest.mark.slow
def test_emulated_fp8_trains_like_fp32_and_a_sigterm_resume_is_bit_identical(tmp_path):
    straight, fp32, stopped = tmp_path / "fp8", tmp_path / "fp32", tmp_path / "stopped"
    run = ok(pretrain("train", "--out", str(straight), "--max-steps", "50", *FAST, *EMULATE))
    assert "fp8: 14 of 15 linear layers run in float8 (torchao, emulated)" in run.stdout
    ok(pretrain("train", "--out", str(fp32), "--max-steps", "50", *FAST))
    assert_follows(straight, fp32, 50)
    assert weights(straight, 50).keys() == weights(fp32, 50).keys()
    # A real stop: SIGTERM mid-run checkpoints and exits 143; the rerun resumes to the same bits.
    proc = spawn_train("--out", str(stopped), "--max-steps", "50", *FAST, *EMULATE)
    wait_for_step(stopped, 5, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    resumed = ok(pretrain("train", "--out", str(stopped), "--max-steps", "50", *FAST, *EMULATE))
    assert "resumed from" in resumed.stdout
    assert_identical(straight, stopped, 50)


@pytest.mark.slow
def test_emulated_fp8_under_fsdp2_on_two_ranks_resumes_exactly(tmp_path):
    fsdp = [*FAST, *EMULATE, "--set", "train.parallel=fsdp"]
    straight, halves, fp32 = tmp_path / "straight", tmp_path / "halves", tmp_path / "fp32"
    run = ok(torchrun("--out", str(straight), "--max-steps", "10", *fsdp))
    assert "parallel: fsdp" in run.stdout and "fp8: 14 of 15 linear layers" in run.stdout
    ok(torchrun("--out", str(halves), "--max-steps", "5", *fsdp))
    resumed = ok(torchrun("--out", str(halves), "--max-steps", "10", *fsdp))
    assert "resumed from" in resumed.stdout
    assert_identical(straight, halves, 10)
    ok(torchrun("--out", str(fp32), "--max-steps", "10", *FAST, "--set", "train.parallel=fsdp"))
    assert_follows(straight, fp32, 10)
    assert weights(straight, 10).keys() == weights(fp32, 10).keys()
