"""Model shapes, parameter counts of every preset (meta device), GQA, looped models, FLOPs formula."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from app.config import ModelConfig, load_config, preset_names
from app.trainer.metrics import flops_per_token
from app.trainer.model import build_model, count_parameters
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
