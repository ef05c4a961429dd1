"""One help text and one name per setting. The comment of a config dataclass field is the help of the flag
that sets it, of docs/config.md and of the chart value that becomes it; and a value has one name on every
surface, derived by rule: the field budget.cap_usd is the chart's budget.capUSD and the flag
--budget-cap-usd in `pretrain train` and `pretrain watch` alike."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

import pytest
import yaml

from app.config import Config
from app.config.budget import BudgetConfig, flag_for
from app.config.docs import field_help, help_for, markdown, sections
from app.config.flags import flag_help, owner_of
from app.trainer.args import CONFIG_FLAGS, RunArgs
from tests import k8s_helpers as h
from tests.conftest import REPO, pretrain


def parser_of(add_arguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def help_of(parser: argparse.ArgumentParser, flag: str) -> str:
    (action,) = [action for action in parser._actions if flag in action.option_strings]
    return action.help


def test_every_setting_has_help():
    missing = []
    for prefix, cls in [*sections(Config), ("", RunArgs)]:
        hints = typing.get_type_hints(cls)
        for name, text in field_help(cls).items():
            if not text and not dataclasses.is_dataclass(hints[name]):
                missing.append(f"{prefix}{name}")
    assert missing == [], "give these fields a comment: it is their help everywhere"


def test_the_help_is_read_from_the_comments_above_and_after_a_field():
    assert help_for("budget.cap_usd").startswith("spend cap in US dollars")  # at the end of its line
    assert help_for("train.micro_batch_size").startswith("sequences per rank per forward pass")  # above it
    # two comment lines above and none after: joined into one text
    assert help_for("budget.opencost_selector").endswith("e.g. label:training.kubeflow.org/job-name:NAME")


def test_docs_config_md_is_generated_from_the_fields():
    text = (REPO / "docs" / "config.md").read_text()
    assert text == markdown(), "run `python -m app.config.docs > docs/config.md`"
    for key in ("drill.spike_at_step", "budget.cap_usd", "checkpoint.every_minutes"):
        assert f"| `{key}` |" in text


@pytest.fixture
def help_of_command(capsys, monkeypatch):
    """`pretrain COMMAND --help` as the CLI prints it (in this process: torch is imported once), wide
    enough that no help text wraps."""
    from app.cli import main

    monkeypatch.setenv("COLUMNS", "100000")

    def shown(command: str) -> str:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        return capsys.readouterr().out

    return shown


def helps_shown(text: str) -> dict[str, str]:
    """{flag: its help} in a --help text."""
    helps: dict[str, str] = {}
    flags: list[str] = []
    for line in text.splitlines():
        option = re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if option:
            flags = [part.split()[0] for part in re.split(r", (?=-)", option.group(1))]
            text = option.group(2) or ""
        elif flags and line.startswith("      ") and line.strip():
            text = line.strip()  # the help on the line below a long flag
        else:
            flags = []
            continue
        for flag in flags:
            helps[flag] = text
    return helps


def flag_tables():
    """(command, root dataclass, flags) of every table of flags generated from fields."""
    from app.budget.cli import WATCH_FLAGS
    from app.config import PrepareConfig
    from app.data.cli import PREPARE_FLAGS
    from app.trainer.args import OUT_FLAG, OVERWRITE_FLAG, RUN_FLAGS

    return [
        ("train", Config, CONFIG_FLAGS),
        ("train", RunArgs, (OUT_FLAG, *RUN_FLAGS, OVERWRITE_FLAG)),
        ("watch", BudgetConfig, WATCH_FLAGS),
        ("prepare", PrepareConfig, PREPARE_FLAGS),
    ]


def test_each_flag_help_is_its_field_comment(help_of_command):
    """What --help prints for a flag generated from a field is the field's comment, read from the source
    here, followed at most by its default or the config key it sets: one text, never a copy that drifts."""
    checked = 0
    for command, root, flags in flag_tables():
        shown = helps_shown(help_of_command(command))
        for spec in flags:
            cls, name = owner_of(root, spec.field)
            comment = " ".join(field_help(cls)[name].split())
            assert comment, f"{cls.__name__}.{name} has no comment"
            text = shown[spec.flag]
            assert text.startswith(comment), (command, spec.flag, text, comment)
            # after the comment: at most its default, then the config key the flag sets
            note = rf"( \(default: [^)]+\))?( \({re.escape(spec.field)}\))?"
            assert re.fullmatch(note, text[len(comment) :]), (spec.flag, text)
            checked += 1
    assert checked >= 40  # every table was read


def test_flags_keep_their_names_and_metavars(help_of_command):
    """The CLI surface is stable (docs/contracts.md): generating the flags kept each name and metavar."""
    usage = help_of_command("train")
    train = helps_shown(usage)
    flags = "--out --max-steps --metrics-port --budget-cap-usd --price-per-gpu-hour --gpus"
    flags += " --max-price-per-gpu-hour --resume --stop-file --overwrite --gpu-type --print-config"
    assert set(flags.split()) <= set(train), set(flags.split()) - set(train)
    for part in ["[--out RUN_DIR]", "[--max-steps N]", "[--budget-cap-usd X]", "[--resume auto|never|PATH]"]:
        assert part in usage, part
    usage = help_of_command("prepare")
    for part in [
        "--input PATH|hf://datasets/OWNER/NAME[?include=GLOB]",
        "--out DATA_DIR",
        "[--vocab-size VOCAB_SIZE]",
    ]:
        assert part in usage, part
    assert "[--tokenizer-sample-bytes N]" in usage and "[--include GLOB]" in usage and "[--finalize]" in usage
    usage = help_of_command("watch")
    assert "[--budget-cap-usd CAP_USD]" in usage and "[--source {static,file,opencost}]" in usage


def starts_with_help(param: str, own_help: str) -> bool:
    """A chart value's `## @param` text begins with its field's help (as a sentence: any first letter case)."""
    return param[:1].lower() == own_help[:1].lower() and param[1 : len(own_help)] == own_help[1:]


def chart_name(field: str) -> str:
    """The chart's name of budget.<field>: camelCase, with USD as the acronym (cap_usd -> capUSD)."""
    first, *rest = field.split("_")
    return first + "".join("USD" if part == "usd" else part.capitalize() for part in rest)


def test_one_name_per_budget_value_across_chart_cli_and_config():
    """Every budget value of the chart is a BudgetConfig field of the same name; the watcher sidecar gets
    it as that field's flag, the trainer as the same flag or its key, and its `## @param` line starts
    with the field's help."""
    text = (h.CHART / "values.yaml").read_text()
    chart = {name for name in yaml.safe_load(text)["budget"] if name != "watcher"}
    fields = {chart_name(field.name): field.name for field in dataclasses.fields(BudgetConfig)}
    assert chart - set(fields) == set(), "a chart budget value with no BudgetConfig field of its name"
    given = {
        "budget.capUSD": 123.5,
        "budget.gpuType": "h100-sxm",
        "budget.pricePerGpuHour": 2.25,
        "budget.idleAllowanceSeconds": 77,
        "budget.source": "opencost",
        "budget.sourcePath": "/ckpt/spend.json",
        "budget.opencostUrl": "http://opencost.opencost:9003",
        "budget.opencostSelector": "label:team:nlp",
    }
    assert set(given) == {f"budget.{name}" for name in chart}
    docs = h.render(given)
    master = h.pod_spec(h.one(docs, "PyTorchJob"), "Master")
    watcher = h.container(master, "budget-watcher", init=True)["args"]
    trainer = h.container(master, "pytorch")["args"]
    for value_name, value in given.items():
        field = fields[value_name.removeprefix("budget.")]
        flag = flag_for(field)
        assert watcher[watcher.index(flag) + 1] == str(value), (value_name, flag)
        param = re.search(rf"^\s*## @param {re.escape(value_name)} (.*)$", text, re.M).group(1)
        assert starts_with_help(param, field_help(BudgetConfig)[field]), value_name
    assert trainer[trainer.index("--budget-cap-usd") + 1] == "123.5"
    assert trainer[trainer.index("--price-per-gpu-hour") + 1] == "2.25"
    assert "budget.gpu_type=h100-sxm" in trainer
    # pretrain train names the budget's values as the watcher does
    budget_flags = {spec.flag for spec in CONFIG_FLAGS if spec.field.startswith("budget.")}
    assert budget_flags == {"--budget-cap-usd", "--price-per-gpu-hour", "--gpus", "--max-price-per-gpu-hour"}


@pytest.mark.parametrize("flag", ["--budget-cap-usd", "--cap-usd"])
def test_watch_reads_the_cap_by_its_name_and_by_its_old_one(flag, tmp_path):
    args = ["--run-dir", str(tmp_path / "run"), "--price-per-gpu-hour", "2", "--gpus", "1", "--kube", "off"]
    proc = pretrain("watch", flag, "10", *args, "--dry-run-budget")
    assert proc.returncode == 0, proc.stderr
    assert "cap $10.0000" in proc.stdout
    note = "note: --cap-usd is now --budget-cap-usd; reading it as that"
    assert (note in proc.stderr) == (flag == "--cap-usd"), proc.stderr


def test_prepare_flags_and_chart_values_take_their_help_from_prepare_config():
    """`pretrain prepare`'s flags get their help from PrepareConfig's fields; the chart's prepare values
    that become flags are named like the flag (textColumn: --text-column) and their `## @param` line starts
    with the field's help."""
    from app.config import PrepareConfig
    from app.data.cli import PREPARE_FLAGS
    from app.data.cli import add_arguments as prepare_arguments

    helps = field_help(PrepareConfig)
    assert all(helps.values()), [name for name, text in helps.items() if not text]
    prepare = parser_of(prepare_arguments)
    field_of = {spec.flag: spec.field for spec in PREPARE_FLAGS}
    for flag, name in field_of.items():
        assert help_of(prepare, flag).startswith(flag_help(helps[name])), flag
    text = (h.CHART / "values.yaml").read_text()
    given = {"prepare.textColumn": "body", "prepare.tokenizer": "bpe", "prepare.valFraction": 0.05}
    given |= {"prepare.vocabSize": 4096, "prepare.workers": 3}
    job = h.prepare_job(h.render(given))["spec"]["template"]["spec"]["containers"][0]["args"]
    for value_name, value in given.items():
        flag = "--" + re.sub(r"([A-Z])", r"-\1", value_name.removeprefix("prepare.")).lower()
        assert job[job.index(flag) + 1] == str(value), flag
        param = re.search(rf"^\s*## @param {re.escape(value_name)} (.*)$", text, re.M).group(1)
        own_help = helps[field_of[flag]]
        assert starts_with_help(param, own_help), value_name
        assert f"(`{flag}`" in param, value_name  # and names the flag it becomes


def test_prepare_without_options_prepares_with_prepare_configs_defaults(tmp_path):
    """A flag left out means its field's default, so the flags and PrepareConfig hold one set of defaults.
    Once --tokenizer-sample-bytes said 256M and the field 256 MiB."""
    from app.config import PrepareConfig
    from app.data.cli import add_arguments as prepare_arguments
    from app.data.cli import config_from_args

    args = parser_of(prepare_arguments).parse_args(["--input", "corpus.txt", "--out", str(tmp_path)])
    from_flags = config_from_args(args)
    in_code = PrepareConfig(inputs=["corpus.txt"], out_dir=tmp_path)
    for field in dataclasses.fields(PrepareConfig):
        got, want = getattr(from_flags, field.name), getattr(in_code, field.name)
        assert str(got) == str(want), f"{field.name}: the flag's default {got!r}, the field's {want!r}"
