"""Checkpoint files: atomic layout, verification, corrupt/partial ones skipped, retention."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from app.config import ModelConfig
from app.errors import UserError
from app.files import sha256_file
from app.trainer.checkpoint import store as ckpt
from app.trainer.checkpoint.state import load_optimizer
from app.trainer.checkpoint.writer import CheckpointWriter
from app.trainer.model.gpt import build_model
from tests.conftest import FAST, pretrain


def _save(run_dir, step, model, val_loss=None, optimizer=None):
    writer = CheckpointWriter(run_dir, 0, 1)
    return writer.save(step, model, optimizer, {"step": step}, {"val_loss": val_loss})


@pytest.fixture
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=32, n_head=2))


def test_layout_has_no_pickle_and_checksums_every_file(tmp_path, model):
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    res = _save(tmp_path, 5, model, 1.5, opt)
    names = sorted(p.name for p in res.path.iterdir())
    assert names == [
        "meta.json",
        "model-rank00000.safetensors",
        "model.index.json",
        "optimizer-rank00000.safetensors",
        "optimizer.index.json",
        "rng_rank0.json",
        "trainer_state.json",
    ]
    meta = json.loads((res.path / "meta.json").read_text())
    assert set(meta["files"]) == set(names) - {"meta.json"}
    assert meta["tied"] == {"head.weight": "tok_emb.weight"} and meta["format_version"] == 2
    for name, entry in meta["files"].items():  # hashed while writing == hashed from disk
        assert entry["sha256"] == sha256_file(res.path / name), name
    for f in res.path.iterdir():
        assert not f.read_bytes().startswith(b"\x80")  # no pickle protocol header anywhere
    info = ckpt.resolve_latest(tmp_path)
    state = ckpt.load_model_state(info)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    fresh = torch.optim.AdamW(model.parameters())
    with ckpt.open_reader(info, "optimizer") as reader:
        load_optimizer(model, fresh, reader)
    assert len(fresh.state) == len(opt.state) > 0
    for p, want in opt.state.items():
        assert all(torch.equal(fresh.state[p][k], want[k]) for k in want), p.shape


@pytest.mark.parametrize(
    "damage", ["truncate", "flip", "delete", "no-meta", "meta-not-utf8", "format-damaged"]
)
def test_corrupt_latest_is_skipped_with_a_warning(tmp_path, model, damage):
    _save(tmp_path, 1, model)
    bad = _save(tmp_path, 2, model).path
    target = bad / "model-rank00000.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    elif damage == "no-meta":
        (bad / "meta.json").unlink()
    elif damage == "meta-not-utf8":  # a torn write or bit rot: bytes that are not even text
        (bad / "meta.json").write_bytes(bytes(range(128, 256)) * 4)
    else:  # a field no pretrain writes
        _edit_meta(bad, format_version="2x")
    warnings = []
    info = ckpt.resolve_latest(tmp_path, warn=warnings.append)
    assert info.step == 1
    assert len(warnings) == 1 and "step_000002" in warnings[0]


def _edit_meta(path, **fields):
    meta = json.loads((path / "meta.json").read_text())
    meta.update(fields)
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("found", ["2x", 2.5, True, None, -1, 0])
def test_a_damaged_format_version_is_a_corrupt_checkpoint(tmp_path, model, found):
    """Not a format number at all: damage, so the checkpoint is skipped and the one before it used."""
    _save(tmp_path, 1, model)
    _edit_meta(_save(tmp_path, 2, model).path, format_version=found)
    warnings = []
    assert ckpt.resolve_latest(tmp_path, warn=warnings.append).step == 1
    assert len(warnings) == 1 and "damaged format_version" in warnings[0], warnings


@pytest.mark.parametrize("wrote", ["99.0.0", "this release", None])
def test_a_newer_format_is_refused_naming_both_versions(tmp_path, model, wrote):
    """A downgrade: the newest checkpoint was written in a format this pretrain cannot read, by a newer
    release, by a build of this very release number that changed the format (a dev build, a forgotten
    version bump), or by one that did not say. Refused (never skipped: a fresh start would bury it),
    naming both releases and both formats."""
    from app import __version__

    release = __version__ if wrote == "this release" else wrote
    _save(tmp_path, 1, model)
    newer = _save(tmp_path, 2, model).path
    _edit_meta(
        newer, format_version=ckpt.FORMAT_VERSION + 1, versions={"pretrain": release} if release else {}
    )
    with pytest.raises(UserError) as refused:
        ckpt.resolve_latest(tmp_path, warn=pytest.fail)
    line = str(refused.value)
    assert f"format {ckpt.FORMAT_VERSION + 1}, written by pretrain {release or 'a newer version'}" in line, (
        line
    )
    assert f"this is pretrain {__version__}, which reads format {ckpt.FORMAT_VERSION}" in line, line


def test_a_leftover_temp_dir_is_never_a_checkpoint_and_is_cleaned(tmp_path, model):
    _save(tmp_path, 1, model)
    partial = ckpt.checkpoints_root(tmp_path) / ".tmp-step_000002"
    shutil.copytree(ckpt.checkpoints_root(tmp_path) / "step_000001", partial)
    assert ckpt.resolve_latest(tmp_path).step == 1
    ckpt.clean_temp_dirs(tmp_path)
    assert not partial.exists()


def test_retention_keeps_last_k_and_best_and_can_drop_old_optimizer_state(tmp_path, model):
    opt = torch.optim.AdamW(model.parameters())
    for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, 2.2)]:
        _save(tmp_path, step, model, loss, opt)
    removed = ckpt.apply_retention(tmp_path, keep_last=2, keep_best=True, drop_optimizer_older=True)
    assert sorted(p.name for p in removed) == ["step_000001", "step_000003"]
    kept = {p.name: ckpt.verify(p)[0] for p in ckpt.list_checkpoints(tmp_path)}
    assert set(kept) == {"step_000002", "step_000004", "step_000005"}
    assert kept["step_000005"].has_optimizer
    assert not kept["step_000004"].has_optimizer and not kept["step_000002"].has_optimizer
    assert ckpt.resolve_best(tmp_path).step == 2


def test_resolve_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no usable checkpoint"):
        ckpt.resolve(tmp_path)


@pytest.mark.slow  # over 10 s: `make test-slow`, which CI runs too
def test_resuming_with_a_different_shape_is_refused_in_one_line(tmp_path):
    run = tmp_path / "run"
    assert pretrain("train", "--out", str(run), "--max-steps", "2", *FAST).returncode == 0
    proc = pretrain("train", "--out", str(run), "--max-steps", "4", *FAST, "--set", "model.d_model=128")
    assert proc.returncode == 2
    # the architecture check names the key, the checkpoint's own config and the value it was trained with
    assert "was trained with model.d_model=64" in proc.stderr and "meta.json" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    fresh = [
        "train",
        "--out",
        str(run),
        "--max-steps",
        "1",
        *FAST,
        "--set",
        "model.d_model=128",
        "--resume",
        "never",
    ]
    refused = pretrain(*fresh)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr  # the advice is followed below
    moved = pretrain(*fresh, "--overwrite")
    assert moved.returncode == 0, moved.stderr
    (old,) = run.glob("previous-*")
    assert ckpt.resolve_latest(old).step == 2 and ckpt.resolve_latest(run).step == 1


def test_ranks_share_the_sha256_checks_and_agree_on_the_same_checkpoint(tmp_path, model, monkeypatch):
    """Two ranks (threads here, an all-reduce in the trainer) each hash half of the files; a damaged
    file found by either one makes both skip that checkpoint."""
    import threading

    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    _save(tmp_path, 1, model, optimizer=opt)
    bad = _save(tmp_path, 2, model, optimizer=opt).path
    data = bytearray((bad / "optimizer-rank00000.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size: only a sha256 check finds it
    (bad / "optimizer-rank00000.safetensors").write_bytes(bytes(data))

    hashed: dict[int, list[str]] = {0: [], 1: []}
    real = ckpt.sha256_file
    monkeypatch.setattr(
        ckpt, "sha256_file", lambda p: hashed[int(threading.current_thread().name)].append(p) or real(p)
    )
    votes, gate = {}, threading.Barrier(2)

    def all_true(rank):
        def agree(ok):
            votes[rank] = ok
            gate.wait()
            out = all(votes.values())
            gate.wait()
            return out

        return agree

    got = {}

    def rank(r):
        got[r] = ckpt.resolve_latest(tmp_path, shared=ckpt.Shared(r, 2, all_true(r)), warn=lambda m: None)

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0].step == got[1].step == 1
    for r in range(2):
        mine = [p for p in hashed[r] if p.parent.name == "step_000001"]
        others = [p for p in hashed[1 - r] if p.parent.name == "step_000001"]
        assert mine and not set(mine) & set(others)  # each file of the good checkpoint hashed once
    files = len(ckpt.read_meta(tmp_path / "checkpoints" / "step_000001")["files"])
    assert sum(p.parent.name == "step_000001" for r in range(2) for p in hashed[r]) == files


def test_the_final_eval_is_in_the_final_checkpoint_and_a_torn_log_line_is_cut(tmp_path):
    """A planned end evaluates before the save of its last step (every_steps divides max_steps), so the
    run's best checkpoint is a real one; a metrics.jsonl line cut by a kill is dropped at the next start
    instead of the next record being glued to it."""
    run = tmp_path / "run"
    args = ["--out", str(run), *FAST, "--set", "checkpoint.every_steps=10", "--set", "train.eval_every=100"]
    pretrain("train", "--max-steps", "20", *args, "--set", "train.eval_batches=2", check=True)
    log = run / "metrics.jsonl"
    with log.open("a") as f:
        f.write('{"kind": "train", "step": 21, "lo')  # a kill mid-write
    done = pretrain("train", "--max-steps", "30", *args, "--set", "train.eval_batches=2", check=True)
    final = ckpt.read_meta(run / "checkpoints" / "step_000030")
    assert final is not None and final["val_loss"] is not None
    assert f"best checkpoint:   {run / 'checkpoints' / 'step_000030'} (step 30, val loss" in done.stdout
    rows = [json.loads(line) for line in log.read_text().splitlines()]  # every line parses
    assert [r["step"] for r in rows if r["kind"] == "eval"].count(30) == 1


@pytest.mark.slow
def test_a_newest_checkpoint_with_a_non_utf8_or_newer_meta_on_the_command_line(tmp_path):
    """The real commands on a run whose newest meta.json is not UTF-8: `train` (auto) warns, sets it aside
    and resumes from the one before; `--resume` of that checkpoint and `sample` of it say in one line what is
    wrong (exit 2). A newest checkpoint of a newer format stops `train` in one line, whether a newer release
    or a build of this release number wrote it, and stays where it is."""
    from app import __version__

    run = tmp_path / "run"
    trained = pretrain(
        "train", "--out", str(run), "--max-steps", "4", *FAST, "--set", "checkpoint.every_steps=2"
    )
    assert trained.returncode == 0, trained.stderr
    newest = ckpt.checkpoints_root(run) / "step_000004"
    meta = (newest / "meta.json").read_bytes()
    (newest / "meta.json").write_bytes(bytes(range(128, 256)) * 4)
    for cmd in (
        ["train", "--out", str(tmp_path / "other"), "--resume", str(newest), "--max-steps", "6", *FAST],
        ["sample", "--checkpoint", str(newest), "--max-new-tokens", "4"],
    ):
        proc = pretrain(*cmd)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"checkpoint {newest} is not usable: meta.json missing or unreadable" in lines[0], lines
    resumed = pretrain("train", "--out", str(run), "--max-steps", "6", *FAST)
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping checkpoint {newest}: meta.json" in resumed.stderr
    assert "resumed from" in resumed.stdout and "(step 2" in resumed.stdout
    assert (newest.parent / "corrupt-step_000004").is_dir() and ckpt.resolve_latest(run).step == 6
    newer = ckpt.checkpoints_root(run) / "step_000006"
    fields = json.loads(meta) | {"format_version": ckpt.FORMAT_VERSION + 1}
    for release in ("99.0.0", __version__):  # a newer release, or a build of this one with a new format
        (newer / "meta.json").write_text(json.dumps(fields | {"versions": {"pretrain": release}}))
        refused = pretrain("train", "--out", str(run), "--max-steps", "8", *FAST)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr
        assert f"written by pretrain {release}" in lines[0] and "resume it with the pretrain" in lines[0], (
            lines
        )
        assert (
            newer.is_dir() and not (newer.parent / "corrupt-step_000006").exists()
        )  # refused, not set aside


def _find(run_dir) -> tuple[ckpt.CheckpointInfo | None, list[str]]:
    """What a `--resume auto` start of `run_dir` resumes (the trainer's own Checkpointer), and its warnings."""
    from app.config import Config
    from app.trainer.checkpoint import Checkpointer
    from app.trainer.parallel.distributed import DistEnv

    warnings: list[str] = []
    checkpointer = Checkpointer(
        run_dir,
        Config(),
        DistEnv(),
        resume="auto",
        data={},
        files=[],
        expect_bytes=0,
        log=lambda line: None,
        warn=warnings.append,
        on_commit=lambda result: None,
        on_save=lambda state: None,
    )
    return checkpointer.find(), warnings


def _truncate(step_dir) -> None:
    weights = step_dir / "model-rank00000.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


@pytest.mark.parametrize("with_step_0", [False, True])
def test_a_start_whose_every_checkpoint_is_damaged_is_refused_and_moves_nothing(tmp_path, model, with_step_0):
    """A fresh start beside them would bury the run (two histories in one run dir), so it is refused in
    one line naming each and the way to start over on purpose; a usable step-0 checkpoint (older versions
    saved one) holds nothing learned and does not count as a usable one."""
    if with_step_0:
        _save(tmp_path, 0, model)
    for step in (2, 4):
        _truncate(_save(tmp_path, step, model).path)
    with pytest.raises(UserError) as refused:
        _find(tmp_path)
    line = str(refused.value)
    assert "every checkpoint in" in line and "is unusable" in line, line
    assert "step_000004 (model-rank00000.safetensors has 100 bytes" in line and "step_000002 (" in line, line
    assert "--resume never --overwrite" in line and "\n" not in line, line
    names = sorted(p.name for p in ckpt.checkpoints_root(tmp_path).iterdir())
    assert names == (["step_000000"] if with_step_0 else []) + ["step_000002", "step_000004"]


def test_a_start_with_one_usable_checkpoint_falls_back_and_a_dir_without_one_starts_fresh(tmp_path, model):
    """The rules around the refusal stay: a usable older checkpoint is resumed with a warning for each
    damaged newer one (set aside); no checkpoint, a crash's temp dir or only a step-0 checkpoint is a
    fresh start."""
    assert _find(tmp_path) == (None, [])
    partial = ckpt.checkpoints_root(tmp_path) / ".tmp-step_000003"
    partial.mkdir(parents=True)
    assert _find(tmp_path) == (None, [])  # a save a crash interrupted is not a checkpoint
    _save(tmp_path, 0, model)
    info, warnings = _find(tmp_path)
    assert info is None and "step-0 checkpoint" in warnings[0]
    _save(tmp_path, 1, model)
    _truncate(_save(tmp_path, 2, model).path)
    info, warnings = _find(tmp_path)
    assert info.step == 1
    assert "skipping checkpoint" in warnings[0] and "step_000002" in warnings[0]
    assert (ckpt.checkpoints_root(tmp_path) / "corrupt-step_000002").is_dir()


def test_a_run_whose_every_checkpoint_is_damaged_refuses_to_start_on_the_command_line(tmp_path):
    """The issue's reproduction: every checkpoint of a finished run truncated. `pretrain train` there used
    to set them aside and train again from step 0 (exit 0, a second history in metrics.jsonl); it now
    exits 2 with one line and leaves the run as it was. `--resume never --overwrite` starts over on
    purpose, keeping the damaged run aside."""
    run = tmp_path / "run"
    args = ["--out", str(run), *FAST, "--set", "checkpoint.every_steps=2"]
    pretrain("train", "--max-steps", "4", *args, check=True)
    steps = ckpt.list_checkpoints(run)
    assert [p.name for p in steps] == ["step_000004", "step_000002"]
    for step_dir in steps:
        _truncate(step_dir)
    log = (run / "metrics.jsonl").read_bytes()

    refused = pretrain("train", "--max-steps", "6", *args)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert f"every checkpoint in {run / 'checkpoints'} is unusable" in lines[0], lines
    assert "step_000004 (" in lines[0] and "step_000002 (" in lines[0] and "--overwrite" in lines[0], lines
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert (run / "metrics.jsonl").read_bytes() == log  # no second start, no second history

    over = pretrain("train", "--max-steps", "2", *args, "--resume", "never", "--overwrite")
    assert over.returncode == 0, over.stderr
    (previous,) = run.glob("previous-*")
    kept = previous / "checkpoints" / "step_000004" / "model-rank00000.safetensors"
    assert kept.stat().st_size == 100  # the damaged run is kept aside as it was
    assert (previous / "metrics.jsonl").read_bytes() == log
    assert ckpt.resolve_latest(run).step == 2


@pytest.mark.slow  # two 2-rank runs through the container launcher
def test_two_ranks_take_the_same_refusal_when_only_one_of_them_finds_the_damage(tmp_path):
    """The ranks share the sha256 checks: a flipped byte (same size) in the file rank 1 hashes is found by
    rank 1 alone, in every checkpoint. Both ranks must still refuse (one line each, no hang, no rank
    training alone); `python -m app.launch` exits with the workers' 2."""
    import subprocess
    import sys

    from tests.conftest import REPO, cli_env

    run = tmp_path / "run"
    launch = [sys.executable, "-m", "app.launch", "--standalone", "--nproc-per-node=2", "-m", "app.train"]
    args = ["--out", str(run), *FAST, "--set", "checkpoint.every_steps=2"]

    def train(steps: str) -> subprocess.CompletedProcess:
        cmd = [*launch, *args, "--max-steps", steps]
        return subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)

    assert train("4").returncode == 0
    for step_dir in ckpt.list_checkpoints(run):
        assert sorted(ckpt.read_meta(step_dir)["files"]).index("model-rank00001.safetensors") % 2 == 1
        weights = step_dir / "model-rank00001.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    refused = train("6")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 2, refused.stderr  # one per rank: the same decision, each with what it found
    for line in lines:
        assert f"every checkpoint in {run / 'checkpoints'} is unusable: step_000004 (" in line, line
        assert "step_000002 (" in line and "--resume never --overwrite" in line, line
    assert any("model-rank00001.safetensors fails its sha256 check" in line for line in lines), lines
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
