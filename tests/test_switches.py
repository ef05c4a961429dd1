"""The model switches of docs/recipes.md ("Model switches") and the Muon momentum warm-up: each does what
its line says, an old config (without the keys) builds the old model, and a model with every switch on
trains compiled and eager alike, under FSDP2 with activation checkpointing and FP8 (emulated), resumes
bit-identically after SIGKILL on 1 and 2 gloo ranks, and samples and serves from its checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from app.config import Config, LoopConfig, ModelConfig, OptimConfig, config_from_dict, load_config
from app.errors import ConfigError
from app.trainer.model.gpt import build_model, count_parameters
from app.trainer.optimization.optimizer import build_optimizer, param_groups, set_muon_momentum
from app.trainer.optimization.schedule import muon_momentum_at
from tests.conftest import (
    CLASSIC,
    FAST,
    REPO,
    losses_by_step,
    pretrain,
    pretrain_meanwhile,
    torchrun,
    train_rows,
)
from tests.procs import Procs
from tests.test_resume import assert_same_run, weights

# Every model switch on (value_embeds at its most for 2 blocks); the untied head is what zero_init zeroes.
SWITCHES = {
    "mlp": "relu2",
    "qk_norm": True,
    "attn_scale": 0.12,
    "parameter_free_norms": True,
    "embed_norm": True,
    "zero_init": True,
    "logit_softcap": 15.0,
    "value_embeds": 1,
    "x0_skip": True,
    "unet_skips": True,
    "tie_embeddings": False,
}
OPTIM = {
    "name": "muon",
    "matrix_lr": 0.02,
    "muon_lr_adjust": "original",
    "muon_momentum_warmup_steps": 4,
    "muon_momentum_end": 0.85,
    "scalar_lr": 0.01,
}
ALL = [
    *(a for k, v in SWITCHES.items() for a in ("--set", f"model.{k}={v}")),
    *(a for k, v in OPTIM.items() for a in ("--set", f"optim.{k}={v}")),
    *("--set", "schedule.warmup_steps=2"),
]


def small(**switches) -> ModelConfig:
    shape = {"vocab_size": 300, "seq_len": 32, "n_layer": 4, "d_model": 64, "n_head": 4, "n_kv_head": 2}
    return ModelConfig(**{**shape, **switches})


def every_switch(looped: bool = False) -> ModelConfig:
    cfg = small(**{**SWITCHES, "value_embeds": 2})
    if looped:
        cfg.n_layer = 0
        cfg.loop = LoopConfig(prelude=2, recurrent=1, coda=2, recurrence=3, deep_supervision=True)
    return cfg


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# ---------------------------------------------------------------- each switch, in one process


def test_a_config_without_the_keys_builds_the_model_of_before():
    """A checkpoint's saved config from before the switches reads as every switch off."""
    cfg = Config().to_dict()  # the config defaults: every switch off (the tiny preset turns them on)
    for key in SWITCHES.keys() - {"tie_embeddings"}:
        del cfg["model"][key]
    for key in OPTIM:
        cfg["optim"].pop(key, None)
    old = config_from_dict(cfg)
    assert old.model == Config().model and old.optim == Config().optim
    # and the defaults they read as are the switches off
    assert all(getattr(old.model, key) != on for key, on in SWITCHES.items() if key != "tie_embeddings")
    old.model.vocab_size = 2048
    names = [n for n, _ in build_model(old.model, "meta").named_parameters()]
    assert not any(k in n for n in names for k in ("value", "scale", "skip", "mix"))
    assert sum("norm" in n for n in names) == 2 * 4 + 1  # every RMSNorm keeps its gain


def test_zero_init_starts_every_block_as_the_identity_and_the_head_at_uniform():
    torch.manual_seed(0)
    model = build_model(small(zero_init=True, tie_embeddings=False))
    for block in model.blocks:
        assert block.attn.wo.weight.abs().sum() == 0 and block.mlp.w_down.weight.abs().sum() == 0
    assert model.head.weight.abs().sum() == 0
    x = torch.randint(0, 300, (2, 32))
    assert model(x, x).loss.item() == pytest.approx(math.log(300), rel=1e-6)
    tied = build_model(small(zero_init=True))  # a tied head is the embedding: not zeroed
    assert tied.head.weight.abs().sum() > 0


def test_relu2_has_two_matrices_of_4d_and_the_swiglu_budget():
    relu2, swiglu = build_model(small(mlp="relu2")), build_model(small())
    assert not hasattr(relu2.blocks[0].mlp, "w_gate") and relu2.blocks[0].mlp.w_up.weight.shape == (256, 64)
    # 2 x d x 4d = 8 d^2, SwiGLU 3 x d x (8/3 d rounded up to 64): the same parameter budget at d = 192
    assert (
        count_parameters(small(mlp="relu2", d_model=192)).total == count_parameters(small(d_model=192)).total
    )
    x = torch.randn(3, 64)
    w_up, w_down = relu2.blocks[0].mlp.w_up.weight, relu2.blocks[0].mlp.w_down.weight
    torch.testing.assert_close(relu2.blocks[0].mlp(x), torch.relu(x @ w_up.T).square() @ w_down.T)
    assert count_parameters(swiglu).total > 0


def test_qk_norm_makes_attention_blind_to_the_scale_of_q_and_k():
    torch.manual_seed(0)
    model = build_model(small(qk_norm=True, norm_eps=1e-12)).eval()  # an eps this small changes nothing
    x = torch.randint(0, 300, (2, 32))
    before = model(x).logits
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight.mul_(7.0)
            block.attn.wk.weight.mul_(3.0)
    torch.testing.assert_close(model(x).logits, before, rtol=1e-4, atol=1e-5)


def test_softcap_bounds_the_logits_everywhere_they_are_read():
    torch.manual_seed(0)
    cfg = small(logit_softcap=2.0, init_std=0.5)
    model = build_model(cfg).eval()
    x = torch.randint(0, 300, (2, 32))
    logits = model(x).logits
    assert logits.abs().max() < 2.0 and logits.abs().max() > 1.5  # the cap bites at this init
    plain = build_model(small(init_std=0.5)).eval()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits, 2.0 * torch.tanh(plain(x).logits / 2.0))
    # the training loss reads the capped logits too
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), x.reshape(-1))
    torch.testing.assert_close(model(x, x).loss, ce)


def test_value_embeddings_serve_the_first_and_last_blocks_from_shared_tables():
    cfg = small(value_embeds=2, n_layer=5)
    assert cfg.value_embed_tables == [0, 1, None, 0, 1]  # the record's 012...012 pattern
    model = build_model(cfg)
    assert len(model.value_embeds) == 2 and model.value_embeds[0].weight.shape == (300, 2 * 16)
    assert [b.attn.value_mix is not None for b in model.blocks] == [True, True, False, True, True]
    x = torch.randint(0, 300, (2, 32))
    model(x, x).loss.backward()
    used = torch.zeros(300, dtype=torch.bool)
    used[x.unique()] = True
    grad = model.value_embeds[1].weight.grad
    assert grad[used].abs().sum(-1).gt(0).all() and grad[~used].abs().sum() == 0  # rows of the tokens seen
    counts = count_parameters(cfg)
    assert counts.total - counts.non_embedding == 384 * 64 + 2 * 300 * 32  # tables count as embeddings
    with pytest.raises(ConfigError, match="model.value_embeds=3 needs 6 blocks"):
        load_config("tiny", overrides=["model.value_embeds=3"])


def test_skips_pair_mirror_blocks_and_feed_the_embedding():
    assert small(unet_skips=True, n_layer=5).skip_pairs == [(1, 3), (0, 4)]  # the middle block has none
    looped = every_switch(looped=True)
    assert looped.skip_pairs == [(1, 3), (0, 4)]  # the prelude into the coda, around the recurrent core
    torch.manual_seed(0)
    model = build_model(small(unet_skips=True, x0_skip=True))
    x = torch.randint(0, 300, (2, 32))
    model(x, x).loss.backward()
    assert model.skip_weights.grad.abs().min() > 0
    assert all(b.x0_scale.grad.abs() > 0 for b in model.blocks)
    with pytest.raises(ConfigError, match="model.unet_skips needs blocks to pair"):
        load_config("tiny", overrides=["model.unet_skips=true", "model.n_layer=1", "model.value_embeds=0"])


def test_new_parameters_go_to_their_optimizer_groups():
    cfg = load_config("tiny", overrides=[f"optim.{k}={v}" for k, v in OPTIM.items()])
    model = build_model(every_switch())
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: [names[id(p)] for p in g["params"]] for g in param_groups(model, cfg.optim)}
    assert groups["embedding"] == ["tok_emb.weight", "value_embeds.0.weight", "value_embeds.1.weight"]
    assert groups["head"] == ["head.weight"]
    assert "skip_weights" in groups["other"] and "blocks.0.x0_scale" in groups["other"]
    assert "blocks.0.attn.value_mix" in groups["other"]
    assert all(n.endswith(".weight") and n.startswith("blocks.") for n in groups["matrix"])
    other = next(g for g in param_groups(model, cfg.optim) if g["name"] == "other")
    assert other["lr"] == 0.01 and other["weight_decay"] == 0.0
    assert sum(len(v) for v in groups.values()) == len(list(model.parameters()))


def test_muon_momentum_warms_up_and_follows_the_lr_decay_only_for_muon():
    from app.trainer.optimization.schedule import annealed_at

    cfg = load_config(
        "tiny",
        overrides=[
            "optim.muon_momentum_warmup_steps=300",
            "optim.muon_momentum=0.97",
            "optim.muon_momentum_end=0.9",
            "schedule.name=wsd",
            "schedule.warmup_steps=10",
            "schedule.decay_fraction=0.5",
            "train.max_steps=1000",
        ],
    )
    s, o = cfg.schedule, cfg.optim

    def at(step):
        return muon_momentum_at(step, annealed_at(step, s, o, 1000), o)

    # 0.85 -> 0.97 over 300 steps (before and across the LR warm-up), flat at peak LR, then down to 0.9
    # as the LR decays from its peak (step 500) to min_lr (step 999)
    assert [at(i) for i in (0, 5, 150, 300, 499, 749, 999)] == pytest.approx(
        [0.85, 0.852, 0.91, 0.97, 0.97, 0.935, 0.9], abs=1e-3
    )
    plain = OptimConfig()  # the config defaults (the tiny preset warms the momentum up)
    assert muon_momentum_at(0, 1.0, plain) == muon_momentum_at(999, 1.0, plain) == 0.95  # off
    cfg = load_config("tiny", overrides=[f"optim.{k}={v}" for k, v in OPTIM.items()])
    model = build_model(small())
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    set_muon_momentum(opt, 0.9)
    assert {g["name"]: g.get("momentum") for g in opt.param_groups}["matrix"] == 0.9
    assert all("momentum" not in g or g["name"] == "matrix" for g in opt.param_groups)


def test_muon_momentum_anneals_with_a_plan_that_ends_inside_the_warmup():
    """30 warm-up steps (tiny's on the AdamW recipe) and a max_hours plan agreed at step 11 that ends at step 25: the LR decays
    from step 11 to min_lr at step 24, and the momentum follows it down to muon_momentum_end (it stayed at
    muon_momentum, because the step never reached the configured warm-up)."""
    from app.trainer.optimization.schedule import DecayPlan, annealed_at, lr_at

    overrides = ["schedule.name=cosine", "schedule.warmup_steps=30", "optim.muon_momentum_warmup_steps=0"]
    overrides += ["optim.muon_momentum=0.97", "optim.muon_momentum_end=0.9"]
    cfg = load_config("tiny", overrides=overrides)
    s, o = cfg.schedule, cfg.optim
    plan = DecayPlan(start_step=11, steps=14, cause="max_hours", start_lr=lr_at(11, s, o, 400))
    momenta = [muon_momentum_at(i, annealed_at(i, s, o, 400, plan), o) for i in range(26)]
    assert momenta[:12] == [0.97] * 12  # warming up, then the plan's first step at its start LR
    assert all(a > b for a, b in zip(momenta[11:25], momenta[12:25], strict=False))
    assert momenta[24] == pytest.approx(0.9) and momenta[25] == pytest.approx(0.9)


def test_bad_switch_values_are_one_line_exit_2(tmp_path):
    proc = pretrain("train", "--out", str(tmp_path / "r"), "--set", "model.mlp=gelu", "--print-config")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: model.mlp='gelu' is not valid; choose one of: swiglu, relu2"
    ], proc.stderr


@pytest.mark.parametrize("looped", [False, True], ids=["plain", "looped-deep-supervision"])
def test_every_switch_together_trains_one_step_under_fp8_emulation(looped):
    float8 = pytest.importorskip("torchao.float8")
    from app.trainer.parallel.fp8 import convert_to_fp8

    torch.manual_seed(0)
    cfg = every_switch(looped)
    model = build_model(cfg)
    names = list(model.state_dict())
    # q, k, v, o and ReLU²'s up projection per block; its w_down stays out (app/trainer/parallel/fp8.py)
    assert convert_to_fp8(model, torch.device("cpu"), lambda m: None, "emulate") == 5 * cfg.n_blocks
    assert float8 and list(model.state_dict()) == names  # checkpoints do not change
    opt = build_optimizer(model, load_config("tiny").optim, torch.device("cpu"))
    x = torch.randint(0, 300, (2, 32))
    for _ in range(2):  # the second step moves the zero-initialized projections' inputs too
        loss = model(x, x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert math.isfinite(loss.item()) and loss.item() < math.log(300)


@pytest.mark.parametrize("looped", [False, True], ids=["plain", "looped-deep-supervision"])
def test_every_switch_runs_under_bf16_autocast(looped):
    """What a GPU run does (bf16 autocast; no GPU here, so on CPU): the bf16 values meet the fp32 value
    tables and mixing weights without a dtype clash in attention, and cached generation runs too."""
    from app.trainer.model.generate import generate

    torch.manual_seed(0)
    model = build_model(every_switch(looped))
    x = torch.randint(0, 300, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, x).loss
        loss.backward()
        model.eval()
        out = generate(model, x[:, :4], 8, temperature=0)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(math.log(300), rel=1e-3)
    assert model.head.weight.grad.abs().sum() > 0 and out.shape == (2, 12)


def test_every_switch_has_its_line_in_docs_recipes():
    table = (REPO / "docs" / "recipes.md").read_text().split("## Model switches")[1].split("\n## ")[0]
    keys = [f"model.{k}" for k in SWITCHES.keys() - {"tie_embeddings"}]
    keys += ["optim.scalar_lr", "optim.muon_momentum_warmup_steps", "optim.muon_momentum_end"]
    assert [k for k in keys if f"| `{k}" not in table] == []


# ---------------------------------------------------------------- the trainer, for real


def train_on(ranks: int, *args: str) -> subprocess.CompletedProcess:
    return ok(pretrain("train", *args) if ranks == 1 else torchrun(*args, nproc=ranks))


def sigkill_at(run: Path, ranks: int, step: int, args: list[str]) -> None:
    """Start a run, SIGKILL it (every process of it) once `step` is logged."""
    with Procs(run.parent / "logs") as procs:
        if ranks == 1:
            proc = procs.pretrain("train", "--out", str(run), *args)
        else:
            proc = procs.torchrun("--out", str(run), *args, nproc=ranks)
        proc.wait_for_step(run, step, timeout=240)
    time.sleep(0.5)  # the workers' exits are reaped by init; nothing of the run may still write


# Runs that sum in another order (compiled, sharded) agree on Muon-trained weights to this relative norm
# per tensor, not to rounding: Muon orthogonalizes the gradient in bf16, which brings its smallest singular
# directions (rounding-level in a zero-initialized matrix's first updates) to full size. The losses agree
# to rounding; the same run twice, or resumed, is bit-identical.
MUON_WEIGHTS = 0.1


def assert_weights_within(got: dict, want: dict, rel: float) -> None:
    assert got.keys() == want.keys()
    worst = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
    assert max(worst.values()) <= rel, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


RESUME_STEPS = 8
RESUME = [*FAST, *ALL, "--max-steps", str(RESUME_STEPS), "--set", "checkpoint.every_steps=1"]
SHARDED = ["--set", "train.parallel=fsdp", "--set", "train.activation_checkpointing=true"]


@pytest.mark.slow  # three runs of ~10 s (2 ranks: ~25 s): `make test-slow`, which CI runs
@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "two-ranks-fsdp"])
def test_every_switch_resumes_bit_identically_after_sigkill(tmp_path, ranks):
    extra = SHARDED if ranks > 1 else []
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    if ranks == 1:  # one process: the straight run trains on the other core meanwhile
        reference = pretrain_meanwhile("train", "--out", str(straight), *RESUME)
    else:
        train_on(ranks, "--out", str(straight), *RESUME, *extra)
    sigkill_at(killed, ranks, 5, [*RESUME, *extra])
    assert max(losses_by_step(killed)) < RESUME_STEPS
    assert "resumed from" in train_on(ranks, "--out", str(killed), *RESUME, *extra).stdout
    if ranks == 1:
        ok(reference.finished())
    assert_same_run(straight, killed, RESUME_STEPS)
    assert sorted(losses_by_step(killed)) == list(range(1, RESUME_STEPS + 1))


@pytest.mark.slow  # compiling takes ~1 min on 2 cores
def test_every_switch_compiled_follows_eager(tmp_path):
    """Inductor reorders float sums, so a compiled run agrees with eager to rounding: the losses to relative
    1e-4 over 6 steps (measured: 2e-7), the weights to MUON_WEIGHTS (measured: 6% at most, on the
    zero-initialized wo and w_down; 1.4e-4 on the AdamW-trained embedding). Generation with the KV cache
    runs eager on the compiled model."""
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    common = [*FAST, *ALL, "--max-steps", "6"]
    reference = pretrain_meanwhile("train", "--out", str(eager), *common)
    compile_and_sample = ["--set", "train.compile=true", "--set", "train.sample_every=3"]
    proc = ok(pretrain("train", "--out", str(compiled), *common, *compile_and_sample))
    ok(reference.finished())
    assert "compile: 2 blocks and the loss" in proc.stdout and "sample at step 6" in proc.stdout
    le, lc = losses_by_step(eager), losses_by_step(compiled)
    assert sorted(lc) == list(range(1, 7)) and le[6] < le[1] - 0.05  # it trains
    for s in le:
        assert lc[s] == pytest.approx(le[s], rel=1e-4)
    assert_weights_within(weights(compiled, 6), weights(eager, 6), MUON_WEIGHTS)


@pytest.mark.slow  # two runs of ~15 s
def test_every_switch_under_fsdp_and_fp8_matches_one_process(tmp_path):
    """2 gloo ranks with FSDP2, activation checkpointing and emulated FP8 against one process reading the
    same samples: FP8 rounds each matmul input, so the losses agree to 1e-2 (tests/test_fp8.py); without
    FP8 the sharded run's losses match to 1e-5 and its weights to MUON_WEIGHTS."""
    one, sharded, sharded_fp8 = tmp_path / "one", tmp_path / "sharded", tmp_path / "sharded-fp8"
    common = [*FAST, *ALL, "--max-steps", "4"]
    reference = pretrain_meanwhile("train", "--out", str(one), *common, "--set", "train.micro_batch_size=16")
    ok(torchrun("--out", str(sharded), *common, *SHARDED))
    proc = ok(torchrun("--out", str(sharded_fp8), *common, *SHARDED, "--set", "train.fp8=emulate"))
    ok(reference.finished())
    # ReLU²: each block's w_down stays out of float8 (app/trainer/parallel/fp8.py)
    assert "fp8: 10 of 13 linear layers run in float8" in proc.stdout
    lo, ls, lf = losses_by_step(one), losses_by_step(sharded), losses_by_step(sharded_fp8)
    for s in range(1, 5):
        assert ls[s] == pytest.approx(lo[s], rel=1e-5)
        assert lf[s] == pytest.approx(lo[s], rel=1e-2)
    assert_weights_within(weights(sharded, 4), weights(one, 4), MUON_WEIGHTS)


@pytest.mark.slow  # a short run, then sample, serve and export it
def test_every_switch_checkpoint_samples_serves_and_exports(tmp_path):
    from app.tools.generation import Engine, ServeMetrics
    from app.tools.sample import load_for_inference
    from app.trainer.model.generate import generate
    from tests.test_serve_batching import run_jobs

    run = tmp_path / "run"
    ok(pretrain("train", "--out", str(run), *FAST, *ALL, "--max-steps", "20", "--set", "optim.lr=3e-3"))
    sampled = ok(
        pretrain(
            "sample",
            "--checkpoint",
            str(run),
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
        )
    )
    model, tok = load_for_inference(str(run), which="latest")[:2]
    assert model.cfg.value_embeds == 1 and model.cfg.mlp == "relu2"
    ids = tok.encode("ROMEO:")
    want = generate(model, torch.tensor([ids]), 12, temperature=0)[0].tolist()
    assert sampled.stdout.startswith(tok.decode(want))
    engine = Engine(model, tok, ServeMetrics(), max_batch=2)  # what the OpenAI server decodes with
    try:
        got = run_jobs(
            engine, [ids, tok.encode("KING")], max_tokens=12, temperature=0, top_k=0, top_p=1.0, seed=0
        )
    finally:
        engine.close()
    out = want[len(ids) :]
    out = out[: out.index(tok.eot_id)] if tok.eot_id in out else out
    assert got[0][0] == tok.decode(out)
    ok(pretrain("export", str(run), "--output", str(tmp_path / "export")))
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["config"]["model"]["value_embeds"] == 1 and manifest["config"]["model"]["mlp"] == "relu2"
    with safe_open(tmp_path / "export" / "final.safetensors", "pt") as final:
        names = set(final.keys())
    assert {"value_embeds.0.weight", "skip_weights", "blocks.0.x0_scale"} <= names
    assert manifest["weights"]["tensors"] == len(names) == len(model.state_dict())


@pytest.mark.slow  # a short run, then sampled as an older version wrote it
def test_a_checkpoint_from_before_the_switches_still_samples(tmp_path):
    run = tmp_path / "run"
    # the recipe before the switches existed (AdamW, SwiGLU, none of them on)
    ok(pretrain("train", "--out", str(run), *FAST, *CLASSIC, "--max-steps", "2"))
    meta_path = next((run / "checkpoints").glob("step_*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key in SWITCHES.keys() - {"tie_embeddings"}:
        del meta["config"]["model"][key]
    for key in OPTIM:
        meta["config"]["optim"].pop(key, None)
    meta_path.write_text(json.dumps(meta))
    proc = ok(pretrain("sample", "--checkpoint", str(run), "--prompt", "ROMEO", "--max-new-tokens", "8"))
    assert proc.stdout.startswith("ROMEO")
    resumed = ok(pretrain("train", "--out", str(run), *FAST, *CLASSIC, "--max-steps", "3"))
    assert "resumed from" in resumed.stdout and train_rows(run)[-1]["step"] == 3


META_WORKER = """
import torch, torch.distributed as dist
from app.config import load_config
from app.trainer.parallel.distributed import init_distributed
from app.trainer.parallel.parallelize import build_parallel_model, unwrap

env = init_distributed("cpu")
switches = [f"model.{k}={v}" for k, v in SWITCHES.items()]
cfg = load_config(overrides=["model.vocab_size=256", "model.n_layer=4", "model.d_model=64", "model.n_head=4", *switches])
model = build_parallel_model(cfg, env, torch.device("cpu"), "fsdp", log=lambda m: None, meta_init=True)
full = {k: v.full_tensor() for k, v in unwrap(model).state_dict().items()}  # collective, test only
if env.rank == 0:
    for i in range(4):
        assert full[f"blocks.{i}.resid_scale"].tolist() == [1.0] and full[f"blocks.{i}.x0_scale"].tolist() == [0.0]
        assert full[f"blocks.{i}.attn.wo.weight"].abs().sum() == 0
    assert full["blocks.0.attn.value_mix"].tolist() == [0.5, 0.5] == full["blocks.3.attn.value_mix"].tolist()
    assert full["skip_weights"].tolist() == [1.0, 1.0] and full["head.weight"].abs().sum() == 0
    assert 0.015 < float(full["value_embeds.0.weight"].std()) < 0.025
    print("META_OK")
dist.destroy_process_group()
"""


@pytest.mark.slow  # two processes start torch: ~10 s
def test_every_switch_materializes_its_init_from_the_meta_device(tmp_path):
    """FSDP2 on a GPU builds on the meta device and initializes each rank's shards (1-element weights
    included: a rank may hold none of one)."""
    script = tmp_path / "worker.py"
    script.write_text(f"SWITCHES = {SWITCHES!r}\n" + META_WORKER)
    proc = torchrun(str(script))
    assert proc.returncode == 0 and "META_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
