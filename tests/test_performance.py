"""The speed work of the GPU path, tested where it can run (CPU; no GPU here): regional compilation
(one graph per block, no breaks, eager's losses, exact resume), a step that reads nothing back from the
device, the prefetcher, the FLOPs accounting MFU rests on, and `pretrain bench`."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from app.config import LoopConfig, ModelConfig, load_config
from app.data.loader import Prefetcher, TrainLoader
from app.train import train_step
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer
from app.trainer.parallel.distributed import DistEnv
from app.trainer.reporting.metrics import flops_per_token
from app.trainer.reporting.steplog import StepLog
from tests.conftest import FAST, losses_by_step, pretrain, pretrain_meanwhile, torchrun
from tests.test_resume import assert_same_run, weights
from tests.test_switches import every_switch

GQA = ModelConfig(vocab_size=256, seq_len=32, n_layer=2, d_model=64, n_head=4, n_kv_head=2)
LOOPED = ModelConfig(
    vocab_size=256,
    seq_len=32,
    d_model=64,
    n_head=4,
    loop=LoopConfig(prelude=1, recurrent=1, coda=1, recurrence=3, deep_supervision=True),
)


@pytest.mark.parametrize(
    "cfg",
    [GQA, LOOPED, every_switch(), every_switch(looped=True)],
    ids=["gqa", "looped", "switches", "looped-switches"],
)
def test_a_block_traces_into_one_graph_without_breaks(cfg):
    """Regional compilation compiles each block and the loss with fullgraph=True; a graph break would fail
    it on a GPU. Blocks take what the model switches feed them (value embeddings, the embedding)."""
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    h, stream = model.embed(idx)
    for block, table in zip(model.blocks, model.value_table, strict=True):
        ve = None if table is None else stream.values[table]
        explanation = torch._dynamo.explain(block)(h, model.rope_cos, model.rope_sin, None, ve, stream.x0)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
    explanation = torch._dynamo.explain(model.loss)(h, idx)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


class CountHostReads:
    """Counts every read of a tensor's value into Python (what drains a GPU's queue) while active."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **k):
                self.calls.append(_name)
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


class Batches:
    def __init__(self, cfg: ModelConfig) -> None:
        self.g = torch.Generator().manual_seed(0)
        self.cfg = cfg

    def next(self):
        rows = torch.randint(0, self.cfg.vocab_size, (4, self.cfg.seq_len + 1), generator=self.g)
        return rows[:, :-1], rows[:, 1:]


def stepper(model, optimizer, batches, accum: int, log: StepLog):
    """The trainer's step with everything but its number fixed."""
    parts = dict(model=model, optimizer=optimizer, batches=batches, accum=accum, log=log)
    return lambda n: train_step(step=n, lr=1e-3, autocast=contextlib.nullcontext(), grad_clip=1.0, **parts)


def _steps(cfg: ModelConfig, optim: list[str], monkeypatch, steps: int = 3) -> tuple[list[str], StepLog]:
    full = load_config("tiny", overrides=optim)
    torch.manual_seed(0)
    model = build_model(cfg)
    optimizer = build_optimizer(model, full.optim, torch.device("cpu"))
    log = StepLog(DistEnv())
    step = stepper(model, optimizer, Batches(cfg), 2, log)
    step(1)  # optimizer state created outside the count
    counter = CountHostReads(monkeypatch)
    for i in range(steps):
        step(2 + i)
    monkeypatch.undo()
    return counter.calls, log


@pytest.mark.parametrize("optim", [["optim.name=adamw"], ["optim.name=muon"]], ids=["adamw", "muon"])
def test_the_step_reads_nothing_back_from_the_device(monkeypatch, optim):
    calls, log = _steps(GQA, optim, monkeypatch)
    assert calls == []
    rows = log.read()  # the numbers are all there, read in one go
    assert [r.step for r in rows] == [1, 2, 3, 4] and all(r.finite and r.loss > 0 for r in rows)


def test_the_host_read_counter_sees_a_sync(monkeypatch):
    """The counter above is not blind: unfused AdamW cannot skip on the device, so it reads the flag."""
    calls, _ = _steps(GQA, ["optim.fused=false"], monkeypatch)
    assert calls.count("item") >= 3  # ours, one per step (foreach AdamW on CPU reads its step counts too)


def test_a_looped_step_keeps_its_loop_losses_on_the_device(monkeypatch):
    calls, log = _steps(LOOPED, ["optim.name=adamw"], monkeypatch)
    assert calls == []
    rows = log.read()
    assert all(len(r.loop_losses) == 3 for r in rows)


def test_a_non_finite_step_is_skipped_on_the_device():
    torch.manual_seed(0)
    model = build_model(GQA)
    optimizer = build_optimizer(model, load_config("tiny").optim, torch.device("cpu"))
    log = StepLog(DistEnv())
    step = stepper(model, optimizer, Batches(GQA), 1, log)
    step(1)
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))  # the loss, hence the gradient norm, is NaN
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for k, v in optimizer.state[model.tok_emb.weight].items()}
    step(2)
    after = model.state_dict()
    assert all(
        torch.allclose(before[k], after[k], rtol=0, atol=0, equal_nan=True) for k in before
    )  # unchanged
    assert all(torch.equal(state[k], v) for k, v in optimizer.state[model.tok_emb.weight].items())
    rows = log.read()
    assert [r.finite for r in rows] == [True, False]


def test_the_prefetcher_gives_the_loaders_batches_and_moves_only_on_take(embedded_data):
    def loader():
        return TrainLoader(embedded_data, 64, 4, 0, 1, 1337)

    plain = loader()
    expected = [plain.next() for _ in range(6)]
    ahead = loader()
    pre = Prefetcher(ahead, torch.device("cpu"), depth=3, threaded=True)  # CUDA's reading thread
    got = [pre.next() for _ in range(4)]
    assert ahead.state.micro_steps == 4  # the reader is ahead; the position counts what was taken
    pre.close()
    again = Prefetcher(ahead, torch.device("cpu"), depth=3)  # a resume from that position, read in the loop
    got += [again.next() for _ in range(2)]
    again.close()
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_a_reading_error_reaches_the_loop_at_its_batch():
    class Broken:
        def __init__(self):
            self.state = type("S", (), {"micro_steps": 0})()

        def rows_at(self, m):
            if m == 2:
                raise ValueError("bad shard")
            return torch.zeros(1, 3, dtype=torch.int32)

    for depth in (0, 4):  # read in the loop (CPU), or by the reading thread (CUDA's, run here on a CPU)
        pre = Prefetcher(Broken(), torch.device("cpu"), depth=depth, threaded=True)
        pre.next(), pre.next()
        with pytest.raises(ValueError, match="bad shard"):
            pre.next()
        pre.close()


@pytest.mark.slow  # over 8 s: `make test-slow` (CI runs it); keeps `make test` near 10 min
def test_deferred_reads_keep_resume_exact(tmp_path):
    """log_every=5: numbers are read every 5 steps, saves and stops read what is pending; a stop at step 7
    (between reads) resumes to the straight run's weights and logged losses."""
    common = [*FAST, "--set", "train.log_every=5"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    reference = pretrain_meanwhile("train", "--out", str(straight), "--max-steps", "12", *common)
    assert pretrain("train", "--out", str(halves), "--max-steps", "7", *common).returncode == 0
    assert pretrain("train", "--out", str(halves), "--max-steps", "12", *common).returncode == 0
    assert reference.finished().returncode == 0
    wa, wb = weights(straight, 12), weights(halves, 12)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    la, lb = losses_by_step(straight), losses_by_step(halves)
    assert sorted(la) == [5, 10] and la == lb


@pytest.mark.parametrize(
    "cfg",
    ["tiny", "x1-50m", "gpt2-124m", "looped-546m", "looped-546m-fast"],
)
def test_flops_per_token_equals_the_flop_counter_for_the_presets(cfg):
    """MFU = flops_per_token x tokens/s / peak: the formula against torch's FlopCounterMode over a real
    forward + backward of each preset at its full size, on the meta device (shapes only, no compute)."""
    m = load_config(cfg).model
    m.vocab_size = m.vocab_size or 2048
    model = build_model(m, "meta")
    x = torch.randint(0, m.vocab_size, (1, m.seq_len), device="meta")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, x).loss.backward()
    counted = counter.get_total_flops() / m.seq_len
    assert abs(flops_per_token(m) - counted) / counted < 0.05, (flops_per_token(m), counted)


def _bench(tmp_path: Path, *extra: str, runner=pretrain) -> dict:
    out = tmp_path / "bench.json"
    args = ["--steps", "2", "--warmup", "1", "--breakdown-steps", "1", "--out", str(out)]
    model = ["--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=4"]
    proc = runner("bench", *args, *model, *extra) if runner is pretrain else runner(*args, *model, *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result  # the log carries the JSON too
    return result


def test_bench_reports_throughput_mfu_memory_and_breakdown(tmp_path):
    r = _bench(tmp_path, "--set", "metrics.peak_tflops=0.5")
    assert r["preset"] == "tiny" and r["world_size"] == 1 and r["device"] == "cpu" and not r["compile"]
    tiny = load_config("tiny")
    assert (
        r["tokens_per_step"] == tiny.train.micro_batch_size * tiny.model.seq_len
        and r["tokens_per_second"] > 0
    )
    assert r["tokens_per_second"] == pytest.approx(r["tokens_per_step"] / r["step_seconds"])
    assert r["mfu"] == pytest.approx(r["achieved_tflops_per_device"] / 0.5)
    assert set(r["breakdown_share"]) == {"data", "forward_backward", "optimizer"}
    assert sum(r["breakdown_share"].values()) == pytest.approx(1.0)
    assert 0.5 < r["peak_memory_bytes"] / r["estimated_memory_bytes"] < 2.0, r


def test_bench_bad_input_is_one_line(tmp_path):
    for args in (["--steps", "0"], ["--warmup", "-1"], ["--set", "train.compile=maybe"]):
        proc = pretrain("bench", *args, "--out", str(tmp_path / "x.json"))
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr


def test_bench_out_of_memory_is_one_line_naming_the_micro_batch_to_try(tmp_path):
    """A micro-batch that does not fit (the drill fails like a full GPU above 4 sequences): exit 2 and the
    setting to rerun with, the next divisor of train.batch_tokens' sequences, no traceback."""
    model = ["--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=4"]
    args = ["--steps", "1", "--warmup", "0", "--breakdown-steps", "0", "--out", str(tmp_path / "x.json")]
    cases = [
        (["--set", "train.micro_batch_size=16"], "--set train.micro_batch_size=8"),
        (["--set", "train.micro_batch_size=auto", "--set", f"train.batch_tokens={12 * 128}"], "=6"),
    ]
    for extra, want in cases:
        proc = pretrain("bench", *args, *model, "--set", "drill.oom_above=4", *extra)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "out of memory at micro-batch" in lines[0] and want in lines[0], lines[0]
        assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_bench_under_torchrun_measures_two_ranks_and_their_communication(tmp_path):
    def run_bench(*args):
        from tests.conftest import torchrun

        return torchrun("-m", "app.tools.bench", *args, timeout=600)

    r = _bench(tmp_path, runner=run_bench)
    tiny = load_config("tiny")
    assert (
        r["world_size"] == 2 and r["tokens_per_step"] == 2 * tiny.train.micro_batch_size * tiny.model.seq_len
    )
    assert set(r["breakdown_share"]) == {"data", "forward_backward", "communication", "optimizer"}
    from app.trainer.stopping.agreement import auto_every

    # two real ranks: the agreement is a gloo round trip, and k is what the trainer would pick from it
    assert r["stop_agreement_seconds"] > 0
    assert r["stop_check_every"] == auto_every(r["stop_agreement_seconds"], r["step_seconds"])


COMPILE = ["--set", "train.compile=true"]
SAMPLE = ["--set", "train.sample_every=3"]  # generation with the KV cache runs eager: no recompiles


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """6 compiled steps sampling every 3 (compiling takes most of a minute on 2 cores): the compiled run
    that follows eager, and the straight run a compiled resume must equal. (run dir, its process)"""
    run = tmp_path_factory.mktemp("compiled") / "run"
    return run, pretrain("train", "--out", str(run), "--max-steps", "6", *FAST, *COMPILE, *SAMPLE)


@pytest.mark.slow
@pytest.mark.parametrize("looped", [False, True], ids=["plain", "looped"])
def test_a_compiled_run_follows_eager(tmp_path, looped, request):
    """Inductor reorders float sums, so losses agree to rounding (relative 1e-4 over 6 steps), not bits."""
    extra = []
    if looped:
        loop = ["prelude=1", "recurrent=1", "coda=1", "recurrence=3", "deep_supervision=true"]
        extra = [a for kv in loop for a in ("--set", f"model.loop.{kv}")]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    reference = pretrain_meanwhile("train", "--out", str(eager), "--max-steps", "6", *FAST, *extra)
    if looped:
        proc = pretrain("train", "--out", str(compiled), "--max-steps", "6", *FAST, *extra, *COMPILE, *SAMPLE)
    else:
        compiled, proc = request.getfixturevalue("compiled_run")
    assert proc.returncode == 0, proc.stderr
    assert reference.finished().returncode == 0
    assert "compile: 2 blocks and the loss" in proc.stdout or "compile: 3 blocks and the loss" in proc.stdout
    assert "sample at step 6" in proc.stdout and "recompile" not in proc.stderr.lower(), proc.stderr
    le, lc = losses_by_step(eager), losses_by_step(compiled)
    assert sorted(le) == sorted(lc) == list(range(1, 7))
    for s in le:
        assert lc[s] == pytest.approx(le[s], rel=1e-4)


def test_the_compile_counter_sees_a_recompile():
    """compile_counts (what bench and `make gpu-check` report) counts a second shape as a recompile."""
    from app.trainer.parallel.parallelize import compile_counts

    def double(x):
        return x * 2

    compiled = torch.compile(double, fullgraph=True, dynamic=False)
    before = compile_counts()
    compiled(torch.ones(3))
    compiled(torch.ones(3))
    after_one = compile_counts()
    compiled(torch.ones(5))
    after_two = compile_counts()
    assert after_one["graphs"] - before["graphs"] == 1 and after_one["recompiles"] == before["recompiles"]
    assert after_two["recompiles"] - after_one["recompiles"] == 1


@pytest.mark.slow
def test_no_recompile_after_an_out_of_memory_halving_or_over_a_short_validation_batch(tmp_path):
    """train.micro_batch_size=auto on a compiled run: micro-batch 8 compiles, runs out of memory (the drill,
    after the forward), the retry at 4 compiles anew instead of recompiling with a symbolic batch size
    (dynamic=False, old graphs dropped), and evaluation over the whole validation split (598 windows: a
    last batch of 2) runs eagerly: 6 graphs (embeddings, block and loss, twice), 0 recompiles, 0 graph breaks."""
    import subprocess
    import sys

    from tests.conftest import CLASSIC, REPO, cli_env

    wrapper = (
        "import json, sys; from app.cli import main; rc = main(sys.argv[1:]); "
        "from app.trainer.parallel.parallelize import compile_counts; print('COMPILED', json.dumps(compile_counts())); "
        "from torch._dynamo.utils import get_compilation_metrics as m; print('FRAMES', [x.co_name for x in m()]); "
        "sys.exit(rc)"
    )
    run = tmp_path / "run"
    # the AdamW recipe's blocks are all alike (the switches make other kinds of block, each compiled once
    # more: test_the_switches_compile_one_graph_per_kind_of_block). Graphs and recompiles are dynamo's, the
    # same under aot_eager, which traces without generating kernels (tests/test_mfu.py checks that).
    args = ["train", "--out", str(run), "--max-steps", "2", *FAST, *CLASSIC, *COMPILE]
    args += ["--set", "train.compile_backend=aot_eager"]
    args += ["--set", "train.micro_batch_size=auto", "--set", f"train.batch_tokens={8 * 64}"]
    args += [
        "--set",
        "drill.oom_above=4",
        "--set",
        "train.eval_every=2",
        "--set",
        "train.eval_batches=150",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "out of memory at micro-batch 8 (step 1): retrying it at micro-batch 4" in proc.stdout
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [0, 2]
    counts = json.loads(proc.stdout.split("COMPILED ", 1)[1].splitlines()[0])
    assert counts == {"graphs": 6, "recompiles": 0, "graph_breaks": 0}, proc.stdout.split("COMPILED ", 1)[1]


@pytest.mark.slow
def test_a_compiled_run_resumes_exactly(tmp_path, compiled_run):
    """A restart recompiles the same kernels: on CPU a compiled run resumes bit-exactly (docs/performance.md
    says what holds on GPUs). The straight run is the compiled run that follows eager above."""
    straight, proc = compiled_run
    assert proc.returncode == 0, proc.stderr
    halves = tmp_path / "halves"
    assert (
        pretrain("train", "--out", str(halves), "--max-steps", "3", *FAST, *COMPILE, *SAMPLE).returncode == 0
    )
    assert (
        pretrain("train", "--out", str(halves), "--max-steps", "6", *FAST, *COMPILE, *SAMPLE).returncode == 0
    )
    assert_same_run(straight, halves, 6)


@pytest.mark.slow
def test_compiled_blocks_under_fsdp_with_activation_checkpointing(tmp_path):
    """Regional compilation composes with FSDP2 and activation checkpointing on 2 gloo ranks."""
    extra = [*COMPILE, "--set", "train.parallel=fsdp", "--set", "train.activation_checkpointing=true"]
    run, eager = tmp_path / "fsdp-compiled", tmp_path / "fsdp-eager"
    fsdp = ["--set", "train.parallel=fsdp", "--set", "train.activation_checkpointing=true"]
    assert torchrun("--out", str(eager), "--max-steps", "4", *FAST, *fsdp).returncode == 0
    proc = torchrun("--out", str(run), "--max-steps", "4", *FAST, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    le, lc = losses_by_step(eager), losses_by_step(run)
    assert sorted(lc) == [1, 2, 3, 4]
    for s in le:
        assert lc[s] == pytest.approx(le[s], rel=1e-4)
