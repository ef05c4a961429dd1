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

from app.budget.config import BudgetConfig, flag_for
from app.config import Config
from app.config_docs import field_help, flag_help, help_for, markdown, sections
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
    assert text == markdown(), "run `python -m app.config_docs > docs/config.md`"
    for key in ("drill.spike_at_step", "budget.cap_usd", "checkpoint.every_minutes"):
        assert f"| `{key}` |" in text


def test_flags_take_their_help_from_the_field():
    from app.budget.cli import WATCH_FIELDS
    from app.budget.cli import add_arguments as watch_arguments
    from app.trainer.args import add_arguments as train_arguments

    train = parser_of(train_arguments)
    for key, (flag, _) in CONFIG_FLAGS.items():
        assert help_of(train, flag).startswith(flag_help(help_for(key))), flag
    for name in ("out", "resume", "stop_file", "overwrite"):
        assert help_of(train, "--" + name.replace("_", "-")).startswith(flag_help(field_help(RunArgs)[name]))
    watch = parser_of(watch_arguments)
    for name in WATCH_FIELDS:
        assert help_of(watch, flag_for(name)).startswith(flag_help(field_help(BudgetConfig)[name])), name


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
    budget_flags = {flag for key, (flag, _) in CONFIG_FLAGS.items() if key.startswith("budget.")}
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
    from app.data.cli import CHOICE_FLAGS, VALUE_FLAGS
    from app.data.cli import add_arguments as prepare_arguments
    from app.data.settings import PrepareConfig

    helps = field_help(PrepareConfig)
    assert all(helps.values()), [name for name, text in helps.items() if not text]
    prepare = parser_of(prepare_arguments)
    field_of = {flag: name for flag, name, *_ in [*VALUE_FLAGS, *CHOICE_FLAGS]}
    field_of.update({"--input": "inputs", "--out": "out_dir", "--include": "includes"})
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
    from app.data.cli import add_arguments as prepare_arguments
    from app.data.cli import config_from_args
    from app.data.settings import PrepareConfig

    args = parser_of(prepare_arguments).parse_args(["--input", "corpus.txt", "--out", str(tmp_path)])
    from_flags = config_from_args(args)
    in_code = PrepareConfig(inputs=["corpus.txt"], out_dir=tmp_path)
    for field in dataclasses.fields(PrepareConfig):
        got, want = getattr(from_flags, field.name), getattr(in_code, field.name)
        assert str(got) == str(want), f"{field.name}: the flag's default {got!r}, the field's {want!r}"
