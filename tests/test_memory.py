"""The memory estimate against torch's own allocation tracker on CPU, against the seed's table, and the
`train.parallel=auto` decision built on it."""

from __future__ import annotations

import math

import pytest
import torch

from app.cli import main as cli_main
from app.config import ModelConfig, OptimConfig, load_config
from app.trainer.model.gpt import build_model, count_parameters
from app.trainer.optimization.optimizer import build_optimizer
from app.trainer.parallel import memory
from tests.test_switches import SWITCHES

GB = memory.GB


def measure(cfg: ModelConfig, micro_batch: int, checkpointing: bool, autocast: bool = False) -> dict:
    """Peak bytes by kind over two training steps (the second has optimizer state), from MemTracker,
    which follows every tensor storage through torch's dispatcher; `autocast`: bf16 autocast on the CPU
    (the GPU's eager path: the same casts, the same saved tensors)."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    torch.manual_seed(0)
    model = build_model(cfg)
    if checkpointing:
        from app.trainer.parallel.parallelize import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len))
    mt = mem_tracker.MemTracker()
    mt.track_external(model, opt, x, y)
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with mt:
        for _ in range(2):
            mt.reset_mod_stats()
            with cast:
                out = model(x, y)
            out.loss.backward()
            del out
            opt.step()
            opt.zero_grad(set_to_none=True)
    peak = {
        str(k.value) if hasattr(k, "value") else k: v
        for k, v in mt.get_tracker_snapshot("peak")[torch.device("cpu")].items()
    }
    model(x, y).loss.backward()
    peak["grads"] = sum(p.grad.nbytes for p in model.parameters())
    return peak


@pytest.mark.parametrize(
    "checkpointing,switches",
    [(False, {"tie_embeddings": False}), (True, {}), (False, SWITCHES), (True, SWITCHES)],
    ids=["plain-untied", "checkpointed-tied", "every-switch-untied", "every-switch-checkpointed"],
)
def test_estimate_is_within_15_percent_of_measured_cpu_allocations(checkpointing, switches):
    shape = {"vocab_size": 512, "seq_len": 128, "n_layer": 3, "d_model": 128, "n_head": 4, "n_kv_head": 2}
    cfg = ModelConfig(**shape, **switches)
    mb = 8
    m = measure(cfg, mb, checkpointing)
    e = memory.estimate(cfg, mb, "ddp", 1, checkpointing=checkpointing, cuda=False)
    print(f"\nmeasured {m}\nestimate {e.describe()}")
    assert e.weights == m["Parameter"] == 4 * count_parameters(cfg).total
    assert e.grads == m["grads"]
    assert math.isclose(e.optimizer, m["Optstate"], rel_tol=0.01)  # + AdamW's step counters
    if not checkpointing:  # with recomputation the peak falls inside backward, as gradients fill in
        assert math.isclose(e.activations, m["Activation"], rel_tol=0.15)
    assert math.isclose(e.total, m["Total"], rel_tol=0.15)
    # an underestimate picks a micro-batch that runs out of memory: never more than 5% under
    assert e.total >= 0.95 * m["Total"], (e.total, m["Total"])


def test_the_eager_estimate_under_bf16_autocast_is_what_autograd_keeps():
    """train.compile=false on a GPU: eager blocks under bf16 autocast. CPU autocast makes the same casts and
    saves the same tensors (fp32 residual and norms, bf16 linear inputs and outputs, no fp32 copy of q/k:
    RoPE's products by constant tables save nothing), so MemTracker measures what a GPU keeps, plus the
    autocast weight copies the estimate counts as buffers."""
    cfg = ModelConfig(
        vocab_size=512, seq_len=128, n_layer=3, d_model=128, n_head=4, n_kv_head=2, tie_embeddings=False
    )
    mb = 8
    m = measure(cfg, mb, False, autocast=True)
    e = memory.estimate(cfg, mb, "ddp", 1, cuda=False, autocast=True)
    weight_copies = 2 * memory.param_split(cfg).linear
    assert e.buffers == weight_copies + mb * cfg.seq_len * cfg.vocab_size * 8
    assert math.isclose(e.activations + weight_copies, m["Activation"], rel_tol=0.02), (e.describe(), m)
    compiled = memory.estimate(cfg, mb, "ddp", 1, cuda=False, autocast=True, compiled=True)
    assert compiled.activations < 0.75 * e.activations  # what compiling the blocks and the loss saves


def _saved_bytes_per_token(
    cfg: ModelConfig, micro_batch: int, autocast: bool, compiled: bool, residual: int = 4
) -> float:
    """Bytes per token that one block and the loss keep for backward (parameters and their casts aside),
    from autograd's saved-tensor hooks, which also see what a compiled graph saves. residual=2: the block
    reads a bf16 residual stream (train.activation_dtype=bf16)."""
    from app.trainer.parallel.parallelize import compile_blocks

    torch.manual_seed(0)
    model = build_model(cfg)
    if compiled:
        compile_blocks(model, "default")
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len))
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}

    def pack(t):
        per_token = t.dim() > 1 and t.shape[0] in (micro_batch, micro_batch * cfg.seq_len)
        if per_token and t.is_floating_point():  # not the weights' casts; the ids are the estimate's + 16
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    h = model.tok_emb(x).detach().to(torch.bfloat16 if residual == 2 else torch.float32).requires_grad_()
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with cast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(model.blocks[0](h, model.rope_cos, model.rope_sin), x)
    kept = sum(n for ptr, n in storages.items() if ptr not in weights)
    return kept / (micro_batch * cfg.seq_len)


@pytest.mark.slow  # compiles a block and the loss twice (about 30 s on 2 cores)
@pytest.mark.parametrize(
    "autocast,residual", [(False, 4), (True, 4), (True, 2)], ids=["fp32", "bf16-autocast", "bf16-residual"]
)
def test_the_compiled_estimate_is_what_the_compiled_graphs_keep(autocast, residual):
    """train.compile on (the GPU default): what inductor's graphs save for backward, one block and the loss,
    against the compiled estimate, with an fp32 or a bf16 residual stream (train.activation_dtype); eager's
    saved tensors against the eager one, the same way (fp32 stream: eager counts it fp32 either way)."""
    cfg = ModelConfig(vocab_size=512, seq_len=64, n_layer=1, d_model=128, n_head=4, n_kv_head=2)
    for compiled in (False, True) if residual == 4 else (True,):
        measured = _saved_bytes_per_token(cfg, 4, autocast, compiled, residual)
        estimated = memory.activation_bytes(cfg, 1, autocast, False, compiled, residual) / cfg.seq_len - 16
        assert math.isclose(measured, estimated, rel_tol=0.02), (compiled, measured, estimated)
    if residual == 2:  # the fp32 stream's estimate is above it by the stream's saved copies
        fp32_stream = memory.activation_bytes(cfg, 1, autocast, False, True) / cfg.seq_len - 16
        assert fp32_stream > estimated


# oneDNN off: on a CPU with native bf16 (AVX512-BF16, AMX) a bf16 matmul goes through oneDNN, whose scratch
# buffers are the CPU library's and would be counted as the loss's (no GPU kernel has them)
@torch.backends.mkldnn.flags(enabled=False)
def _loss_bytes(cfg: ModelConfig, micro_batch: int, autocast: bool, compiled: bool) -> tuple[int, int]:
    """(bytes the loss keeps after its forward, its backward's peak above that) for one micro-batch: the CPU
    allocator's running total as torch's profiler records it with every allocation, which also sees the
    buffers inductor's generated code allocates (MemTracker follows the dispatcher and misses them)."""
    from torch._C._profiler import _EventType
    from torch.profiler import profile

    torch.manual_seed(0)
    model = build_model(cfg)
    loss = torch.compile(model.loss, fullgraph=True, dynamic=False) if compiled else model.loss
    h = torch.randn(micro_batch, cfg.seq_len, cfg.d_model, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len))
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with cast:
        first = loss(h, targets)  # compiles
    first.backward()
    h.grad = None
    model.zero_grad(set_to_none=True)
    marker = 12345  # an allocation of a size nothing else has: where the backward starts
    with profile(profile_memory=True) as prof:
        with cast:
            out = loss(h, targets)
        torch.empty(marker, dtype=torch.uint8)
        out.backward()
    allocations = []

    def walk(events):
        for e in events:
            if e.tag == _EventType.Allocation:
                allocations.append(
                    (e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated)
                )
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    allocations.sort()
    start = allocations[0][2] - allocations[0][1]
    at = next(i for i, (_, size, _) in enumerate(allocations) if size == marker)
    backward_start = allocations[at][2] - marker
    backward_peak = max(total for _, _, total in allocations[at + 1 :])
    return backward_start - start, backward_peak - backward_start - marker


@pytest.mark.parametrize(
    "compiled,softcap,autocast",
    [
        (False, 0.0, True),
        (True, 0.0, True),  # the GPU default; each compiled case compiles the loss twice (10-20 s on CPU)
        pytest.param(True, 0.0, False, marks=pytest.mark.slow),
        pytest.param(True, 15.0, True, marks=pytest.mark.slow),
    ],
    ids=["eager-bf16", "compiled-bf16", "compiled-fp32", "compiled-bf16-softcap"],
)
def test_the_logits_and_their_gradients_are_what_the_loss_allocates(compiled, softcap, autocast):
    """The read-out's terms of the estimate (the logits kept, and their gradients at the start of
    backward) against what the loss allocates on CPU, eager and compiled (train.compile, the GPU default):
    compiled cross-entropy writes the logits' gradient into the saved logits' buffer (0 bytes more, not
    eager's 8 per vocabulary entry), or with the soft-cap an fp32 intermediate and a padded gradient.
    Per token, from two micro-batch sizes, so that what does not grow with the tokens (the weights' casts,
    the head's gradient) cancels; within 0.1 byte per vocabulary entry (the d_model-wide terms)."""
    cfg = ModelConfig(
        vocab_size=4000, seq_len=64, n_layer=1, d_model=32, n_head=4, n_kv_head=2, logit_softcap=softcap
    )
    (kept_2, grads_2), (kept_4, grads_4) = (_loss_bytes(cfg, mb, autocast, compiled) for mb in (2, 4))
    tokens = 2 * cfg.seq_len
    kept, grads = (kept_4 - kept_2) / tokens, (grads_4 - grads_2) / tokens
    block_output = 4 * cfg.d_model  # the loss's input, the last block's output: the caller holds it
    estimated_kept = memory.readout_bytes(cfg, autocast, compiled) - block_output
    estimated_grads = memory.logit_grad_bytes(cfg, autocast, compiled)
    close = 0.1 * cfg.padded_vocab
    print(
        f"\nper token: kept {kept:.0f} (estimate {estimated_kept}), gradients {grads:.0f} ({estimated_grads})"
    )
    assert abs(kept - estimated_kept) < close, (kept, estimated_kept)
    assert abs(grads - estimated_grads) < close, (grads, estimated_grads)


def test_fsdp_shards_the_static_memory_and_not_the_activations():
    cfg = load_config("x1-50m").model
    P = count_parameters(cfg).total
    ddp = memory.estimate(cfg, 8, "ddp", 8, cuda=True)
    fsdp = memory.estimate(cfg, 8, "fsdp", 8, cuda=True)
    assert ddp.static == 16 * P
    assert fsdp.weights == 4 * math.ceil(P / 8) and fsdp.static == 16 * math.ceil(P / 8)
    assert fsdp.activations == ddp.activations
    ac = memory.estimate(cfg, 8, "fsdp", 8, checkpointing=True, cuda=True)
    assert ac.activations < fsdp.activations  # x1-50m: the 50257-token logits dominate either way
    one = memory.estimate(cfg, 8, "fsdp", 1, cuda=True)  # nothing to shard: trains unsharded
    assert one.static == ddp.static


SEED_TABLE_GB = {48: 60, 64: 75, 80: 95}  # char-level family, micro-batch 4, seq 2048, 8 GPUs


def test_seed_table_plausibility(capsys):
    """The seed's per-GPU figures against this estimate. The seed calls its depth-64 model 4.3B; the
    char-d64 preset (d4096, as the issue specifies) is 12.9B. A 4.3B reading (d2368) under FSDP without
    activation checkpointing lands within 15% of every row; the 12.9B preset needs activation
    checkpointing to fit 80 GB, and then sits at about half the seed's figures. docs/parallel.md."""
    rows = []
    for depth, seed_gb in SEED_TABLE_GB.items():
        preset = load_config("char-d64", overrides=[f"model.n_layer={depth}"])
        assert preset.train.activation_checkpointing and preset.train.micro_batch_size == 4
        fsdp_ac = memory.estimates(preset, 8, cuda=True)["fsdp"]
        ddp = memory.estimates(preset, 8, cuda=True)["ddp"]
        preset.train.activation_checkpointing = False
        fsdp_full = memory.estimates(preset, 8, cuda=True)["fsdp"]
        # the seed's figures are eager ones (its trainer did not compile): compared with the eager estimate
        small = load_config(
            "char-d64", overrides=[f"model.n_layer={depth}", "model.d_model=2368", "train.compile=false"]
        )
        small.train.activation_checkpointing = False
        seedlike = memory.estimates(small, 8, cuda=True)["fsdp"]
        rows.append((depth, seed_gb, seedlike, fsdp_ac, fsdp_full, ddp))

        assert math.isclose(seedlike.total / GB, seed_gb, rel_tol=0.15), (depth, seedlike.describe())
        assert 0.4 * seed_gb < fsdp_ac.total / GB < 0.9 * 80  # fits an 80 GB GPU with headroom
        # why the preset shards and checkpoints: without either it leaves no headroom on an 80 GB GPU
        assert fsdp_full.total / GB > 0.9 * 80 and ddp.total / GB > 80
        if depth == 64:
            assert 4.2e9 < count_parameters(small.model).total < 4.4e9
    with capsys.disabled():
        print("\ndepth  seed GB | 4.3B-like FSDP | preset FSDP+AC | preset FSDP | preset DDP  (GB per GPU)")
        for depth, seed_gb, s, a, f, d in rows:
            print(
                f"{depth:5d}  {seed_gb:7d} | {s.total / GB:14.1f} | {a.total / GB:14.1f} | "
                f"{f.total / GB:11.1f} | {d.total / GB:10.1f}"
            )


def _cfg(preset: str, *overrides: str):
    cfg = load_config(preset, overrides=list(overrides))
    cfg.model.vocab_size = cfg.model.vocab_size or 2048
    return cfg


@pytest.mark.parametrize(
    "preset,world,device_gb,want",
    [
        ("char-d64", 8, 80, "fsdp"),  # 12.9B: DDP needs ~250 GB per GPU
        ("char-d64", 8, 1000, "ddp"),  # a device big enough for DDP keeps DDP
        ("char-d64", 1, 80, "ddp"),  # one process: nothing to shard
        ("x1-50m", 8, 80, "ddp"),  # small models stay on DDP
        ("x1-50m", 2, 2, "fsdp"),  # ... unless the device is tiny
        ("char-d64", 8, 0, "ddp"),  # CPU / unknown device: assume DDP fits
    ],
)
def test_auto_picks_each_mode_where_it_should(preset, world, device_gb, want):
    fixed = ["train.micro_batch_size=16"] if preset == "x1-50m" else []  # its size before `auto`
    cfg = _cfg(preset, "train.parallel=auto", f"train.device_memory_gb={device_gb}", *fixed)
    choice = memory.plan(cfg, world, torch.device("cpu"))
    assert choice.mode == want, choice.reason
    assert choice.device_bytes == (int(device_gb * GB) if device_gb else None)


def test_explicit_modes_are_kept_and_gpu_types_give_the_memory():
    cfg = _cfg("char-d64", "train.parallel=ddp", "budget.gpu_type=h100-sxm")
    assert memory.device_memory_bytes(cfg)[0] == 85 * GB  # an 80 GiB H100 as its driver reports it
    assert memory.plan(cfg, 8).mode == "ddp"
    cfg.train.parallel = "fsdp"
    assert memory.plan(cfg, 8).mode == "fsdp"
    d, f = memory.estimates(cfg, 8, cuda=True).values()
    mode, reason = memory.choose("auto", d, f, 80 * GB, 8)
    assert mode == "fsdp" and "DDP needs" in reason


def test_print_config_shows_the_estimate_at_the_planned_world_size(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (
        cli_main(
            [
                "train",
                "--preset",
                "char-d64",
                "--gpus",
                "8",
                "--set",
                "budget.gpu_type=h100-sxm",
                "--print-config",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "# memory per GPU at world size 8 (CUDA, bf16; micro-batch 4 x seq 2048" in out
    assert "#   FSDP x8: " in out and "#   DDP x8: " in out
    assert "train.parallel=auto -> fsdp" in out
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert cli_main(["train", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "world size 4 (CPU, fp32" in out and "train.parallel=ddp -> ddp" in out
