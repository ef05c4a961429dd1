"""Peer benchmark: pretrain's GPT against LitGPT's (PyPI `litgpt`) at identical shapes, trained
step-for-step in one process on CPU, interleaved round by round; prints pretrain / LitGPT throughput.

Shapes: vocab 2048, 4 layers, d_model 192, 6 heads (MHA), SwiGLU hidden = pretrain's ffn_dim (512),
RMSNorm, RoPE on the full head dim, no biases, tied embeddings, seq 128, batch 32, fp32, eager (no
torch.compile: pretrain's default; LitGPT's pretrain.py compiles, which is left out here), the same
torch.set_num_threads (PEER_THREADS, default 1: see THREADS). LitGPT's weights are copied from
pretrain's, so both start equal and see the same random token batches: the first loss and the loss
after the model-only steps are printed as a check that they do the same work.

Two ratios, each the median (and range) of per-round ratios, a round timing STEPS steps of each model
(order alternating; each segment's first step and WARMUP steps up front are excluded), as tokens per
CPU-second of this process (steady under other load with one thread) and per wall second:
  model only:     the same loop for both: loss = F.cross_entropy over all logits (pretrain: its
                  model's own loss), backward, clip_grad_norm_(1.0), torch AdamW(lr 1e-3, wd 0.1,
                  fused=PEER_FUSED), zero_grad.
  as each ships:  pretrain: its model's loss and app.trainer.optimization.optimizer.build_optimizer (default OptimConfig;
                  the AdamW's fused flag is printed); LitGPT: litgpt.pretrain's CPU setup:
                  instantiate_torch_optimizer("AdamW", fused=False), chunked_cross_entropy (128-row
                  chunks), clip to max_norm 1.0 (what fabric.clip_gradients runs).

Then the trainers as processes, as a user runs them: `pretrain bench` (the trainer's own step, data
path and optimizer, torch's default threads) against a LitGPT trainer loop at the same shapes (LitGPT's
model, its pretrain script's AdamW and chunked cross-entropy, clipping, random token batches; torch's
default threads), each a fresh process, alternating, ROUNDS_TRAINER rounds: once on the machine as it is
("quiet"), once beside a background load that this benchmark starts itself (another training process,
the same for both, stopped at the end). Each ratio is the median of per-round tokens per wall second
ratios; goals: >= 1.0 quiet, >= 0.95 loaded. PEER_OURS_ROOT runs "our" side from another checkout (to
compare a change with the code before it).

LitGPT lives only in the peer environment (`make peer-env`: .venv-peer, git-ignored). Run from the
project's .venv (`make bench`) this module re-runs itself there; with no peer environment it prints one
line saying it is skipped and why. `python -m benchmarks.bench_peer --profile [shipped]` (in
.venv-peer) prints torch.profiler self-CPU ms per step by op category and the top ops of both models.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

VOCAB, N_LAYER, D_MODEL, N_HEAD, SEQ, BATCH = 2048, 4, 192, 6, 128, 32
WARMUP = int(os.environ.get("PEER_WARMUP", 3))  # steps of each model before the first round
STEPS = int(os.environ.get("PEER_STEPS", 4))  # timed steps per model per round (+1 untimed each)
ROUNDS = int(os.environ.get("PEER_ROUNDS", 7))
# One intra-op thread by default: on a shared 2-core machine two OpenMP threads that lose their core to
# other work spin at every barrier (5-15x slower steps, ratios ranging 0.5-2x); one thread measures
# per-core efficiency, which is what the ratio is about. PEER_THREADS=2 for both cores of a quiet machine.
THREADS = int(os.environ.get("PEER_THREADS", 1))
FUSED = os.environ.get("PEER_FUSED", "0") == "1"  # the model-only optimizer's fused flag (both models)
ROUNDS_TRAINER = int(os.environ.get("PEER_TRAINER_ROUNDS", 5))  # process pairs per condition (quiet, loaded)
TRAINER_STEPS, TRAINER_WARMUP = int(os.environ.get("PEER_TRAINER_STEPS", 10)), 3
N_BATCHES = 8  # distinct random token batches, cycled

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / os.environ.get("PEER_VENV", ".venv-peer")  # relative: to the repository root
PEER_STAMP = PEER_VENV / ".setup-stamp"
PEER_LOG = PEER_VENV / "setup.log"
OURS_ROOT = Path(os.environ.get("PEER_OURS_ROOT", ROOT))
CHILD_TIMEOUT_S = 1800


# ---------------------------------------------------------------- the two models


def pretrain_config():
    from app.config import ModelConfig

    return ModelConfig(
        vocab_size=VOCAB, seq_len=SEQ, n_layer=N_LAYER, d_model=D_MODEL, n_head=N_HEAD, tie_embeddings=True
    )


def build_pair():
    """(pretrain GPT, LitGPT GPT) with the same shapes and the same weights."""
    import litgpt
    from litgpt.model import GPT as LitGPT

    from app.trainer.model.gpt import build_model

    cfg = pretrain_config()
    torch.manual_seed(1337)
    ours = build_model(cfg)
    lcfg = litgpt.Config(
        name="peer",
        block_size=SEQ,
        n_layer=N_LAYER,
        n_embd=D_MODEL,
        n_head=N_HEAD,
        n_query_groups=cfg.kv_heads,  # = n_head: MHA
        vocab_size=VOCAB,
        padded_vocab_size=VOCAB,
        bias=False,
        attn_bias=False,
        lm_head_bias=False,
        norm_class_name="RMSNorm",
        norm_eps=cfg.norm_eps,
        mlp_class_name="LLaMAMLP",
        intermediate_size=cfg.ffn_dim,
        rotary_percentage=1.0,
        rope_base=int(cfg.rope_base),
        parallel_residual=False,
        shared_attention_norm=False,
    )
    peer = LitGPT(lcfg)
    peer.transformer.wte.weight = peer.lm_head.weight  # tied, as litgpt.pretrain does with tie_embeddings
    with torch.no_grad():
        peer.transformer.wte.weight.copy_(ours.tok_emb.weight)
        peer.transformer.ln_f.weight.copy_(ours.norm.weight)
        for b, lb in zip(ours.blocks, peer.transformer.h, strict=True):
            lb.norm_1.weight.copy_(b.attn_norm.weight)
            lb.norm_2.weight.copy_(b.mlp_norm.weight)
            lb.attn.qkv.weight.copy_(torch.cat([b.attn.wq.weight, b.attn.wk.weight, b.attn.wv.weight]))
            lb.attn.proj.weight.copy_(b.attn.wo.weight)
            lb.mlp.fc_1.weight.copy_(b.mlp.w_gate.weight)  # silu(fc_1(x)) * fc_2(x)
            lb.mlp.fc_2.weight.copy_(b.mlp.w_up.weight)
            lb.mlp.proj.weight.copy_(b.mlp.w_down.weight)
    return ours.train(), peer.train()


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(N_BATCHES):
        t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


# ---------------------------------------------------------------- training steps


class Trainee:
    """One model, its optimizer and its loss, stepped on the shared batch list."""

    def __init__(self, model, opt, loss_fn, batch_list) -> None:
        self.model, self.opt, self.loss_fn, self.batches = model, opt, loss_fn, batch_list
        self.i = 0
        self.last_loss = float("nan")

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        with record_function("phase:forward+loss"):
            loss = self.loss_fn(self.model, x, y)
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer"):  # clip, step, zero_grad
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.last_loss = loss.item()

    def timed(self, steps: int) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second of this process) over `steps` steps, after one
        untimed step (caches after the other model). CPU time does not count the time other work on the
        machine holds the core, so with one thread it is the steadier of the two."""
        self.step()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        tokens = steps * BATCH * SEQ
        return tokens / (time.perf_counter() - wall), tokens / (time.process_time() - cpu)


def ours_loss(model, x, y):
    return model(x, y).loss


def peer_loss_plain(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def peer_loss_shipped(model, x, y):
    from litgpt.utils import chunked_cross_entropy

    return chunked_cross_entropy(model(x), y)  # litgpt.pretrain's call (chunk_size=128)


def plain_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=FUSED)


def shipped_pair(batch_list):
    from litgpt.utils import instantiate_torch_optimizer

    from app.config import OptimConfig
    from app.trainer.optimization.optimizer import build_optimizer

    ours, peer = build_pair()
    ours_opt = build_optimizer(ours, OptimConfig(), torch.device("cpu"))
    # litgpt.pretrain: extra_kwargs = {"fused": fabric.device.type == "cuda"}
    peer_opt = instantiate_torch_optimizer("AdamW", peer.parameters(), fused=False)
    return (
        Trainee(ours, ours_opt, ours_loss, batch_list),
        Trainee(peer, peer_opt, peer_loss_shipped, batch_list),
    )


def model_only_pair(batch_list):
    ours, peer = build_pair()
    return (
        Trainee(ours, plain_adamw(ours), ours_loss, batch_list),
        Trainee(peer, plain_adamw(peer), peer_loss_plain, batch_list),
    )


def compare(a: Trainee, b: Trainee) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(wall, CPU) tokens/s per round of a and b, interleaved, order alternating."""
    for _ in range(WARMUP):
        a.step()
        b.step()
    ta, tb = [], []
    for r in range(ROUNDS):
        if r % 2 == 0:
            ta.append(a.timed(STEPS))
            tb.append(b.timed(STEPS))
        else:
            tb.append(b.timed(STEPS))
            ta.append(a.timed(STEPS))
    return ta, tb


def _ratio_line(label: str, ta: list[tuple[float, float]], tb: list[tuple[float, float]]) -> str:
    med = statistics.median
    parts = []
    for i, what in ((1, "per CPU-second"), (0, "per wall second")):
        r = sorted(x[i] / y[i] for x, y in zip(ta, tb, strict=True))
        parts.append(f"{med(r):.3f}x {what} (range {r[0]:.3f}-{r[-1]:.3f})")
    return (
        f"{label}: pretrain / LitGPT tokens = {parts[0]}, {parts[1]}, median of {len(ta)} rounds; "
        f"pretrain {med(x[1] for x in ta):,.0f}, LitGPT {med(x[1] for x in tb):,.0f} tokens per CPU-second"
    )


def measure() -> list[str]:
    from importlib.metadata import version

    import litgpt  # noqa: F401  (fails early outside the peer environment)

    torch.set_num_threads(THREADS)  # the same for both models: they run in this one process
    batch_list = batches()
    ours, peer = build_pair()
    x, y = batch_list[0]
    with torch.no_grad():
        l_ours, l_peer = ours(x, y).loss.item(), peer_loss_plain(peer, x, y).item()
    lines = [
        f"shapes: vocab {VOCAB}, {N_LAYER} layers, d{D_MODEL}, {N_HEAD} heads MHA, SwiGLU "
        f"{pretrain_config().ffn_dim}, seq {SEQ}, batch {BATCH}, fp32, eager, {torch.get_num_threads()} "
        f"threads; torch {torch.__version__}, litgpt {version('litgpt')}",
        f"parameters: pretrain {n_params(ours):,}, LitGPT {n_params(peer):,}"
        + ("" if n_params(ours) == n_params(peer) else "  MISMATCH: the ratios compare different models"),
        f"same weights, first batch loss: pretrain {l_ours:.6f}, LitGPT {l_peer:.6f} "
        f"(rel diff {abs(l_ours - l_peer) / abs(l_peer):.1e})",
    ]
    del ours, peer
    a, b = model_only_pair(batch_list)
    ta, tb = compare(a, b)
    lines.append(_ratio_line(f"model only (same loop, torch AdamW fused={FUSED})", ta, tb))
    lines.append(f"  after {a.i} identical steps: loss pretrain {a.last_loss:.5f}, LitGPT {b.last_loss:.5f}")
    a, b = shipped_pair(batch_list)
    ta, tb = compare(a, b)
    ours_opt = a.opt
    fused = ours_opt.defaults.get("fused")
    lines.append(_ratio_line("as each ships (optimizer + loss)", ta, tb))
    lines.append(
        f"  pretrain: build_optimizer -> {type(ours_opt).__name__}(fused={fused}, "
        f"foreach={ours_opt.defaults.get('foreach')}), {len(ours_opt.param_groups)} groups; "
        f"LitGPT: AdamW(fused=False), chunked_cross_entropy; goal: pretrain >= 1.0x"
    )
    return lines


# ---------------------------------------------------------------- the trainers as processes


def peer_trainer(steps: int, warmup: int) -> float:
    """LitGPT as its pretrain script trains on a CPU (its model, AdamW(fused=False), chunked cross-entropy,
    clipping at 1.0), on random token batches made each step as `pretrain bench` makes them, with torch's
    default threads: tokens per wall second over `steps` steps after `warmup`."""
    from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer

    _, peer = build_pair()
    optimizer = instantiate_torch_optimizer("AdamW", peer.parameters(), fused=False)
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        g = torch.Generator().manual_seed(1337 + i)
        rows = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g, dtype=torch.int32).long()
        loss = chunked_cross_entropy(peer(rows[:, :-1]), rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(peer.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss.item()
    return steps * BATCH * SEQ / (time.perf_counter() - start)


def background_load() -> None:
    """Another training process (pretrain's GPT at the same shapes, a plain loop, torch's default threads)
    until it is stopped: the load both trainers share in the loaded rounds."""
    from app.trainer.model.gpt import build_model

    model = build_model(pretrain_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    while True:
        model(x, x).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def ours_bench(work: Path) -> float:
    """`pretrain bench` at the peer's shapes, as the CLI runs it: tokens per wall second."""
    out = work / "ours.json"
    shapes = [
        f"model.vocab_size={VOCAB}",
        f"model.seq_len={SEQ}",
        f"model.n_layer={N_LAYER}",
        f"model.d_model={D_MODEL}",
        f"model.n_head={N_HEAD}",
        f"model.n_kv_head={N_HEAD}",
        "model.tie_embeddings=true",
        f"train.micro_batch_size={BATCH}",
        "train.batch_tokens=0",
        "train.device=cpu",
    ]
    steps = ["--steps", str(TRAINER_STEPS), "--warmup", str(TRAINER_WARMUP), "--breakdown-steps", "0"]
    cmd = [OURS_PYTHON, "-m", "app.cli", "bench", "--preset", "tiny", *steps, "--out", str(out), "--force"]
    cmd += [a for kv in shapes for a in ("--set", kv)]
    subprocess.run(cmd, cwd=OURS_ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=True)
    import json

    return json.loads(out.read_text())["tokens_per_second"]


def peer_bench() -> float:
    cmd = [str(PEER_VENV / "bin" / "python"), "-m", "benchmarks.bench_peer", "--trainer"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def trainer_rounds(work: Path) -> list[float]:
    """Per-round ratios pretrain bench / LitGPT trainer, the order alternating."""
    ratios = []
    for r in range(ROUNDS_TRAINER):
        if r % 2 == 0:
            ours = ours_bench(work)
            peer = peer_bench()
        else:
            peer = peer_bench()
            ours = ours_bench(work)
        ratios.append(ours / peer)
    return ratios


def trainer_ratios() -> list[str]:
    """The quiet and the loaded ratio of the trainers (see the module docstring)."""
    import tempfile

    if not (PEER_STAMP.exists() and (PEER_VENV / "bin" / "python").exists()):
        return [f"trainers: skipped: no peer environment with litgpt: {_skip_reason()}"]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        quiet = trainer_rounds(work)
        load = subprocess.Popen([OURS_PYTHON, "-m", "benchmarks.bench_peer", "--load"], cwd=ROOT)
        try:
            time.sleep(5)  # its start-up done: the load is a training loop when the rounds start
            loaded = trainer_rounds(work)
        finally:
            load.terminate()
            load.wait(timeout=60)
    for label, ratios, goal in (("quiet", quiet, 1.0), ("loaded", loaded, 0.95)):
        r = sorted(ratios)
        verdict = "meets" if statistics.median(r) >= goal else "BELOW"
        lines.append(
            f"trainers {label}: pretrain bench / LitGPT trainer tokens per wall second = "
            f"{statistics.median(r):.3f}x (range {r[0]:.3f}-{r[-1]:.3f}, {len(r)} rounds); goal >= {goal}: {verdict}"
        )
    lines.append(
        f"  each a fresh process: {TRAINER_STEPS} steps after {TRAINER_WARMUP}, torch's default threads "
        f"({os.cpu_count()} CPUs), os.getloadavg() at the end {os.getloadavg()[0]:.1f}; loaded: beside one more "
        "training process started by this benchmark"
    )
    return lines


# ---------------------------------------------------------------- profile (--profile)

# First match wins; matched against the lower-cased op name. The optimizer's ops are found by the phase
# they run in (Trainee.step), so an addcmul in the model counts as elementwise work, not as optimizer.
CATEGORIES = [
    ("attention (SDPA)", ("attention", "sdpa", "flash")),
    ("cross-entropy", ("cross_entropy", "log_softmax", "nll_loss")),
    ("embedding", ("embedding",)),
    ("matmul", ("addmm", "mm", "matmul", "linear", "bmm")),
    ("activation (silu, gelu)", ("silu", "gelu")),
    ("norm/rsqrt/mean", ("rsqrt", "mean", "pow", "norm", "vecdot")),
    ("cat/copy/layout", ("cat", "copy_", "clone", "contiguous", "to_copy", "empty", "fill_", "zero_")),
    ("elementwise mul/add/neg", ("mul", "add", "sub", "neg", "div", "rope")),
]


def _category(name: str) -> str:
    n = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in n for k in keys):
            return cat
    return "other"


def _phase(e) -> str | None:
    while e is not None:
        if e.name.startswith("phase:"):
            return e.name[len("phase:") :]
        e = e.cpu_parent
    return None


def profile(shipped: bool = False, steps: int = 3, rounds: int = 3) -> list[str]:
    """The per-op profile of both models (profile_pair), in the model-only loop or as each ships."""
    torch.set_num_threads(THREADS)
    a, b = (shipped_pair if shipped else model_only_pair)(batches())
    loop = "as each ships" if shipped else "model-only loop"
    return profile_pair(a, b, ("pretrain", "LitGPT"), loop, steps, rounds)


def profile_pair(a: Trainee, b: Trainee, names, loop: str, steps: int = 3, rounds: int = 3) -> list[str]:
    """Self-CPU ms per step by op category (the optimizer phase as one: clip + step + zero_grad) and the
    top forward/backward ops of two trainees (`names`), median over `rounds` interleaved profiles of
    `steps` steps each."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    cats: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    ops: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    calls: dict[str, dict[str, int]] = {n: {} for n in names}
    for t in (a, b):
        for _ in range(WARMUP):
            t.step()
    for r in range(rounds):
        pairs = ((names[0], a), (names[1], b))
        for name, t in pairs if r % 2 == 0 else pairs[::-1]:
            t.step()
            with tprofile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    t.step()
            per_cat: dict[str, float] = {}
            per_op: dict[str, float] = {}
            n_calls: dict[str, int] = {}
            for e in prof.events():
                ms = e.self_cpu_time_total / 1e3 / steps
                phase = _phase(e)
                cat = "optimizer (clip+step+zero)" if phase == "optimizer" else _category(e.name)
                per_cat[cat] = per_cat.get(cat, 0.0) + ms
                if phase != "optimizer":
                    key = f"{e.name} [{'bwd' if phase == 'backward' else 'fwd'}]"
                    per_op[key] = per_op.get(key, 0.0) + ms
                    n_calls[key] = n_calls.get(key, 0) + 1
            for c, ms in per_cat.items():
                cats[name].setdefault(c, []).append(ms)
            for k, ms in per_op.items():
                ops[name].setdefault(k, []).append(ms)
                calls[name][k] = n_calls[k] // steps
    med = statistics.median
    first, second = names
    out = [f"self-CPU ms per step, median of {rounds} interleaved profiles of {steps} steps ({loop})"]
    order = sorted(set(cats[first]) | set(cats[second]), key=lambda c: -med(cats[first].get(c, [0])))
    out.append(f"    {'category':<28} {first:>9} {second:>9}")
    for c in order:
        out.append(f"    {c:<28} {med(cats[first].get(c, [0])):9.1f} {med(cats[second].get(c, [0])):9.1f}")
    totals = [sum(med(v) for v in cats[n].values()) for n in names]
    out.append(f"    {'total':<28} {totals[0]:9.1f} {totals[1]:9.1f}")
    for name in names:
        out.append(f"  {name} top forward/backward ops (self ms/step, calls/step):")
        top = sorted(ops[name].items(), key=lambda kv: -med(kv[1]))[:16]
        out.extend(f"    {k[:64]:<64} {med(v):7.2f} {calls[name][k]:5d}" for k, v in top)
    return out


# ---------------------------------------------------------------- running in the peer environment


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _skip_reason() -> str:
    if PEER_LOG.exists():
        lines = [ln.strip() for ln in PEER_LOG.read_text(errors="replace").splitlines()]
        errors = [ln for ln in lines if ln.startswith(("ERROR", "error:", "make:")) or "Error" in ln]
        if errors:
            return (
                f"its setup failed: {errors[0].split(' (from versions')[0][:200]} (log: {_shown(PEER_LOG)})"
            )
    return f"run `make peer-env` (needs PyPI: torch, litgpt and the project go into {_shown(PEER_VENV)})"


def _in_peer_env() -> list[str]:
    python = PEER_VENV / "bin" / "python"
    if Path(sys.prefix).resolve() == PEER_VENV.resolve():
        return ["skipped: litgpt does not import in the peer environment; rebuild it with `make peer-env`"]
    if not (PEER_STAMP.exists() and python.exists()):
        return [f"skipped: no peer environment with litgpt: {_skip_reason()}"]
    args = [str(python), "-m", "benchmarks.bench_peer"]
    try:
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [f"failed: the peer run took over {CHILD_TIMEOUT_S}s"]
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return [f"failed in {_shown(PEER_VENV)} (exit {proc.returncode}): {last}"]
    return [ln for ln in proc.stdout.splitlines() if ln.strip()]


def run() -> list[str]:
    try:
        import litgpt  # noqa: F401
    except ImportError:
        return _in_peer_env() + trainer_ratios()
    return measure()


OURS_PYTHON = sys.executable  # the project's environment: `make bench` runs this module from .venv


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--trainer" in args:
        print(peer_trainer(TRAINER_STEPS, TRAINER_WARMUP), flush=True)
    elif "--load" in args:
        background_load()
    else:
        for line in profile(shipped="shipped" in args) if "--profile" in args else run():
            print(line, flush=True)
