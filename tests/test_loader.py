"""The shard loader: deterministic windows, disjoint across ranks, a position a checkpoint can hold."""

from __future__ import annotations

import numpy as np
import pytest

from app.data.loader import TokenWindows, TrainLoader, val_batches
from app.data.manifest import Manifest
from app.data.shards import ShardInfo, ShardWriter


def write_shard(path, tokens: np.ndarray) -> None:
    w = ShardWriter(path, tokens.dtype)
    w.write(tokens)
    w.finish()


@pytest.fixture
def data_dir(tmp_path):
    """Two shards of consecutive integers, so a window's content tells where it came from."""
    sizes = [1000, 650]
    shards, start = [], 0
    for i, n in enumerate(sizes):
        write_shard(tmp_path / f"train_{i:06d}.bin", np.arange(start, start + n, dtype=np.uint16))
        shards.append(ShardInfo(f"train_{i:06d}.bin", n, 1, n))
        start += n
    write_shard(tmp_path / "val_000000.bin", np.arange(300, dtype=np.uint16))
    Manifest(
        tokenizer={"kind": "bpe", "vocab_size": 4096, "eot_id": 0},
        dtype="uint16",
        shard_tokens=1000,
        train=shards,
        val=[ShardInfo("val_000000.bin", 300, 1, 600)],
    ).save(tmp_path)
    return tmp_path


def test_windows_are_contiguous_and_never_cross_shards(data_dir):
    w = TokenWindows(data_dir, "train", seq_len=16)
    assert w.count == (1000 - 1) // 16 + (650 - 1) // 16
    for i in range(w.count):
        win = w.window(i).astype(int)
        assert len(win) == 17 and (np.diff(win) == 1).all()


def test_ranks_read_disjoint_windows_and_cover_an_epoch(data_dir):
    a = TrainLoader(data_dir, 16, 4, rank=0, world_size=2, seed=7)
    b = TrainLoader(data_dir, 16, 4, rank=1, world_size=2, seed=7)
    W = a.windows.count
    steps = W // 8  # one epoch: 2 ranks x 4 windows per micro-step
    seen_a = np.concatenate([a.indices(s) for s in range(steps)])
    seen_b = np.concatenate([b.indices(s) for s in range(steps)])
    assert not set(seen_a) & set(seen_b)
    assert len(set(seen_a) | set(seen_b)) == steps * 8


def test_position_is_deterministic_and_resumable(data_dir):
    a = TrainLoader(data_dir, 16, 4, rank=0, world_size=1, seed=3)
    batches = [a.next()[0] for _ in range(10)]
    b = TrainLoader(data_dir, 16, 4, rank=0, world_size=1, seed=3)
    for _ in range(4):
        b.next()
    c = TrainLoader(data_dir, 16, 4, rank=0, world_size=1, seed=3)
    c.load_state_dict(b.state_dict())
    assert all((c.next()[0] == batches[i]).all() for i in range(4, 10))
    other_seed = TrainLoader(data_dir, 16, 4, rank=0, world_size=1, seed=4)
    assert not (other_seed.next()[0] == batches[0]).all()


def test_world_size_change_continues_from_the_same_global_sample(data_dir):
    four = TrainLoader(data_dir, 8, 2, rank=0, world_size=4, seed=1)
    for _ in range(3):
        four.next()  # 3 micro-steps x 4 ranks x 2 = 24 samples
    two = TrainLoader(data_dir, 8, 2, rank=0, world_size=2, seed=1)
    two.load_state_dict(four.state_dict())
    assert two.state.micro_steps == 6 and two.state.samples == 24


def test_targets_are_inputs_shifted_by_one(data_dir):
    x, y = TrainLoader(data_dir, 16, 4, 0, 1, 0).next()
    assert x.shape == y.shape == (4, 16)
    assert (y[:, :-1] == x[:, 1:]).all() and (y[:, -1] == x[:, -1] + 1).all()


def test_val_batches_split_across_ranks_without_overlap(data_dir):
    r0 = [x for x, _ in val_batches(data_dir, 16, 2, batches=3, rank=0, world_size=2)]
    r1 = [x for x, _ in val_batches(data_dir, 16, 2, batches=3, rank=1, world_size=2)]
    first = {int(x[i, 0]) for x in r0 for i in range(x.size(0))}
    second = {int(x[i, 0]) for x in r1 for i in range(x.size(0))}
    assert first and second and not first & second


def test_a_micro_batch_crosses_to_the_device_as_one_contiguous_int32_block(data_dir):
    """What the pinned copy moves (app/data/loader.py Prefetcher): one contiguous (B, T+1) int32 tensor per
    micro-batch, not two strided int64 views, so that on a GPU `.to(cuda, non_blocking=True)` copies the
    pinned buffer itself; inputs and targets are int64 views of it made on the device. The pinning and the
    copy's overlap need a GPU (`make gpu-check` reports them); this checks the layout that allows them."""
    import torch

    from app.data.loader import Prefetcher

    loader = TrainLoader(data_dir, 16, 4, 0, 1, 0)
    expected = TrainLoader(data_dir, 16, 4, 0, 1, 0).next()
    batches = Prefetcher(loader, torch.device("cpu"), depth=2)
    host = batches.host_rows(0)
    assert host.is_contiguous() and host.dtype == torch.int32 and host.shape == (4, 17)
    assert host.untyped_storage().nbytes() == 4 * 17 * 4  # its own buffer, not a view of a wider one
    x, y = batches.next()
    batches.close()
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()  # one copy, split after it


# ---------------------------------------------------------------- data.align_to_documents


@pytest.fixture
def documents_dir(tmp_path):
    """One shard of 200 tokens: position p holds p + 1, except the boundary token 0 after each document
    (at 5, 40, 41, 100 and 190), so a window's first value tells where it starts."""
    tokens = np.arange(1, 201, dtype=np.uint16)
    tokens[[5, 40, 41, 100, 190]] = 0
    write_shard(tmp_path / "train_000000.bin", tokens)
    write_shard(tmp_path / "val_000000.bin", np.arange(1, 101, dtype=np.uint16))
    Manifest(
        tokenizer={"kind": "bpe", "vocab_size": 4096, "eot_id": 0},
        dtype="uint16",
        shard_tokens=1000,
        train=[ShardInfo("train_000000.bin", 200, 5, 200)],
        val=[ShardInfo("val_000000.bin", 100, 1, 100)],
    ).save(tmp_path)
    return tmp_path


def test_aligned_windows_start_at_the_first_boundary_of_their_cell(documents_dir):
    plain = TokenWindows(documents_dir, "train", seq_len=16)
    aligned = TokenWindows(documents_dir, "train", seq_len=16, align_to_documents=True)
    assert (
        aligned.count == plain.count == (200 - 1) // 16
    )  # the same windows to index: same epochs, same position
    tokens = plain.arrays[0]
    starts = []
    for i in range(aligned.count):
        win = aligned.window(i)
        assert len(win) == 17
        starts += [s for s in range(200 - 16) if (tokens[s : s + 17] == win).all()]
    # cells [0,16) [16,32) [32,48) ... [176,192): boundaries at 5, 40 (not 41: the first), 100;
    # 190 is in the last cell, but a window from there would run past the shard: that cell keeps its start
    assert starts == [5, 16, 40, 48, 64, 80, 100, 112, 128, 144, 160, 176]
    for i in (0, 2, 6):
        assert aligned.window(i)[0] == 0  # the boundary token opens the window, as the record's BOS


def test_aligned_loader_resumes_from_one_integer(documents_dir):
    straight = TrainLoader(documents_dir, 16, 2, 0, 1, seed=5, align_to_documents=True)
    batches = [straight.next() for _ in range(8)]  # past one epoch (12 windows)
    half = TrainLoader(documents_dir, 16, 2, 0, 1, seed=5, align_to_documents=True)
    for _ in range(3):
        half.next()
    resumed = TrainLoader(documents_dir, 16, 2, 0, 1, seed=5, align_to_documents=True)
    resumed.load_state_dict(half.state_dict())
    for x, y in batches[3:]:
        rx, ry = resumed.next()
        assert (rx == x).all() and (ry == y).all()
    plain = TrainLoader(documents_dir, 16, 2, 0, 1, seed=5)
    assert (plain.indices(0) == straight.indices(0)).all()  # the same windows, in the same order
    assert not all((plain.next()[0] == x).all() for x, _ in batches[:6])  # an epoch: the aligned ones differ
