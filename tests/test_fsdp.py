"""FSDP2 with real torchrun on CPU (gloo): same losses as DDP, full-weight checkpoints, exact resume, and
checkpoints that move between DDP and FSDP and between world sizes (4 -> 2, 2 -> 4 ranks)."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch

from app.config import ModelConfig, OptimConfig
from app.errors import ConfigError
from app.trainer.checkpoint import store as ckpt
from app.trainer.checkpoint.state import model_pieces, optimizer_pieces
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer
from tests.conftest import CLASSIC, full_optimizer_state, losses_by_step, pretrain, torchrun
from tests.conftest import FAST as SMALL

# The small model on the AdamW recipe: these tests check FSDP against one process and name AdamW state and
# the layer counts of a SwiGLU model (distributed Muon has its own tests in test_optim.py)
FAST = [*SMALL, *CLASSIC]
MICRO = 8 * 64  # FAST: micro-batch 8 x seq 64 tokens


def step_dir(run, step):
    return run / "checkpoints" / f"step_{step:06d}"


def weights(run, step):
    return ckpt.load_model_state(ckpt.verify(step_dir(run, step))[0])


def optimizer_by_name(run, step) -> dict[str, dict[str, torch.Tensor]]:
    """{param name: {state name: tensor}} of a checkpoint, whatever order the keys were written in."""
    info = ckpt.verify(step_dir(run, step))[0]
    state = full_optimizer_state(info)
    return state["state"]


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def assert_close_losses(a, b, steps, rtol):
    for s in steps:
        assert math.isclose(a[s], b[s], rel_tol=rtol), f"step {s}: {a[s]} vs {b[s]}"


# ---------------------------------------------------------------- fast: one FSDP run, several checks


@pytest.fixture(scope="module")
def fsdp_auto_run(tmp_path_factory):
    """2 ranks, train.parallel=auto with a device too small for DDP: auto must pick FSDP. 10 MB: the
    sharded weights, gradients and optimizer state (about 2 MB per rank) fit, so the start does not refuse
    the model (planning.check_size); DDP with its activations (about 22 MB) does not."""
    run = tmp_path_factory.mktemp("fsdp") / "run"
    proc = ok(
        torchrun(
            "--out",
            str(run),
            "--max-steps",
            "3",
            *FAST,
            "--set",
            "train.parallel=auto",
            "--set",
            "train.device_memory_gb=0.01",
        )
    )
    return run, proc


def test_auto_picks_fsdp_and_matches_one_process_on_the_same_data(fsdp_auto_run, tmp_path):
    run, proc = fsdp_auto_run
    assert "parallel: fsdp" in proc.stdout
    # One process with a micro-batch of 16 reads exactly the samples the two ranks read (8 each).
    single = tmp_path / "single"
    ok(
        pretrain(
            "train", "--out", str(single), "--max-steps", "3", *FAST, "--set", "train.micro_batch_size=16"
        )
    )
    assert_close_losses(losses_by_step(run), losses_by_step(single), range(1, 4), rtol=1e-5)
    # The FSDP checkpoint holds the full weights and full, name-keyed optimizer state.
    w_fsdp, w_one = weights(run, 3), weights(single, 3)
    assert w_fsdp.keys() == w_one.keys()
    for k in w_one:
        assert w_fsdp[k].shape == w_one[k].shape
        torch.testing.assert_close(w_fsdp[k], w_one[k], rtol=1e-4, atol=1e-6)
    meta = json.loads((step_dir(run, 3) / "meta.json").read_text())
    assert meta["tied"] == {"head.weight": "tok_emb.weight"} and meta["world_size"] == 2
    opt_fsdp, opt_one = optimizer_by_name(run, 3), optimizer_by_name(single, 3)
    assert set(opt_fsdp) == set(opt_one) and "blocks.0.attn.wq.weight" in opt_fsdp
    for name in opt_one:
        assert opt_fsdp[name]["exp_avg"].shape == opt_one[name]["exp_avg"].shape


def test_sample_reads_an_fsdp_checkpoint(fsdp_auto_run):
    run, _ = fsdp_auto_run
    proc = ok(pretrain("sample", "--checkpoint", str(run), "--max-new-tokens", "8", "--prompt", "ROMEO"))
    assert proc.stdout.startswith("ROMEO")


def test_an_fsdp_checkpoint_resumes_in_one_process(fsdp_auto_run, tmp_path):
    run, _ = fsdp_auto_run
    out = tmp_path / "one"
    proc = ok(
        pretrain(
            "train",
            "--out",
            str(out),
            "--resume",
            str(step_dir(run, 3)),
            "--max-steps",
            "4",
            *FAST,
            "--set",
            "train.micro_batch_size=16",
        )
    )
    assert "resharding: checkpoint of world size 2 on 1" in proc.stdout
    assert "step 4/4" in proc.stdout


def test_fp8_is_refused_on_cpu_in_one_line(tmp_path):
    proc = pretrain(
        "train", "--out", str(tmp_path / "r"), "--max-steps", "1", *FAST, "--set", "train.fp8=true"
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.fp8" in lines[0] and "CPU" in lines[0]
    from app.trainer.parallel.fp8 import check_fp8_device

    with pytest.raises(ConfigError, match="compute capability"):
        check_fp8_device(torch.device("cpu"))


def test_max_autotune_under_fsdp_compiles_without_cuda_graphs():
    """CUDA graphs (max-autotune) do not survive FSDP2's per-block gathers: the same autotuning without them."""
    from app.trainer.parallel.runtime import compile_mode_for

    said = []
    assert compile_mode_for("max-autotune", True, said.append) == "max-autotune-no-cudagraphs"
    assert len(said) == 1 and "max-autotune-no-cudagraphs" in said[0] and "FSDP" in said[0]
    for mode in ("default", "max-autotune-no-cudagraphs"):
        assert compile_mode_for(mode, True, said.append) == mode
    assert compile_mode_for("max-autotune", False, said.append) == "max-autotune"  # DDP / one process
    assert len(said) == 1


META_WORKER = """
import torch, torch.distributed as dist
from app.config import load_config
from app.trainer.optimization.optimizer import build_optimizer
from app.trainer.parallel.distributed import init_distributed
from app.trainer.parallel.parallelize import build_parallel_model, unwrap

env = init_distributed("cpu")
cfg = load_config(overrides=["model.vocab_size=256", "model.n_layer=2", "model.d_model=64", "model.n_head=4",
                             "model.seq_len=32"])
torch.manual_seed(0)
model = build_parallel_model(cfg, env, torch.device("cpu"), "fsdp", log=lambda m: None, meta_init=True)
local = unwrap(model).blocks[0].attn.wq.weight.to_local()
assert local.shape == (32, 64) and local.device.type == "cpu", local.shape
full = {k: v.full_tensor() for k, v in unwrap(model).state_dict().items()}  # collective, test only
opt = build_optimizer(unwrap(model), cfg.optim, torch.device("cpu"))
torch.manual_seed(1)
x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
losses = []
for _ in range(5):
    loss = model(x, y).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(float(loss))
if env.rank == 0:
    wq = full["blocks.0.attn.wq.weight"]
    assert not torch.equal(wq[:32], wq[32:]), "the two ranks drew the same shard"
    assert 0.015 < float(wq.std()) < 0.025, float(wq.std())
    assert bool((full["norm.weight"] == 1).all())
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.3, losses
    assert losses[-1] < losses[0] - 0.1, losses
    print("META_OK", losses)
dist.destroy_process_group()
"""


def test_meta_device_init_materializes_only_shards_with_a_sane_init(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(META_WORKER))
    proc = torchrun(str(script))
    assert proc.returncode == 0 and "META_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# ---------------------------------------------------------------- fast: the state-dict seam in one process


def _trained(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2)
    model = build_model(cfg)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    x = torch.randint(0, 64, (2, 16))
    model(x, x).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_pieces_cover_every_tensor_once_keyed_by_parameter_name():
    """The checkpoint seam without FSDP: each of 2 (DDP) ranks hands over a disjoint share of the rows of
    every tensor, together exactly the tensor; tied weights once; optimizer state as "<name>/<state>"."""
    model, opt = _trained()
    full = model.state_dict()
    rows: dict[str, list] = {}
    for rank in range(2):
        pieces, aliases = model_pieces(model, rank, 2)
        assert aliases == {"head.weight": "tok_emb.weight"}
        for p in pieces:
            assert p.shape == tuple(full[p.name].shape)
            rows.setdefault(p.name, []).append((p.offsets[0], p.tensor))
    assert set(rows) == set(full) - {"head.weight"}
    for name, parts in rows.items():
        assert torch.equal(torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])]), full[name]), name
    pieces, structure = optimizer_pieces(model, opt, 0, 1)
    names = {p.name for p in pieces}
    assert {"blocks.1.mlp.w_down.weight/exp_avg", "tok_emb.weight/exp_avg_sq", "norm.weight/step"} <= names
    assert all(isinstance(p, str) for g in structure["param_groups"] for p in g["params"])
    on_rank1 = {p.name for p in optimizer_pieces(model, opt, 1, 2)[0]}
    assert "norm.weight/exp_avg" in on_rank1 and "norm.weight/step" not in on_rank1  # 0-d: rank 0 alone


# ---------------------------------------------------------------- slow: DDP parity, exact resume, resharding

GLOBAL = ["--set", f"train.batch_tokens={4 * MICRO}"]  # 4 micro-batches per step: 2 ranks x 2, 4 ranks x 1
K = 3  # checkpoint step; runs go to 2K


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Straight runs to 2K steps with a checkpoint at K: FSDP (with activation checkpointing) and DDP on
    2 ranks, FSDP on 4 ranks; all with the same global batch."""
    root = tmp_path_factory.mktemp("straight")
    runs = {}
    for name, nproc, extra in [
        ("fsdp2", 2, ["--set", "train.parallel=fsdp", "--set", "train.activation_checkpointing=true"]),
        ("ddp2", 2, ["--set", "train.parallel=ddp"]),
        ("fsdp4", 4, ["--set", "train.parallel=fsdp"]),
    ]:
        runs[name] = root / name
        ok(
            torchrun(
                "--out",
                str(runs[name]),
                "--max-steps",
                str(2 * K),
                *FAST,
                *GLOBAL,
                "--set",
                f"checkpoint.every_steps={K}",
                *extra,
                nproc=nproc,
            )
        )
    return runs


@pytest.mark.slow
def test_fsdp_with_accumulation_and_checkpointing_matches_ddp(straight):
    a, b = losses_by_step(straight["fsdp2"]), losses_by_step(straight["ddp2"])
    assert_close_losses(a, b, range(1, 2 * K + 1), rtol=1e-5)
    wa, wb = weights(straight["fsdp2"], 2 * K), weights(straight["ddp2"], 2 * K)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_exact_resume_under_fsdp(straight, tmp_path):
    halves = tmp_path / "halves"
    common = [*FAST, *GLOBAL, "--set", "train.parallel=fsdp", "--set", "train.activation_checkpointing=true"]
    ok(torchrun("--out", str(halves), "--max-steps", str(K), *common))
    resumed = ok(torchrun("--out", str(halves), "--max-steps", str(2 * K), *common))
    assert "resumed from" in resumed.stdout
    ref = straight["fsdp2"]
    wa, wb = weights(ref, 2 * K), weights(halves, 2 * K)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs"
    la, lb = losses_by_step(ref), losses_by_step(halves)
    assert [la[s] for s in range(1, 2 * K + 1)] == [lb[s] for s in range(1, 2 * K + 1)]
    oa, ob = optimizer_by_name(ref, 2 * K), optimizer_by_name(halves, 2 * K)
    for name in oa:
        assert all(torch.equal(oa[name][k], ob[name][k]) for k in oa[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "src,nproc,mode",
    [("fsdp4", 2, "ddp"), ("fsdp2", 4, "fsdp")],
    ids=["4-fsdp-to-2-ddp", "2-fsdp-to-4-fsdp"],
)
def test_resume_onto_another_world_size(straight, tmp_path, src, nproc, mode):
    """Load a checkpoint on another world size (and mode), save it again at once: identical files. Then
    train on: the losses follow the straight run to float rounding (the reduction order changed)."""
    out = tmp_path / "resharded"
    common = [*FAST, *GLOBAL, "--set", f"train.parallel={mode}"]
    first = ok(
        torchrun(
            "--out",
            str(out),
            "--resume",
            str(step_dir(straight[src], K)),
            "--max-steps",
            str(K),
            *common,
            nproc=nproc,
        )
    )
    src_world = 4 if src == "fsdp4" else 2
    assert f"resharding: checkpoint of world size {src_world} on {nproc}" in first.stdout
    wa, wb = weights(straight[src], K), weights(out, K)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = optimizer_by_name(straight[src], K), optimizer_by_name(out, K)
    assert oa.keys() == ob.keys()
    for name in oa:
        assert all(torch.equal(oa[name][k], ob[name][k]) for k in oa[name]), name
    trainer_state = json.loads((step_dir(out, K) / "trainer_state.json").read_text())
    assert trainer_state["loader"]["samples"] == K * 4 * 8  # the same global sample, any world size

    ok(torchrun("--out", str(out), "--max-steps", str(2 * K), *common, nproc=nproc))
    la, lb = losses_by_step(straight[src]), losses_by_step(out)
    assert_close_losses(la, lb, range(K + 1, 2 * K + 1), rtol=1e-4)
    wa, wb = weights(straight[src], 2 * K), weights(out, 2 * K)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)


def test_a_gpu_rank_binds_its_device_before_joining_nccl(monkeypatch):
    """NCCL ranks set their GPU, then join the group with device_id (eager, bound communicator). No GPU
    here: the CUDA and NCCL calls are recorded, not run; the gloo path is every other test's."""
    import torch.distributed as dist

    from app.trainer.parallel import distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist, "init_process_group", lambda **kw: calls.append(("init", kw["backend"], kw["device_id"]))
    )
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append(("group", kw["backend"])))
    monkeypatch.setattr(distributed, "_CONTROL_GROUP", None)
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    env = distributed.init_distributed("cuda")
    assert env.local_rank == 1
    assert calls == [("set_device", 1), ("init", "nccl", torch.device("cuda", 1)), ("group", "gloo")]
    calls.clear()
    distributed.init_distributed("cpu")
    assert calls == [("init", "gloo", None)]


FSDP_WIRING_WORKER = """
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.fsdp import FSDPModule
from app.config import load_config
from app.trainer.parallel.distributed import init_distributed
from app.trainer.optimization.optimizer import build_optimizer
from app.trainer.parallel.parallelize import build_parallel_model, clip_grad_norm

prefetch = {"forward": [], "backward": []}
for kind in prefetch:
    original = getattr(FSDPModule, f"set_modules_to_{kind}_prefetch")
    def record(self, modules, kind=kind, original=original):
        prefetch[kind].append((self, modules))
        return original(self, modules)
    setattr(FSDPModule, f"set_modules_to_{kind}_prefetch", record)

env = init_distributed("cpu")
over = ["model.n_layer=3", "model.d_model=64", "model.n_head=4", "model.n_kv_head=2", "model.seq_len=32",
        "model.vocab_size=256", "train.parallel=fsdp", "train.fp8=emulate"]
cfg = load_config(overrides=over)
model = build_parallel_model(cfg, env, torch.device("cpu"), "fsdp", log=lambda line: None)
blocks = list(model.blocks)
order = [(blocks.index(a), [blocks.index(m) for m in ms]) for a, ms in prefetch["forward"]]
back = [(blocks.index(a), [blocks.index(m) for m in ms]) for a, ms in prefetch["backward"]]
print(f"rank {env.rank} prefetch forward {order} backward {back}", flush=True)
optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(env.rank))
loss = model(x, x).loss
gathered = [not isinstance(b.attn.wq.weight, DTensor) for b in blocks]
print(f"rank {env.rank} gathered after forward {gathered}", flush=True)
loss.backward()
saved = [p.grad.full_tensor().clone() for p in model.parameters()]
with CommDebugMode() as comm:
    norm = clip_grad_norm(model, 0.5)
ours = comm.get_total_counts()
clipped = [p.grad.full_tensor() for p in model.parameters()]
for p, g in zip(model.parameters(), saved):
    p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
with CommDebugMode() as comm:
    reference = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).full_tensor()
same = torch.equal(norm, reference) and all(torch.equal(a, p.grad.full_tensor()) for a, p in zip(clipped, model.parameters()))
print(f"rank {env.rank} clip collectives {ours} vs {comm.get_total_counts()}, same {same}", flush=True)
hooks = len(optimizer._optimizer_step_post_hooks)
f8 = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
fsdp_f8 = all(m.config.enable_fsdp_float8_all_gather for m in f8)
optimizer.step()
print(f"rank {env.rank} fp8 layers {len(f8)} gathered in float8 {fsdp_f8} scale hooks {hooks}", flush=True)
loss = model(x, x).loss
loss.backward()
print(f"rank {env.rank} second step loss finite {bool(torch.isfinite(loss))}", flush=True)
dist.destroy_process_group()
"""


def test_fsdp2_wiring_last_block_kept_gathered_prefetch_one_clip_collective_and_fp8_gathers(tmp_path):
    """On 2 gloo ranks, through build_parallel_model: the last block keeps its parameters gathered after
    forward (the others reshard), each block prefetches its neighbour explicitly, gradient clipping
    reduces the norm exactly once with clip_grad_norm_'s result, and FP8 weights
    are all-gathered in float8 with their scales precomputed after each optimizer step. Whether the
    prefetch overlaps compute and what float8 gathers save need GPUs (`make gpu-check`)."""

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(FSDP_WIRING_WORKER))
    proc = torchrun(str(script))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    for rank in (0, 1):
        assert f"rank {rank} prefetch forward [(0, [1]), (1, [2])] backward [(1, [0]), (2, [1])]" in out, out
        assert f"rank {rank} gathered after forward [False, False, True]" in out, out
        assert (
            f"rank {rank} clip collectives 1 vs " in out and f"rank {rank} clip collectives 1 vs 0" not in out
        )
        assert ", same True" in out, out
        # 3 blocks x (wq wk wv wo, and the ReLU² MLP's w_up): the head and w_down stay in bf16
        assert f"rank {rank} fp8 layers 15 gathered in float8 True scale hooks 1" in out, out
        assert f"rank {rank} second step loss finite True" in out, out
