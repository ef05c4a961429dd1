"""Model shapes, parameter counts of every preset (meta device), GQA, looped models, FLOPs formula."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from app.config import ModelConfig, load_config, preset_names
from app.trainer.model.gpt import build_model, count_parameters
from app.trainer.reporting.metrics import flops_per_token
from tests.test_switches import every_switch


def small(**kw) -> ModelConfig:
    cfg = ModelConfig(vocab_size=256, seq_len=32, n_layer=2, d_model=64, n_head=4, n_kv_head=2)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_builds_on_meta_and_counts(preset):
    cfg = load_config(preset)
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = cfg.data.vocab_size
    model = build_model(cfg.model, "meta")
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    counts = count_parameters(cfg.model)
    assert 0 < counts.non_embedding < counts.total


def test_preset_parameter_counts_match_the_seeds():
    x1 = count_parameters(load_config("x1-50m").model)
    assert 49e6 < x1.non_embedding < 51e6  # "about 50M non-embedding"
    assert x1.non_embedding == 8 * (2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 2048 + 2 * 768) + 768
    gpt2 = count_parameters(load_config("gpt2-124m").model)
    assert 122e6 < gpt2.total < 126e6
    looped = count_parameters(load_config("looped-546m").model)
    assert 540e6 < looped.total < 552e6
    char = load_config("char-d64").model
    assert char.n_layer == 64 and char.d_model == 4096 and char.vocab_size == 32
    assert count_parameters(char).total > 12e9  # its real count, printed by --print-config


def test_forward_shapes_and_loss_near_uniform_at_init():
    torch.manual_seed(0)
    cfg = small()
    model = build_model(cfg)
    x, y = torch.randint(0, 256, (3, 32)), torch.randint(0, 256, (3, 32))
    out = model(x, y)
    assert out.logits is None  # training asks for the loss only: no logits kept for the caller
    assert abs(out.loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3
    assert model(x).logits.shape == (3, 32, 256)
    assert model(x, last_only=True).logits.shape == (3, 1, 256)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = build_model(small()).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    a, b = model(x).logits, model(y).logits
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-3)


def test_gqa_has_fewer_kv_parameters():
    mha = count_parameters(small(n_kv_head=4)).total
    gqa = count_parameters(small(n_kv_head=1)).total
    assert mha - gqa == 2 * 2 * 64 * (64 - 16)  # k and v shrink from 4 heads to 1, in 2 layers


def test_tied_embeddings_share_one_tensor():
    tied, untied = build_model(small(tie_embeddings=True)), build_model(small(tie_embeddings=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert count_parameters(untied).total - count_parameters(tied).total == 256 * 64


def looped(**kw) -> ModelConfig:
    cfg = small(n_layer=0)
    cfg.loop.prelude, cfg.loop.recurrent, cfg.loop.coda, cfg.loop.recurrence = 1, 2, 1, 3
    for k, v in kw.items():
        setattr(cfg.loop, k, v)
    return cfg


def test_looped_shares_recurrent_weights():
    cfg = looped()
    model = build_model(cfg)
    assert len(model.blocks) == 4  # 1 + 2 + 1 distinct blocks, recurrence does not add weights
    assert cfg.effective_depth == 1 + 2 * 3 + 1
    plain = count_parameters(small(n_layer=4))
    assert count_parameters(model).total == plain.total


def test_deep_supervision_reports_one_loss_per_loop_and_weights_them():
    torch.manual_seed(0)
    cfg = looped(deep_supervision=True, loss_weights=[0.0, 0.0, 1.0])
    model = build_model(cfg)
    x = torch.randint(0, 256, (2, 32))
    out = model(x, x)
    assert len(out.loop_losses) == 3
    assert torch.allclose(out.loss, out.loop_losses[-1])  # all weight on the last loop
    cfg.loop.loss_weights = []
    out = model(x, x)
    assert torch.allclose(out.loss, sum(out.loop_losses) / 3)


def _counted_flops(cfg: ModelConfig, batch: int = 2) -> float:
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    # The math kernel runs attention as matmuls the counter sees (CPU's fused kernel is not counted).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, x).loss.backward()
    return counter.get_total_flops() / (batch * cfg.seq_len)


@pytest.mark.parametrize(
    "cfg",
    [
        small(seq_len=64, d_model=128, n_head=4, n_kv_head=2, vocab_size=512),
        small(
            seq_len=128, d_model=64, n_head=4, n_kv_head=4, n_layer=3, vocab_size=300, tie_embeddings=False
        ),
        looped(deep_supervision=True),
        every_switch(),
        every_switch(looped=True),
    ],
    ids=["gqa", "mha-untied", "looped-deep-supervision", "every-switch", "looped-every-switch"],
)
def test_flops_formula_agrees_with_flop_counter(cfg):
    analytic, counted = flops_per_token(cfg), _counted_flops(cfg)
    assert abs(analytic - counted) / counted < 0.05, (analytic, counted)


# ---------------------------------------------------------------- the CPU paths against the formulas


def _value_and_grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach(), *(t.grad for t in inputs if t.requires_grad)]


def _assert_same(got, want, rel=1e-6):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and ((g - w).norm() / w.norm()).item() < rel


@pytest.mark.parametrize("gain", [True, False])
@pytest.mark.parametrize("layout", ["residual", "heads"])
def test_the_cpu_rms_norm_is_the_formula(monkeypatch, gain, layout):
    """Eager fp32 on a CPU runs RMSNorm with its backward written out (docs/performance.md, "CPU"); the
    formula is what compiled code and bf16 autocast run. Output and gradients agree to fp32 rounding, on
    the residual stream and on q laid out by heads (QK-norm), with and without a gain."""
    import app.trainer.model.gpt as model_module

    torch.manual_seed(0)
    x = torch.randn(2, 16, 4, 32) * 3
    x = x.flatten(2) if layout == "residual" else x.transpose(1, 2)
    norm = model_module.RMSNorm(x.size(-1), 1e-5, gain)
    if gain:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)

    def run():
        inp = x.clone().requires_grad_()
        norm.zero_grad(set_to_none=True)
        out = norm(inp)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        return [out.detach(), inp.grad, *([norm.weight.grad] if gain else [])]

    cpu = run()
    monkeypatch.setattr(model_module, "cpu_kernels", lambda _x: False)
    _assert_same(cpu, run())


def test_the_cpu_rope_is_the_formula_for_training_and_for_decoding():
    """RoPE's CPU path against the formula: on q as the projection lays it out (batch, position, head,
    seen transposed) with the (T, head_dim/2) tables, and on one position per batch row (the server's
    continuous batch)."""
    from app.trainer.model.gpt import apply_rope, rope, rope_tables

    torch.manual_seed(0)
    cos, sin = rope_tables(16, 32, 10000.0)
    q = torch.randn(2, 16, 4, 32).transpose(1, 2).requires_grad_()
    _assert_same(_value_and_grads(apply_rope, q, cos, sin), _value_and_grads(rope, q, cos, sin))
    rows = torch.tensor([3, 9])  # each batch row at its own position
    one = torch.randn(2, 4, 1, 32).requires_grad_()
    c, s = cos[rows].view(2, 1, 1, 16), sin[rows].view(2, 1, 1, 16)
    _assert_same(_value_and_grads(apply_rope, one, c, s), _value_and_grads(rope, one, c, s))


def test_the_cpu_loss_is_one_cross_entropy():
    """The CPU loss runs over chunks of rows; it is the mean cross-entropy of all rows, gradients too."""
    import torch.nn.functional as F

    from app.trainer.model.gpt import LOSS_CHUNK_BYTES, cross_entropy

    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(3 * LOSS_CHUNK_BYTES // (4 * vocab) + 7, vocab).requires_grad_()  # 4 chunks
    targets = torch.randint(0, vocab, (logits.size(0),))
    cpu = _value_and_grads(lambda t: cross_entropy(t, targets), logits)
    _assert_same(cpu, _value_and_grads(lambda t: F.cross_entropy(t, targets), logits))


def test_the_cpu_paths_save_what_the_formulas_save(monkeypatch):
    """The memory estimate (app/trainer/parallel/memory.py) counts what autograd keeps for backward, measured on the
    formulas: the CPU paths keep the same tensors, byte for byte, in a block and in the loss."""
    import app.trainer.model.gpt as model_module

    def saved_bytes(cfg) -> int:
        torch.manual_seed(0)
        model = build_model(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx, idx).loss.backward()
        return sum(storages.values())

    for cfg in (small(), small(qk_norm=True, parameter_free_norms=True)):
        cpu = saved_bytes(cfg)
        monkeypatch.setattr(model_module, "cpu_kernels", lambda _x: False)
        assert saved_bytes(cfg) == cpu
        monkeypatch.undo()
