"""Config resolution and the one-line errors users get for bad configs (exit 2, no traceback)."""

from __future__ import annotations

import pytest
import yaml

from app.config import ConfigError, load_config
from tests.conftest import REPO, pretrain


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
    from app.trainer.parallel import memory

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


# ---------------------------------------------------------------- presets that name a base

FIXTURES = REPO / "tests" / "fixtures"


def _overlay(defaults: dict, changes: dict) -> dict:
    return {
        k: _overlay(v, changes.get(k, {})) if isinstance(v, dict) else changes.get(k, v)
        for k, v in defaults.items()
    }


def _printed_config(out: str) -> dict:
    """The YAML of --print-config's output (its `#` lines are comments)."""
    return yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("#")))


def test_every_preset_resolves_to_the_config_it_had_before_presets_named_a_base(capsys, monkeypatch):
    """tests/fixtures/preset-configs.yaml holds each preset's resolved config as it was before presets could
    name a base (its differences from the defaults); every preset, its bases applied, still prints exactly
    that (plan:, the GPUs a preset is made for, came after, and is checked on its own)."""
    from app.cli import main as cli_main
    from app.config import Config, preset_names

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = yaml.safe_load((FIXTURES / "preset-configs.yaml").read_text())
    assert sorted(before) == preset_names()
    defaults = Config().to_dict()
    for name in preset_names():
        # GPUs named (8 of unknown type) leave a preset's own plan aside: the YAML is the preset's alone
        assert cli_main(["train", "--preset", name, "--gpus", "8", "--print-config"]) == 0, name
        printed = _printed_config(capsys.readouterr().out)
        assert printed.pop("plan") == load_config(name).to_dict()["plan"]
        printed["budget"]["gpus"] = 0  # what --gpus 8 set
        want = {
            "preset": name,
            **_overlay({k: v for k, v in defaults.items() if k != "preset"}, before[name]),
        }
        del want["plan"]
        assert printed == want, f"{name} resolves differently from tests/fixtures/preset-configs.yaml"


def test_tiny_speedrun_is_tiny_with_a_shorter_run(capsys, monkeypatch):
    """tiny-speedrun names tiny as its base and says only its three differences; `pretrain train --preset
    tiny-speedrun --print-config` prints what it printed when the file spelled out all 45 lines
    (tests/fixtures/preset-configs.yaml), and tiny's config and model lines but for those three."""
    from app.cli import main as cli_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    keys = yaml.safe_load((REPO / "app" / "presets" / "tiny-speedrun.yaml").read_text())
    assert keys.pop("base") == "tiny"
    assert keys == {"train": {"max_steps": 240, "eval_every": 60}, "checkpoint": {"every_steps": 120}}
    speedrun = pretrain("train", "--preset", "tiny-speedrun", "--print-config")
    assert speedrun.returncode == 0, speedrun.stderr
    assert cli_main(["train", "--preset", "tiny", "--print-config"]) == 0
    tiny = capsys.readouterr().out
    printed, base = _printed_config(speedrun.stdout), _printed_config(tiny)
    want = yaml.safe_load((FIXTURES / "preset-configs.yaml").read_text())["tiny-speedrun"]
    assert printed["train"]["max_steps"] == want["train"]["max_steps"] == 240
    assert printed["checkpoint"]["every_steps"] == want["checkpoint"]["every_steps"] == 120
    for config in (printed, base):
        del config["preset"], config["train"]["max_steps"], config["train"]["eval_every"]
        del config["checkpoint"]["every_steps"]
    assert printed == base  # everything else is tiny's
    # the parameter, memory and optimizer lines below the YAML are tiny's too
    comments = [[ln for ln in out.splitlines() if ln.startswith("#")] for out in (speedrun.stdout, tiny)]
    assert comments[0] == comments[1]


def test_the_speedrun_switches_are_written_once():
    """The block of model switches lives in one base (app/presets/recipes/speedrun.yaml); the presets on
    the speedrun recipe name it instead of repeating it."""
    switches = ("qk_norm", "embed_norm", "zero_init", "logit_softcap", "x0_skip", "unet_skips")
    files = sorted((REPO / "app" / "presets").rglob("*.yaml"))
    writing = [p.name for p in files if any(f"  {s}:" in p.read_text() for s in switches)]
    assert writing == ["speedrun.yaml"], writing
    for name in ("tiny", "gpt2-124m-speedrun"):
        cfg = load_config(name)
        assert all(getattr(cfg.model, s) for s in switches), name
        assert cfg.model.mlp == "relu2" and cfg.optim.name == "muon" and cfg.schedule.name == "wsd"


@pytest.fixture
def preset_dir(tmp_path, monkeypatch):
    """A folder of presets of the test's own, read in place of app/presets/ (the one seam: its path)."""
    from app.config import presets

    folder = tmp_path / "presets"
    (folder / "recipes").mkdir(parents=True)
    (folder / "small.yaml").write_text(
        "model:\n  n_layer: 2\n  d_model: 64\n  n_head: 2\n  loop:\n    loss_weights: [1, 2]\n"
    )
    (folder / "recipes" / "fast.yaml").write_text("optim:\n  name: muon\n  lr: 0.01\n")
    monkeypatch.setattr(presets, "PRESET_DIR", folder)
    return folder


def test_a_base_is_applied_first_key_by_key(preset_dir):
    """The base's keys, then the preset's, merged key by key in every section; a list replaced whole;
    a chain of bases applied deepest first; a base under a folder (recipes/) is no preset of its own."""
    (preset_dir / "wider.yaml").write_text(
        "base: small\nmodel:\n  d_model: 128\n  loop:\n    loss_weights: [3]\n"
    )
    (preset_dir / "deeper.yaml").write_text("base: wider\nmodel:\n  n_layer: 5\n")  # a chain: small, wider
    (preset_dir / "fast-small.yaml").write_text("base: recipes/fast\nmodel:\n  n_layer: 3\n")
    cfg = load_config("wider")
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head) == (2, 128, 2)
    assert cfg.model.loop.loss_weights == [3.0] and cfg.preset == "wider"
    deeper = load_config("deeper").model
    assert (deeper.n_layer, deeper.d_model, deeper.n_head) == (5, 128, 2)
    fast = load_config("fast-small")
    assert (fast.optim.name, fast.optim.lr, fast.model.n_layer) == ("muon", 0.01, 3)
    from app.config import preset_names

    assert preset_names() == ["deeper", "fast-small", "small", "wider"]
    with pytest.raises(ConfigError, match="unknown preset 'recipes/fast'"):
        load_config("recipes/fast")


# (files, the preset named, the file the line names, what it says)
BAD_BASES = [
    ({"a.yaml": "base: b\n", "b.yaml": "base: a\n"}, "b", "bases go round in a circle (a -> b -> a)"),
    ({"a.yaml": "base: a\n"}, "a", "bases go round in a circle (a -> a)"),
    ({"a.yaml": "base: smal\n"}, "a", "unknown base 'smal'; did you mean 'small'?"),
    ({"a.yaml": "base: ../small\n"}, "a", "base must name a preset"),
    ({"a.yaml": "base: [small]\n"}, "a", "base must name a preset"),
]


@pytest.mark.parametrize("files,culprit,message", BAD_BASES, ids=[m for *_, m in BAD_BASES])
def test_a_bad_base_is_refused_in_one_line(preset_dir, files, culprit, message, capsys):
    """Through `pretrain train` (in this process, so that it reads the test's presets): exit 2, one line
    naming the preset file and what to do."""
    from app.cli import main as cli_main

    for name, text in files.items():
        (preset_dir / name).write_text(text)
    assert cli_main(["train", "--preset", "a", "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: preset {culprit} (presets/{culprit}.yaml): "), err
    assert message in err[0]


def test_a_config_file_names_its_preset_not_a_base(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: tiny\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="`base:` is for presets .* with `preset: NAME`"):
        load_config(config_file=str(f))


# ---------------------------------------------------------------- the GPUs a preset is made for


def test_char_d64_prints_its_8_gpu_plan(tmp_path, capsys, monkeypatch):
    """char-d64 is made for 8 H100s (its plan: section): told no GPUs, --print-config plans for them as
    --gpus 8 --gpu-type h100-sxm does, and exits 0 (it once refused: "does not fit ... on one rank")."""
    from app.cli import main as cli_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    own = pretrain("train", "--preset", "char-d64", "--print-config", timeout=120)
    assert own.returncode == 0, own.stderr
    assert own.stdout.startswith("# batch layout for plan.gpu_type, the GPUs the config is made for")
    assert "# memory per GPU at world size 8 (CUDA, bf16" in own.stdout
    assert "#   device memory: 85.0 GB" in own.stdout and "-> fsdp" in own.stdout
    flags = ["--gpus", "8", "--gpu-type", "h100-sxm"]
    assert cli_main(["train", "--preset", "char-d64", *flags, "--print-config"]) == 0
    assert own.stdout.splitlines()[1:] == capsys.readouterr().out.splitlines()[1:]
    # GPUs named on the command line win: one GPU of unknown type, where the model cannot train
    assert cli_main(["train", "--preset", "char-d64", "--gpus", "1", "--print-config"]) == 2
    assert "does not fit, whatever the batch" in capsys.readouterr().err
    # and a run trains on the GPUs it has: here, this machine, where it does not fit
    assert cli_main(["train", "--preset", "char-d64", "--out", str(tmp_path / "run")]) == 2
    assert "does not fit, whatever the batch" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_pretrain_plan_marks_the_row_a_preset_is_made_for(capsys):
    """`pretrain plan --preset char-d64` prices every GPU type and count as before, and marks the row of the
    GPUs the preset is made for; a preset without a plan: section, or a table narrowed elsewhere, marks none."""
    from app.tools import plan

    assert plan.main(["--preset", "char-d64"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith(" *")]
    assert len(rows) == 1 and rows[0].split()[:2] == ["8", "h100-sxm"], rows
    for argv in (["--preset", "char-d64", "--gpus", "4"], ["--preset", "x1-50m"]):
        assert plan.main(argv) == 0
        assert not [line for line in capsys.readouterr().out.splitlines() if line.endswith(" *")], argv


def test_parsing_only_parses_the_estimate_is_the_planning_step(monkeypatch):
    """Reading the command line builds the config and nothing more; the memory estimate (the size check,
    the batch layout) is the planning step the command runs after it."""
    import argparse

    from app.errors import UserError
    from app.trainer.args import add_arguments, config_from_args, plan_run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--set", "model.n_layer=100000", "--print-config"])
    cfg = config_from_args(args)  # no estimate here: an absurd size parses
    assert cfg.model.n_layer == 100000
    with pytest.raises(UserError, match="does not fit, whatever the batch"):
        plan_run(cfg, args)
    args = parser.parse_args(["--preset", "x1-50m", "--gpu-type", "h100-sxm", "--gpus", "8"])
    cfg = config_from_args(args)
    assert cfg.train.micro_batch_size == "auto"  # the layout is the planning step's
    plan_run(cfg, args)
    assert isinstance(cfg.train.micro_batch_size, int) and cfg.train.device_memory_gb == 85.0


def test_bench_runs_the_planning_step():
    """`pretrain bench` refuses a model that cannot fit before building it, as `pretrain train` does."""
    proc = pretrain("bench", "--set", "model.n_layer=100000", "--steps", "1", "--warmup", "0", timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "does not fit, whatever the batch" in lines[0], (
        proc.stderr
    )


def test_a_plan_names_a_gpu_type_with_a_known_memory():
    with pytest.raises(ConfigError, match="plan.gpu_type='h900' is not a GPU type whose memory is known"):
        load_config("tiny", overrides=["plan.gpu_type=h900"])
    assert load_config("tiny", overrides=["plan.gpu_type=H100 SXM"]).plan.gpu_type == "H100 SXM"
