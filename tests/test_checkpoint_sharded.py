"""Sharded checkpoints with real torchrun (gloo): N -> M resharding bit-exact for weights and optimizer
state, every rank writing its own files, async saves that stage a copy, and the old full-weight format
refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from app.config import ModelConfig
from app.errors import UserError
from app.trainer.checkpoint import store as ckpt
from app.trainer.checkpoint.writer import CheckpointWriter
from app.trainer.model.gpt import build_model
from tests.conftest import REPO, cli_env, full_optimizer_state, pretrain, torchrun

# Run under torchrun: build a small GPT (FSDP over the ranks, or DDP/plain), then either train two steps
# and save (async), or load a checkpoint from any world size and save it again at once (sync).
WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from pathlib import Path
    from app.config import ModelConfig, OptimConfig
    from app.trainer.checkpoint import store as ckpt
    from app.trainer.checkpoint.writer import CheckpointWriter
    from app.trainer.model.gpt import build_model
    from app.trainer.optimization.optimizer import build_optimizer
    from app.trainer.checkpoint.state import load_model, load_optimizer
    from app.trainer.parallel.distributed import DistEnv, init_distributed
    from app.trainer.parallel.parallelize import shard_model, unwrap

    action, mode, src, dst = sys.argv[1:5]
    env = init_distributed("cpu")
    torch.manual_seed(0)
    # vocab 67 and d_model 48: shards of uneven size (67 rows over 2 or 4 ranks), and n_kv_head rows < 4
    cfg = ModelConfig(vocab_size=67, seq_len=16, n_layer=2, d_model=48, n_head=4, n_kv_head=2)
    model = build_model(cfg)
    if mode == "fsdp" and env.distributed:
        shard_model(model, torch.device("cpu"))
    elif env.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    opt = build_optimizer(unwrap(model), OptimConfig(lr=1e-2), torch.device("cpu"))
    step = 2
    if action == "train":
        g = torch.Generator().manual_seed(1 + env.rank)
        for _ in range(step):
            x = torch.randint(0, 67, (2, 16), generator=g)
            model(x, x).loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        info = ckpt.resolve(src)
        with ckpt.open_reader(info) as r:
            load_model(model, r)
        with ckpt.open_reader(info, "optimizer") as r:
            load_optimizer(model, opt, r)
    writer = CheckpointWriter(Path(dst), env.rank, env.world_size, async_save=action == "train")
    writer.save(step, model, opt, {"step": step}, {"val_loss": None}, reason=action)
    if action == "train":  # the loop goes on while the write runs: the saved state must not move
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
            for s in opt.state.values():
                s["exp_avg"].add_(1.0)
    writer.wait()
    if env.distributed:
        dist.destroy_process_group()
    """
)


def run_worker(tmp_path, nproc, action, mode, src, dst):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    args = [str(script), action, mode, str(src), str(dst)]
    if nproc == 1:
        env = cli_env(PYTHONPATH=str(REPO))
        proc = subprocess.run(
            [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
    else:
        proc = torchrun(*args, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ckpt.resolve_latest(dst, warn=pytest.fail)


def assert_same_state(a, b):
    wa, wb = ckpt.load_model_state(a), ckpt.load_model_state(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]), k
    oa, ob = full_optimizer_state(a), full_optimizer_state(b)
    assert oa["state"].keys() == ob["state"].keys() == set(wa) - {"head.weight"}  # every parameter
    for name, entry in oa["state"].items():
        assert entry.keys() == ob["state"][name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k, v in entry.items():
            assert torch.equal(v, ob["state"][name][k]), (name, k)
    assert oa["param_groups"] == ob["param_groups"]


def chunk_counts(info, kind="model"):
    index = json.loads((info.path / f"{kind}.index.json").read_text())
    return {name: len(t["chunks"]) for name, t in index["tensors"].items()}


@pytest.mark.slow
def test_resharding_2_to_1_to_2_and_2_to_4_is_bit_exact(tmp_path):
    """Train on 2 FSDP ranks and save (in the background, while the live state moves on). Load that at
    world size 1 (one process, as sample/export do), 2 and 4 and save again: identical tensors."""
    two = run_worker(tmp_path, 2, "train", "fsdp", "-", tmp_path / "two")
    assert two.meta["world_size"] == 2 and two.meta["format_version"] == ckpt.FORMAT_VERSION
    files = set(two.meta["files"])
    assert {"model-rank00000.safetensors", "model-rank00001.safetensors"} <= files
    assert {"optimizer-rank00000.safetensors", "optimizer-rank00001.safetensors"} <= files
    counts = chunk_counts(two)
    assert counts["tok_emb.weight"] == 2 and "head.weight" not in counts  # tied: stored once
    assert chunk_counts(two, "optimizer")["tok_emb.weight/exp_avg"] == 2

    one = run_worker(tmp_path, 1, "load", "ddp", two.path, tmp_path / "one")  # 2 -> 1
    assert set(chunk_counts(one).values()) == {1}
    assert_same_state(two, one)
    back = run_worker(tmp_path, 2, "load", "fsdp", one.path, tmp_path / "back")  # 1 -> 2
    assert_same_state(two, back)
    four = run_worker(tmp_path, 4, "load", "fsdp", two.path, tmp_path / "four")  # 2 -> 4
    assert chunk_counts(four)["tok_emb.weight"] == 4  # 67 rows over 4 ranks: 17, 17, 17, 16
    assert_same_state(two, four)
    ddp = run_worker(tmp_path, 2, "load", "ddp", four.path, tmp_path / "ddp")  # 4 FSDP -> 2 DDP
    assert chunk_counts(ddp)["tok_emb.weight"] == 2  # DDP ranks each write half of the rows
    assert_same_state(two, ddp)


# ---------------------------------------------------------------- one process, fast


def _trained(seed=0):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=32, n_head=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 8))
        model(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_an_async_save_writes_the_staged_state_while_the_loop_moves_on(tmp_path):
    model, opt = _trained()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    writer = CheckpointWriter(tmp_path, 0, 1, async_save=True)
    assert writer.save(3, model, opt, {"step": 3}, {}) is None  # went to the background
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1)
    result = writer.wait()
    assert result.step == 3 and result.write_seconds > 0 and result.blocking_seconds > 0
    assert result.seconds == pytest.approx(result.blocking_seconds + result.write_seconds)
    got = ckpt.load_model_state(ckpt.resolve_latest(tmp_path))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert writer.wait() is None  # reported once


def test_an_abandoned_write_commits_nothing(tmp_path, monkeypatch):
    """The step-2 write is held inside its first file (the real writer, between two blocks) until
    abandon() is called, so the abandon always lands mid-write."""
    import threading
    import time

    from app.trainer.checkpoint import writer as checkpoint_writer

    real = checkpoint_writer.write_safetensors
    writing = threading.Event()

    def held(path, items, metadata=None, cancel=None):
        if ".tmp-step_000002" not in str(path):
            return real(path, items, metadata, cancel)

        def gate() -> None:  # called between blocks: returns only once abandoned (cancel() raises then)
            writing.set()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                cancel()
                time.sleep(0.01)
            raise AssertionError("the write was never abandoned")

        return real(path, items, metadata, gate)

    monkeypatch.setattr(checkpoint_writer, "write_safetensors", held)
    model, opt = _trained()
    writer = CheckpointWriter(tmp_path, 0, 1, async_save=True)
    writer.save(1, model, opt, {"step": 1}, {})
    writer.wait()
    assert writer.save(2, model, opt, {"step": 2}, {}) is None  # in the background
    assert writing.wait(60), "the background write never started"
    assert writer.pending
    t0 = time.monotonic()
    writer.abandon()
    assert time.monotonic() - t0 < 30, "abandon() waited for the write instead of cancelling it"
    assert not writer.pending and writer.wait() is None  # nothing to report, no error raised
    root = ckpt.checkpoints_root(tmp_path)
    assert not (root / "step_000002").exists()
    assert ckpt.resolve_latest(tmp_path, warn=pytest.fail).step == 1
    assert not (root / ".tmp-step_000002").exists()  # a write that fails or is abandoned removes its temp dir


def _write_v1(run_dir, step, model, opt):
    """A checkpoint as format 1 wrote it (rank 0 alone, full tensors): model.safetensors with tied weights
    once, optimizer.safetensors keyed "<i>.<state>", optimizer.json, meta.json with checksums."""
    from safetensors.torch import save_file

    from app.files import sha256_file

    path = ckpt.checkpoints_root(run_dir) / ckpt.step_dir_name(step)
    path.mkdir(parents=True)
    sd = model.state_dict()
    save_file(
        {k: v.contiguous() for k, v in sd.items() if k != "head.weight"}, str(path / "model.safetensors")
    )
    names = {id(p): n for n, p in model.named_parameters()}
    keys, tensors, scalars = [], {}, {}
    for i, (p, entry) in enumerate(opt.state.items()):
        keys.append(names[id(p)])
        for k, v in entry.items():
            tensors[f"{i}.{k}"] = v.contiguous()
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in opt.param_groups
    ]
    structure = {"param_keys": keys, "param_groups": groups, "scalars": scalars}
    save_file(tensors, str(path / "optimizer.safetensors"))
    (path / "optimizer.json").write_text(json.dumps(structure))
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in path.iterdir()}
    meta = {"format_version": 1, "step": step, "tied": {"head.weight": "tok_emb.weight"}, "files": files}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_a_checkpoint_of_the_old_full_weight_format_is_refused_in_one_line(tmp_path):
    """One format is read. An older checkpoint is refused (exit 2, one line naming the format and what to
    do), never skipped: a fresh start beside it would bury the old run under new checkpoints."""
    model, opt = _trained()
    _write_v1(tmp_path, 3, model, opt)
    with pytest.raises(UserError, match=r"step_000003 is in checkpoint format 1 .* use the pretrain version"):
        ckpt.resolve_latest(tmp_path, warn=pytest.fail)
    proc = pretrain("train", "--out", str(tmp_path), "--max-steps", "2", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "checkpoint format 1" in lines[0] and "new --out" in lines[0], lines
    assert sorted(p.name for p in ckpt.checkpoints_root(tmp_path).iterdir()) == ["step_000003"]  # untouched


def test_the_reader_reads_rows_in_place_and_any_other_box_through_a_buffer(tmp_path, monkeypatch):
    """Whole rows of a stored chunk (what every shard and whole tensor is) go straight from the file into
    the destination; a box of columns, another dtype or a 0-d tensor take the buffered path. Both give
    the stored values exactly."""
    from app.trainer.checkpoint import format as fmt

    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    step = torch.tensor(7.0)
    # two chunks of rows, as two ranks write them: rows 0-3 in one file, 4-9 in another
    fmt.write_safetensors(tmp_path / "a.safetensors", [("w", full[:4]), ("step", step)])
    fmt.write_safetensors(tmp_path / "b.safetensors", [("w", full[4:])])
    index = {
        "tensors": {
            "w": {
                "dtype": "float32",
                "shape": [10, 6],
                "chunks": [
                    fmt.chunk("a.safetensors", "w", [0, 0], [4, 6]),
                    fmt.chunk("b.safetensors", "w", [4, 0], [6, 6]),
                ],
            },
            "step": {"dtype": "float32", "shape": [], "chunks": [fmt.chunk("a.safetensors", "step", [], [])]},
        }
    }
    direct = []
    real = fmt.ShardReader._read_into
    monkeypatch.setattr(
        fmt.ShardReader, "_read_into", lambda self, *a: direct.append(real(self, *a)) or direct[-1]
    )
    with fmt.ShardReader(tmp_path, index) as r:
        assert torch.equal(r.full("w"), full) and direct == [True, True]  # both chunks, in place
        direct.clear()
        assert torch.equal(r.read("w", torch.empty(5, 6), (2, 0)), full[2:7]) and direct == [True, True]
        direct.clear()
        assert torch.equal(r.read("w", torch.empty(10, 3), (0, 2)), full[:, 2:5]) and direct == [False] * 2
        direct.clear()
        half = r.read("w", torch.empty(10, 6, dtype=torch.bfloat16))
        assert torch.equal(half, full.to(torch.bfloat16)) and direct == [False] * 2
        assert torch.equal(r.full("step"), step)


@pytest.mark.slow
def test_sample_consolidates_a_2_rank_checkpoint_like_a_1_process_load(tmp_path):
    """A real 2-rank FSDP run, then `pretrain sample --consolidate`: final.safetensors holds every weight
    whole, equal to the one-process load `pretrain sample` generates from, and to the rank files'
    chunks put together by hand."""
    from safetensors.torch import load_file

    from app.tools.sample import load_for_inference
    from tests.conftest import CLASSIC, FAST, pretrain, torchrun

    run = tmp_path / "run"
    # the AdamW recipe: every tensor has rows to shard (the switches add 0-dim scalars, kept whole)
    proc = torchrun("--out", str(run), *FAST, *CLASSIC, "--max-steps", "2", "--set", "train.parallel=fsdp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = ckpt.resolve_latest(run, warn=pytest.fail)
    assert info.meta["world_size"] == 2 and set(chunk_counts(info).values()) == {2}  # really sharded

    out = tmp_path / "weights"
    sampled = pretrain("sample", "--checkpoint", str(run), "--max-new-tokens", "8", "--consolidate", str(out))
    assert sampled.returncode == 0, sampled.stdout + sampled.stderr
    final = load_file(str(out / "final.safetensors"))

    model, _, loaded = load_for_inference(str(run))
    assert loaded.path == info.path
    state = model.state_dict()
    assert set(final) == set(state) - {"head.weight"}  # tied: stored once
    index = json.loads((info.path / "model.index.json").read_text())
    for name, tensor in final.items():
        assert torch.equal(tensor, state[name]), name
        parts = [
            load_file(str(info.path / c["file"]))[c["key"]]
            for c in sorted(index["tensors"][name]["chunks"], key=lambda c: c["offsets"])
        ]
        assert torch.equal(tensor, torch.cat(parts)), name
