"""Config resolution and the one-line errors users get for bad configs (exit 2, no traceback)."""

from __future__ import annotations

import pytest

from app.config import ConfigError, load_config
from tests.conftest import pretrain


def test_overrides_apply_in_order(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  n_layer: 6\n  d_model: 96\ntrain:\n  max_steps: 7\n")
    cfg = load_config(
        "tiny",
        str(f),
        ["model.n_layer=3", "optim.lr=1e-3", "model.loop.loss_weights=[1,2]"],
        {"train.max_steps": 9},
    )
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.train.max_steps) == (3, 96, 9)
    assert cfg.optim.lr == 1e-3 and cfg.model.loop.loss_weights == [1.0, 2.0]


def test_unknown_key_names_the_nearest_valid_key():
    with pytest.raises(ConfigError, match="did you mean 'model.n_layer'"):
        load_config("tiny", overrides=["model.n_layers=3"])
    with pytest.raises(ConfigError, match="did you mean 'train.max_steps'"):
        load_config("tiny", overrides=["train.max_step=3"])


BAD = [
    (["--set", "model.n_layers=3"], "did you mean 'model.n_layer'"),
    (["--set", "model.n_head=5"], "model.n_head=5 does not divide model.d_model=192"),
    (["--set", "model.n_kv_head=4"], "model.n_kv_head=4 does not divide model.n_head=6"),
    (["--preset", "tyni"], "did you mean 'tiny'"),
    (["--set", "train.max_steps=ten"], "train.max_steps"),
    (["--max-steps", "-5"], "train.max_steps must be > 0"),
    (["--set", "schedule.name=linear"], "schedule.name='linear' is not valid"),
    (["--set", "model.n_layer"], "--set expects key=value"),
    (["--set", "optim.min_lr=1", "--set", "optim.lr=0.1"], "optim.min_lr=1.0 must be between 0"),
    (["--set", "train.batch_tokens=1000", "--max-steps", "1"], "not a multiple of micro_batch_size"),
    (["--budget-cap-usd", "-3"], "budget.cap_usd must be >= 0"),
    (
        ["--set", "train.inject_spike_at_step=5"],
        "train.inject_spike_at_step in --set is now drill.spike_at_step",
    ),
    (["--set", "train.oom_above=2"], "did you mean 'drill.oom_above'"),
    (["--set", "data.dataset=/nonexistent/data"], "is not a directory"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_config_exits_2_with_one_line(args, message, tmp_path):
    proc = pretrain("train", "--out", str(tmp_path / "run"), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_drills_have_their_own_section_and_old_checkpoints_keep_their_drill_keys(tmp_path):
    """A drill key is set under drill: only; a config file with an old name is refused naming the new one,
    while a checkpoint written before the move (its meta.json config) still reads, as the new keys."""
    cfg = load_config("tiny", overrides=["drill.spike_at_step=5", "drill.oom_above=2"])
    assert (cfg.drill.spike_at_step, cfg.drill.oom_above, cfg.drill.spike_batches) == (5, 2, 3)
    old_file = tmp_path / "old.yaml"
    old_file.write_text("train:\n  inject_oom_above: 2\n")
    with pytest.raises(ConfigError, match="train.inject_oom_above in config file .* is now drill.oom_above"):
        load_config("tiny", str(old_file))
    from app.config import config_from_dict

    saved = load_config("tiny").to_dict()
    del saved["drill"]
    saved["train"].update(inject_oom_above=2, inject_spike_at_step=7, spike_batches=4)
    drill = config_from_dict(saved).drill
    assert (drill.oom_above, drill.spike_at_step, drill.spike_batches) == (2, 7, 4)


def test_bad_yaml_file_is_one_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model: [unclosed\n")
    proc = pretrain("train", "--config", str(f))
    assert proc.returncode == 2 and "not valid YAML at line" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_print_config_shows_resolved_config_and_counts():
    proc = pretrain("train", "--preset", "x1-50m", "--set", "train.max_steps=5", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert "max_steps: 5" in proc.stdout and "n_kv_head: 4" in proc.stdout
    # 50,344,704 in the blocks and the final norm + 50,304 x 768 tied embedding/head (50,257 padded to 128s)
    assert "# parameters: 88,978,176 total, 50,344,704 non-embedding" in proc.stdout
    # 12 bytes a parameter (fp32 weights + AdamW's two moments), 5 of them on the volume at once
    assert (
        "# checkpoint: 1.07 GB each (fp32 weights + adamw state); checkpoint volume: at least 5.34 GB"
        in proc.stdout
    )


@pytest.mark.parametrize("print_config", [True, False], ids=["print-config", "train"])
def test_an_absurd_model_size_is_refused_before_anything_is_built(tmp_path, print_config):
    """A depth orders of magnitude beyond any preset (100,000 blocks: 630 GB of weights, gradients and
    optimizer state) is refused from the memory estimate alone, in one line, instead of building its
    parameter tables for minutes. The timeout is a hang guard, not a speed claim."""
    run = tmp_path / "run"
    flag = ["--print-config"] if print_config else ["--out", str(run), "--max-steps", "1"]
    proc = pretrain("train", "--set", "model.n_layer=100000", *flag, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "the model does not fit, whatever the batch" in lines[0] and "model.n_layer" in lines[0], lines
    assert proc.stdout == "" and not run.exists()


def test_print_config_of_a_gpu_sized_model_prints_on_a_small_machine_with_a_note():
    """--print-config is how a GPU run is prepared, often on a laptop: a 10.9B model (175 GB of weights,
    gradients and AdamW state) is measured against the largest known GPU, as for an unknown GPU type, and
    printed, with a note where this machine could not train it; training here is still refused."""
    from app.trainer import memory

    big = ["--set", "model.n_layer=40", "--set", "model.d_model=4096", "--set", "model.n_head=32"]
    big += ["--set", "model.d_ff=16384"]
    proc = pretrain("train", "--preset", "gpt2-124m", *big, "--print-config", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "n_layer: 40" in proc.stdout and "# parameters: 10,9" in proc.stdout
    cfg = load_config("gpt2-124m", overrides=[o for o in big if o != "--set"])
    if memory.estimate(cfg.model, 1, "ddp", 1, cuda=False).static > memory.host_memory_bytes():
        assert "#   note: this does not fit this machine" in proc.stdout, proc.stdout[-3000:]


def test_a_model_too_big_for_any_gpu_names_its_largest_part():
    """A vocabulary of 10^12 tokens: the embedding and head are what does not fit, so the line names
    model.vocab_size, not the depth or width."""
    proc = pretrain("train", "--set", "model.vocab_size=1000000000000", "--print-config", timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "make model.vocab_size smaller" in lines[0] and "model.n_layer" not in lines[0], lines


def test_print_config_shows_the_compile_mode_that_runs_under_fsdp(capsys, monkeypatch):
    """max-autotune's CUDA graphs break FSDP2's gathers, so an FSDP run compiles without them: the config
    printout says so (and why), not just the configured value; DDP keeps max-autotune."""
    from app.cli import main as cli_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    common = [
        "train",
        "--gpus",
        "8",
        "--set",
        "budget.gpu_type=h100-sxm",
        "--set",
        "train.compile_mode=max-autotune",
    ]
    for preset, want in [
        (
            "char-d64",
            "mode max-autotune-no-cudagraphs, not max-autotune (its CUDA graphs break FSDP2's gathers) under FSDP",
        ),
        ("x1-50m", "mode max-autotune (train.compile=auto"),
    ]:
        assert cli_main([*common, "--preset", preset, "--print-config"]) == 0
        (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("# compile:")]
        assert want in line, (preset, line)


def test_unknown_flag_is_one_line():
    proc = pretrain("train", "--max-stpes", "3")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "key,given,stored",
    [
        ("train.compile", "true", "true"),
        ("train.compile", "off", "false"),
        ("train.compile", "auto", "auto"),
        ("optim.fused", "false", "false"),
        ("budget.kube", "off", "off"),  # YAML reads `off` as a boolean: it must still mean off
        ("budget.kube", "true", "on"),
    ],
)
def test_switches_take_yaml_booleans(key, given, stored):
    cfg = load_config("tiny", overrides=[f"{key}={given}"])
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == stored
    with pytest.raises(ConfigError, match=f"{key}='maybe' is not valid"):
        load_config("tiny", overrides=[f"{key}=maybe"])


def test_print_config_says_what_the_loop_does_on_the_device():
    cpu = pretrain("train", "--print-config").stdout
    assert "# compile: off (train.compile=auto" in cpu and "# runtime (cpu): fp32" in cpu
    assert "# host syncs: none in the step" in cpu and "fused AdamW" in cpu
    gpu = pretrain(
        "train", "--preset", "x1-50m", "--gpu-type", "h100-sxm", "--gpus", "8", "--print-config"
    ).stdout
    assert "# runtime (cuda): bf16 autocast over fp32 master weights; TF32" in gpu
    assert "# compile: each transformer block and the loss, mode default" in gpu
    assert "into pinned memory" in gpu and "GQA without repeating K/V" in gpu
