"""The optimizer: which parameters go to which group, per-group LRs under the schedule, Muon under FSDP2
equal to the single-process update bit for bit, exact resume with Muon, and resuming another mode."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from app.config import ModelConfig, OptimConfig, ScheduleConfig
from app.errors import UserError
from app.trainer.checkpoint import store as ckpt
from app.trainer.checkpoint.state import load_into
from app.trainer.checkpoint.writer import CheckpointWriter
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer, fit_state, param_groups, set_lr
from app.trainer.optimization.schedule import lr_at
from tests.conftest import CLASSIC, FAST, REPO, cli_env, losses_by_step, pretrain, torchrun
from tests.test_resume import assert_same_run

CPU = torch.device("cpu")
MUON = ["--set", "optim.name=muon", "--set", "optim.matrix_lr=0.004", "--set", "optim.embedding_lr=0.01"]


def small(tie: bool = False) -> ModelConfig:
    return ModelConfig(
        vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, tie_embeddings=tie
    )


def names_by_group(model, cfg: OptimConfig) -> dict[str, tuple[str, set[str]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        g["name"]: (g["optimizer"], {names[id(p)] for p in g["params"]}) for g in param_groups(model, cfg)
    }


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tie):
    model = build_model(small(tie))
    groups = names_by_group(model, OptimConfig(name="muon"))
    kind, matrices = groups["matrix"]
    assert kind == "muon"
    assert matrices == {
        f"blocks.{b}.{m}.weight"
        for b in range(2)
        for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")
    }
    assert groups["embedding"] == ("adamw", {"tok_emb.weight"})
    assert groups["other"] == (
        "adamw",
        {"norm.weight"} | {f"blocks.{b}.{n}.weight" for b in range(2) for n in ("attn_norm", "mlp_norm")},
    )
    if tie:
        assert "head" not in groups  # the tied head is the embedding: one tensor, one group
    else:
        assert groups["head"] == ("adamw", {"head.weight"})
    # every trainable parameter is in exactly one group
    seen = [n for _, ns in groups.values() for n in ns]
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())
    # AdamW mode: the same groups, all AdamW; decay on matrices and the head only
    adamw = param_groups(model, OptimConfig(name="adamw", weight_decay=0.1))
    assert {g["optimizer"] for g in adamw} == {"adamw"}
    assert {g["name"]: g["weight_decay"] for g in adamw} == {
        "matrix": 0.1,
        "embedding": 0.0,
        "other": 0.0,
        **({} if tie else {"head": 0.1}),
    }


def test_each_group_follows_the_schedule_from_its_own_peak():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, matrix_lr=4e-3, embedding_lr=1e-2, head_lr=5e-4)
    opt = build_optimizer(build_model(small()), cfg, CPU)
    sched = ScheduleConfig(name="cosine", warmup_steps=10)
    for step, want_scale in [(0, 0.1), (9, 1.0), (1000, 0.1)]:  # warmup start, peak, floor (min_lr / lr)
        lr = lr_at(step, sched, cfg, 1000)
        assert lr == pytest.approx(1e-3 * want_scale)
        set_lr(opt, lr)
        got = {g["name"]: g["lr"] for g in opt.param_groups}
        peaks = {"matrix": 4e-3, "embedding": 1e-2, "head": 5e-4, "other": 1e-3}
        assert got == pytest.approx({k: v * want_scale for k, v in peaks.items()})
    # default: every group at optim.lr, exactly (old runs resume bit-identically)
    opt = build_optimizer(build_model(small()), OptimConfig(lr=3e-4), CPU)
    set_lr(opt, 2.5e-4)
    assert {g["lr"] for g in opt.param_groups} == {2.5e-4}


def test_print_config_lists_the_groups():
    proc = pretrain("train", *FAST, *MUON, "--print-config")
    assert proc.returncode == 0, proc.stderr
    lines = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith("#   matrix") or line.startswith("#   embedding")
    ]
    assert len(lines) == 2
    assert "Muon" in lines[0] and "blocks.*.attn.wq.weight" in lines[0] and "lr 0.004" in lines[0]
    assert "AdamW" in lines[1] and "tok_emb.weight" in lines[1] and "lr 0.01" in lines[1]


def _step(model, opt, seed):
    torch.manual_seed(seed)
    x = torch.randint(0, 64, (2, 16))
    model(x, x).loss.backward()
    opt.step()
    opt.zero_grad()


def named_state(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
        for p, st in opt.state.items()
    }


def roundtrip(run, step, model, saved_with, loaded_into) -> list[str]:
    """A real checkpoint written with one optimizer and resumed into another; the loader's notes."""
    CheckpointWriter(run, 0, 1).save(step, model, saved_with, {"step": step}, {})
    return load_into(ckpt.resolve_latest(run), model, loaded_into)


def test_resuming_adamw_state_with_muon_converts_and_back_restarts_the_moments(tmp_path):
    model = build_model(small())
    adamw = build_optimizer(model, OptimConfig(), CPU)
    _step(model, adamw, 0)
    saved = named_state(model, adamw)
    muon = build_optimizer(model, OptimConfig(name="muon"), CPU)
    notes = roundtrip(tmp_path / "a", 1, model, adamw, muon)
    assert len(notes) == 1 and "14 matrices move to Muon" in notes[0]
    now = named_state(model, muon)
    name = "blocks.0.attn.wq.weight"
    assert set(now[name]) == {"momentum_buffer"}
    assert torch.equal(now[name]["momentum_buffer"], saved[name]["exp_avg"])
    assert torch.equal(now["tok_emb.weight"]["exp_avg_sq"], saved["tok_emb.weight"]["exp_avg_sq"])
    _step(model, muon, 1)
    # and back: Muon has no second moment, so AdamW restarts those matrices (and says so)
    back = build_optimizer(model, OptimConfig(), CPU)
    notes = roundtrip(tmp_path / "b", 2, model, muon, back)
    assert len(notes) == 1 and notes[0].startswith("warning:") and "from zero" in notes[0]
    entry = named_state(model, back)[name]
    assert float(entry["step"]) == 0 and not entry["exp_avg"].any()
    _step(model, back, 2)
    # state from another optimizer entirely is refused in one line
    bogus = {"state": {name: {"square_avg": torch.zeros(1)}}, "param_groups": []}
    with pytest.raises(UserError, match="blocks.0.attn.wq.weight"):
        fit_state(bogus, back, model)


# ---------------------------------------------------------------- Muon: torch's update, and a skip that copies nothing


def _muon_pair(adjust: str, shapes=((24, 40), (72, 24))):
    """ShardedMuon and torch.optim.Muon on equal copies of a wide and a tall matrix (torch transposes a tall
    one for Newton-Schulz), with weight decay and Nesterov, as optim.name=muon builds them."""
    from app.trainer.optimization.optimizer import ShardedMuon

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "adjust_lr_fn": adjust}
    return ours, theirs, ShardedMuon(ours, **kw), torch.optim.Muon(theirs, **kw)


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_sharded_muon_in_one_process_is_torch_muon_bit_for_bit(adjust):
    """ShardedMuon claims the lines of torch's _single_tensor_muon: weights and momentum buffers equal torch's
    bit for bit, stepped without `found_inf` (a non-fused AdamW beside it), with it clear (fused AdamW: every
    step), and with it set on a non-finite gradient, which torch's Muon would not step at all; the momentum
    changes per step (optim.muon_momentum_end's schedule sets it)."""
    ours, theirs, o_ours, o_theirs = _muon_pair(adjust)
    for step, found_inf in enumerate([None, None, 0.0, 1.0, 0.0, 1.0, 0.0]):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.randn(a.shape, generator=g)
            if found_inf:
                grad.view(-1)[step] = float("nan")
            a.grad = grad.clone()
            b.grad = grad.clone()
        for group in (*o_ours.param_groups, *o_theirs.param_groups):
            group["momentum"] = 0.95 - 0.01 * step
        if found_inf is not None:
            o_ours.found_inf = torch.tensor(found_inf)
        o_ours.step()
        if not found_inf:
            o_theirs.step()
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), (step, found_inf)
            assert torch.equal(o_ours.state[a]["momentum_buffer"], o_theirs.state[b]["momentum_buffer"]), step


def test_the_device_side_skip_copies_no_matrix():
    """With fused AdamW `found_inf` comes with every step, so what the skip costs is paid every step: no
    matrix-sized tensor beyond what a step without it allocates, and two in-place passes per matrix (the
    gradient zeroed where non-finite, the update scaled by 0 or 1), the 0-dim weights once per group."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self, smallest: int):
            super().__init__()
            self.smallest, self.count, self.fresh = smallest, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.count += 1
            inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
            for t in out if isinstance(out, (list, tuple)) else [out]:
                big = isinstance(t, torch.Tensor) and t.numel() >= self.smallest
                self.fresh += big and t.untyped_storage().data_ptr() not in inputs
            return out

    ours, _, opt, _ = _muon_pair("match_rms_adamw", shapes=[(24, 40), (72, 24), (24, 40), (72, 24)])
    for p in ours:
        p.grad = torch.randn(p.shape)
    opt.step()  # the momentum buffers exist from here on
    runs = {}
    for found_inf in (None, 0.0):
        for p in ours:
            p.grad = torch.randn(p.shape)
        if found_inf is not None:
            opt.found_inf = torch.tensor(found_inf)
        with Ops(min(p.numel() for p in ours)) as ops:
            opt.step()
        runs[found_inf] = ops
    assert runs[0.0].fresh == runs[None].fresh, "the skip allocates a matrix-sized tensor"
    # + the 0-dim skip flag (once) and the two weights (once per group: 3 ops each)
    assert runs[0.0].count - runs[None].count <= 2 * len(ours) + 7, (runs[0.0].count, runs[None].count)


# ---------------------------------------------------------------- FSDP2: the gathered update is exact

FSDP_WORKER = """
import torch, torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
from app.config import ModelConfig, OptimConfig
from app.trainer.optimization import optimizer as optim
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer, step_unless
from app.trainer.parallel.distributed import init_distributed
from app.trainer.parallel.parallelize import shard_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

def optimizer_state_dict(model, opt):
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))

env = init_distributed("cpu")
# d_ff > d_model: some matrices are tall, the case torch's Muon transposes (and gets wrong on shards);
# d_ff odd: their rows split unevenly over 2 ranks; 3 layers: a shape's matrices do not split evenly
cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=95,
                  tie_embeddings=False)
oc = OptimConfig(name="muon", matrix_lr=0.02, embedding_lr=0.01, head_lr=0.004)
torch.manual_seed(0)
ref = build_model(cfg)
torch.manual_seed(0)
sharded = shard_model(build_model(cfg), torch.device("cpu"))
o_ref, o_sh = build_optimizer(ref, oc, torch.device("cpu")), build_optimizer(sharded, oc, torch.device("cpu"))
o_ref._children["muon"].share = None  # the reference is one process's update, not DDP's shared one
params = dict(ref.named_parameters())
calls = []
orthogonalise = optim.newton_schulz
optim.newton_schulz = lambda update, group: calls.append(tuple(update.shape)) or orthogonalise(update, group)
mine = 0
for step in range(5):
    g = torch.Generator().manual_seed(100 + step)  # the same full gradients on every rank
    bad_step = step == 3  # a non-finite gradient: both skip it on the device
    for n, p in sharded.named_parameters():
        full = torch.randn(params[n].shape, generator=g)
        if bad_step:
            full.view(-1)[0] = float("nan")
        params[n].grad = full.clone()
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)
    skip = torch.tensor(1.0 if bad_step else 0.0)
    before = {n: p.detach().clone() for n, p in params.items()}
    buffers = {n: st["momentum_buffer"].clone() for n, p in params.items() if "momentum_buffer" in (st := o_ref.state[p])}
    step_unless(o_ref, skip)
    if bad_step:
        kept = all(torch.equal(before[n], p) for n, p in params.items())
        kept &= len(buffers) == 21 and all(torch.equal(b, o_ref.state[params[n]]["momentum_buffer"]) for n, b in buffers.items())
        print(f"rank {env.rank} skipped step kept every parameter and buffer: {kept}", flush=True)
    calls.clear()
    step_unless(o_sh, skip)
    mine += len(calls)
    o_ref.zero_grad(); o_sh.zero_grad()
bad = [n for n, p in sharded.named_parameters() if not torch.equal(p.full_tensor(), params[n].detach())]
so_ref, so_sh = optimizer_state_dict(ref, o_ref), optimizer_state_dict(sharded, o_sh)
matrices = len(o_ref.param_groups[0]["params"])
if env.rank == 0:
    for n, entry in so_ref["state"].items():
        bad += [f"{n}.{k}" for k, v in entry.items() if not torch.equal(so_sh["state"][n][k], v)]
    kinds = sorted({k for e in so_sh["state"].values() for k in e})
    print("EQUAL" if not bad else f"DIFFER {bad}", kinds, flush=True)
dist.barrier()
print(f"rank {env.rank} orthogonalised {mine} of {5 * matrices}", flush=True)
dist.destroy_process_group()
"""


def test_muon_under_fsdp2_equals_the_single_process_update_with_each_rank_orthogonalising_its_share(
    tmp_path,
):
    """Two gloo ranks: FSDP2's Muon (each matrix orthogonalised on one rank, rows exchanged by all-to-all)
    gives the single-process update bit for bit, over steps with a skipped non-finite one; each rank runs
    Newton-Schulz on its share of the matrices only."""
    import subprocess

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(FSDP_WORKER))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        cwd=REPO,
        env=cli_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "EQUAL ['exp_avg', 'exp_avg_sq', 'momentum_buffer', 'step']" in proc.stdout, proc.stdout
    # 21 matrices in 4 shapes, dealt out in turns of 2: (32, 32) x 6, (16, 32) x 6 and (95, 32) x 6 go 3 to
    # each rank, (32, 95) x 3 goes 2 to rank 0 and 1 to rank 1; each of 5 steps, the skipped one too
    assert "rank 0 skipped step kept every parameter and buffer: True" in proc.stdout, proc.stdout
    assert "rank 0 orthogonalised 55 of 105" in proc.stdout, proc.stdout
    assert "rank 1 orthogonalised 50 of 105" in proc.stdout, proc.stdout


# ---------------------------------------------------------------- DDP: each rank a share, results all-gathered

DDP_WORKER = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from app.config import ModelConfig, OptimConfig
from app.trainer.optimization import optimizer as optim
from app.trainer.parallel.distributed import init_distributed
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer, step_unless

env = init_distributed("cpu")
# the FSDP test's shapes: tall (95, 32) matrices, and a shape (32, 95) whose 3 matrices do not split over 2
cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=3, d_model=32, n_head=4, n_kv_head=2, d_ff=95,
                  tie_embeddings=False)
oc = OptimConfig(name="muon", matrix_lr=0.02, embedding_lr=0.01, head_lr=0.004, weight_decay=0.1)
torch.manual_seed(0)
model = DDP(build_model(cfg), gradient_as_bucket_view=True)  # as app/trainer/parallel/parallelize.py wraps it
opt = build_optimizer(model.module, oc, torch.device("cpu"))
group = next(g for g in opt.param_groups if g["optimizer"] == "muon")
matrices = group["params"]
copies = [torch.nn.Parameter(p.detach().clone()) for p in matrices]
torch_muon = torch.optim.Muon(copies, lr=group["lr"], weight_decay=group["weight_decay"], momentum=0.95,
                              nesterov=True, adjust_lr_fn=group["adjust_lr_fn"])
stacks = []
batched = optim.newton_schulz_batched
optim.newton_schulz_batched = lambda stack, g: stacks.append(stack.shape[0]) or batched(stack, g)
for step in range(5):
    torch.manual_seed(1000 * env.rank + step)  # each rank its own batch: DDP averages the gradients
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    model(x, x).loss.backward()
    bad_step = step == 3  # a non-finite gradient: the step is skipped on the device
    if bad_step:
        matrices[0].grad.view(-1)[0] = float("nan")
    for p, c in zip(matrices, copies):
        c.grad = p.grad.clone()
    for g in (group, *torch_muon.param_groups):
        g["momentum"] = 0.95 - 0.01 * step
    step_unless(opt, torch.tensor(1.0 if bad_step else 0.0))
    if not bad_step:
        torch_muon.step()
    opt.zero_grad(); torch_muon.zero_grad()
same = all(torch.equal(p, c) for p, c in zip(matrices, copies))
same &= all(torch.equal(opt.state[p]["momentum_buffer"], torch_muon.state[c]["momentum_buffer"])
            for p, c in zip(matrices, copies))
print(f"rank {env.rank} equals torch.optim.Muon: {same}", flush=True)
mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = [torch.empty_like(mine) for _ in range(env.world_size)]
dist.all_gather(every, mine)
print(f"rank {env.rank} weights identical on every rank: {all(torch.equal(w, mine) for w in every)}", flush=True)
dist.barrier()
print(f"rank {env.rank} orthogonalised {sum(stacks)} of {5 * len(matrices)} in {len(stacks)} stacks", flush=True)
dist.destroy_process_group()
"""


def test_muon_under_ddp_shares_the_matrices_out_and_equals_torch_muon_on_every_rank(tmp_path):
    """Two gloo ranks under DDP (each its own batch, gradients averaged): each rank orthogonalises its share
    of each shape's matrices as one stack and the results are all-gathered; the matrices and momentum
    buffers equal torch.optim.Muon's bit for bit on both ranks over five steps (a skipped non-finite one
    among them), and every parameter is identical on every rank."""
    import subprocess

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(DDP_WORKER))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        cwd=REPO,
        env=cli_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} equals torch.optim.Muon: True" in proc.stdout, proc.stdout
        assert f"rank {rank} weights identical on every rank: True" in proc.stdout, proc.stdout
    # 21 matrices in 4 shapes: (32, 32) x 6, (16, 32) x 6 and (95, 32) x 6 go 3 to each rank, (32, 95) x 3
    # goes 2 to rank 0 and 1 to rank 1; one stack per shape and step (none for a rank with no share)
    assert "rank 0 orthogonalised 55 of 105 in 20 stacks" in proc.stdout, proc.stdout
    assert "rank 1 orthogonalised 50 of 105 in 20 stacks" in proc.stdout, proc.stdout


# ---------------------------------------------------------------- exact resume and mode changes, real CLI


@pytest.mark.slow  # over 8 s: `make test-slow` (CI runs it); keeps `make test` near 10 min
def test_exact_resume_with_muon(tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert pretrain("train", "--out", str(straight), "--max-steps", "12", *FAST, *MUON).returncode == 0
    assert pretrain("train", "--out", str(halves), "--max-steps", "6", *FAST, *MUON).returncode == 0
    second = pretrain("train", "--out", str(halves), "--max-steps", "12", *FAST, *MUON)
    assert second.returncode == 0 and "resumed from" in second.stdout
    assert_same_run(straight, halves, 12)


@pytest.mark.slow  # over 8 s: `make test-slow` (CI runs it); keeps `make test` near 10 min
def test_an_adamw_checkpoint_resumes_under_muon(tmp_path):
    run = tmp_path / "run"
    # the first run on the AdamW recipe (SwiGLU: 7 matrices a block), then Muon
    assert pretrain("train", "--out", str(run), "--max-steps", "3", *FAST, *CLASSIC).returncode == 0
    proc = pretrain("train", "--out", str(run), "--max-steps", "5", *FAST, *CLASSIC, *MUON)
    assert proc.returncode == 0, proc.stderr
    assert "trained with AdamW; 14 matrices move to Muon" in proc.stdout
    assert max(losses_by_step(run)) == 5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_exact_resume_with_muon_on_two_ranks(tmp_path, mode):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    extra = [*FAST, *MUON, "--set", f"train.parallel={mode}", "--set", f"train.batch_tokens={8 * 64 * 2 * 2}"]
    assert torchrun("--out", str(straight), "--max-steps", "8", *extra).returncode == 0
    assert torchrun("--out", str(halves), "--max-steps", "4", *extra).returncode == 0
    resumed = torchrun("--out", str(halves), "--max-steps", "8", *extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(straight, halves, 8)


@pytest.mark.slow
def test_muon_fsdp_training_follows_ddp(tmp_path):
    runs = {}
    for mode in ("ddp", "fsdp"):
        runs[mode] = tmp_path / mode
        proc = torchrun(
            "--out", str(runs[mode]), "--max-steps", "6", *FAST, *MUON, "--set", f"train.parallel={mode}"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = losses_by_step(runs["ddp"]), losses_by_step(runs["fsdp"])
    for s in range(1, 7):
        assert a[s] == pytest.approx(b[s], rel=1e-4), (s, a[s], b[s])
