"""`pretrain eval` on tasks made here whose answers are known: the model's own greedy continuation is the
right choice (or, in a decoy task, the one it will not pick). lm-eval runs our task YAMLs over local
jsonl files (multiple choice and generation); the CORE bundle has multiple-choice and LM tasks."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.cli import main as cli_main
from app.trainer.model.generate import generate
from tests.inference_helpers import trained_run

pytest.importorskip("lm_eval", reason="the eval tests need the eval extra (make setup)")

PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder wi",
    "JULIET:\nO Romeo, Romeo! wherefore art tho",
    "HAMLET:\nTo be, or not to be, that is the que",
    "KING RICHARD III:\nNow is the winter of our disco",
    "MACBETH:\nIs this a dagger which I see befo",
    "First Citizen:\nBefore we proceed any further, hear me spe",
    "BRUTUS:\nThere is a tide in the affairs of me",
    "PORTIA:\nThe quality of mercy is not strai",
]


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    """Per prompt: the greedy 4-token continuation and 3 random-token decoys (token-stable texts only)."""
    from app.tools.sample import load_for_inference

    run = trained_run()
    model, tok, _ = load_for_inference(str(run), which="best")
    rng = random.Random(0)
    items = []
    for p in PROMPTS:
        ids = tok.encode(p)
        greedy = generate(model, torch.tensor([ids]), 4, temperature=0)[0, len(ids) :].tolist()
        text = tok.decode(greedy)
        if tok.eot_id in greedy or not text.strip() or tok.encode(p + text) != ids + greedy:
            continue  # keep items whose continuation re-tokenizes to exactly the greedy tokens
        decoys = []
        while len(decoys) < 3:
            d = tok.decode([rng.randrange(300, tok.vocab_size) for _ in range(4)])
            if d.isprintable() and d != text:
                decoys.append(d)
        items.append({"context": p, "greedy": text, "decoys": decoys})
    assert len(items) >= 4, "too few usable prompts"
    return run, items


def mc_docs(items, decoy: bool) -> list[dict]:
    docs = []
    for i, it in enumerate(items):
        choices = [it["greedy"], *it["decoys"]]
        random.Random(i).shuffle(choices)
        gold = choices.index(it["decoys"][0] if decoy else it["greedy"])
        docs.append({"context": it["context"], "choices": choices, "gold": gold})
    return docs


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MC_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""

GEN_YAML = """task: greedy_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{greedy}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["<never>"]
  max_gen_toks: 4
metric_list:
  - metric: exact_match
"""


ROLLING_YAML = """task: rolling_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
"""

# documents for loglikelihood_rolling: two longer than the model's window of 64 tokens, one short
DOCS = ["\n\n".join(PROMPTS), "\n".join(reversed(PROMPTS)) + "\n" + PROMPTS[0], PROMPTS[3]]


def own_logprob(model, tok, text: str) -> float:
    """log p(text) from the model itself, one forward per disjoint window of model.cfg.seq_len tokens, the
    first conditioned on the document boundary (the token before each window is its context)."""
    import torch.nn.functional as F

    ids, w = tok.encode(text), model.cfg.seq_len
    seq, total = [tok.eot_id, *ids], 0.0
    with torch.no_grad():
        for s in range(0, len(ids), w):
            target = ids[s : s + w]
            logp = F.log_softmax(model(torch.tensor([seq[s : s + len(target)]])).logits.float(), -1)[0]
            total += sum(logp[i, t].item() for i, t in enumerate(target))
    return total


def offline_mc_tasks(tmp_path, items, monkeypatch):
    """Two local multiple-choice tasks (the greedy answer right, and a decoy), HF offline: their dir."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, decoy in (("greedy_mc", False), ("decoy_mc", True)):
        data = write_jsonl(tmp_path / f"{name}.jsonl", mc_docs(items, decoy))
        (tasks / f"{name}.yaml").write_text(MC_YAML.format(name=name, data=data))
    return tasks


def test_lm_eval_tasks_give_the_known_accuracy(known, tmp_path, monkeypatch, capsys):
    run, items = known
    tasks = offline_mc_tasks(tmp_path, items, monkeypatch)
    data = write_jsonl(tmp_path / "gen.jsonl", items)
    (tasks / "greedy_gen.yaml").write_text(GEN_YAML.format(data=data))
    data = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCS])
    (tasks / "rolling_ppl.yaml").write_text(ROLLING_YAML.format(data=data))
    out = tmp_path / "results.json"
    assert (
        cli_main(
            [
                "eval",
                "--checkpoint",
                str(run),
                "--tasks",
                "greedy_mc,decoy_mc,greedy_gen,rolling_ppl",
                "--include-path",
                str(tasks),
                "--output",
                str(out),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    from lm_eval.utils import make_table

    res = json.loads(out.read_text())
    rows = [[c.strip() for c in line.split("|")] for line in make_table(res).splitlines()[2:]]
    table = {(r[1], r[5]): r[7] for r in rows}  # lm-eval's own reader: (task, metric) -> value
    assert table[("greedy_mc", "acc")] == "1.0000" and table[("decoy_mc", "acc")] == "0.0000"
    got = res["results"]
    assert got["greedy_mc"]["acc,none"] == 1.0  # the model prefers its own greedy continuation
    assert got["decoy_mc"]["acc,none"] == 0.0  # and never a random-token decoy
    assert got["greedy_gen"]["exact_match,none"] == 1.0  # generation reproduces it
    from app.tools.sample import load_for_inference

    model, tok, _ = load_for_inference(str(run), which="best")
    logp = sum(own_logprob(model, tok, d) for d in DOCS)  # the perplexity task: the model's own log p
    bpb = -logp / sum(len(d.encode()) for d in DOCS) / math.log(2)
    assert got["rolling_ppl"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-5)
    assert res["n-samples"]["greedy_mc"]["effective"] == len(items)
    ours = res["pretrain"]  # our fields beside lm-eval's
    assert (
        ours["step"] == 120 and ours["checkpoint"].endswith("step_000120") and ours["tasks"][0] == "greedy_mc"
    )
    assert "greedy_mc" in capsys.readouterr().out  # the results table


def test_core_bundle_and_results_in_the_run_dir_and_export(known, tmp_path):
    run, items = known
    bundle = tmp_path / "bundle"
    (bundle / "eval_data").mkdir(parents=True)
    mc = [{"query": d["context"], "choices": d["choices"], "gold": d["gold"]} for d in mc_docs(items, False)]
    decoy = [
        {"query": d["context"], "choices": d["choices"], "gold": d["gold"]} for d in mc_docs(items, True)
    ]
    lm = [{"context": it["context"], "continuation": it["greedy"]} for it in items]
    for name, rows in (("mc.jsonl", mc), ("decoy.jsonl", decoy), ("lm.jsonl", lm)):
        write_jsonl(bundle / "eval_data" / name, rows)
    (bundle / "core.yaml").write_text(
        "icl_tasks:\n"
        "- {label: mc, dataset_uri: mc.jsonl, num_fewshot: [0], icl_task_type: multiple_choice, continuation_delimiter: ''}\n"
        "- {label: decoy, dataset_uri: decoy.jsonl, num_fewshot: [0], icl_task_type: multiple_choice, continuation_delimiter: ''}\n"
        "- {label: lm, dataset_uri: lm.jsonl, num_fewshot: [0], icl_task_type: language_modeling, continuation_delimiter: ''}\n"
    )
    (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,25\ndecoy,25\nlm,0\n")
    run_copy = tmp_path / "run"
    import shutil

    shutil.copytree(run, run_copy)  # results go into the run dir: keep the shared cache clean
    assert (
        cli_main(["eval", "--checkpoint", str(run_copy), "--tasks", "core", "--core-dir", str(bundle)]) == 0
    )
    (path,) = (run_copy / "eval").glob("*.json")
    assert path.name == "step_000120-core.json"
    core = json.loads(path.read_text())["pretrain"]["core"]
    assert core["tasks"]["mc"]["accuracy"] == 1.0 and core["tasks"]["mc"]["centered"] == 1.0
    assert core["tasks"]["decoy"]["accuracy"] == 0.0
    assert core["tasks"]["decoy"]["centered"] == pytest.approx(-1 / 3)
    assert core["tasks"]["lm"]["accuracy"] == 1.0
    assert core["core"] == pytest.approx((1 - 1 / 3 + 1) / 3)

    out = tmp_path / "export"
    assert cli_main(["export", str(run_copy), "--output", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert "eval/step_000120-core.json" in manifest["files"]
    assert json.loads((out / "eval" / "step_000120-core.json").read_text())["pretrain"]["core"] == core
    assert manifest["evals"]["eval/step_000120-core.json"]["core"] == pytest.approx(core["core"])


def test_bad_eval_inputs_are_one_line(known, tmp_path, capsys):
    run, _ = known

    def fails(*args: str) -> str:
        assert cli_main(["eval", "--checkpoint", str(run), *args]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        return err

    assert "--core-dir" in fails("--tasks", "core")
    assert "no core.yaml" in fails("--tasks", "core", "--core-dir", str(tmp_path))
    assert "--limit" in fails("--tasks", "x", "--limit", "0")
    assert "not a directory" in fails("--tasks", "x", "--include-path", str(tmp_path / "nope"))
    assert not (run / "eval").exists()  # the results dir was probed, not left behind empty


def test_a_dir_without_checkpoints_is_the_one_error_line(tmp_path, capsys):
    """`--which best` (eval's default) on a dir with no checkpoint: the error alone, not first a note that
    none has a val loss (which only makes sense beside a latest to fall back to)."""
    empty = tmp_path / "no-run"
    empty.mkdir()
    assert cli_main(["eval", "--checkpoint", str(empty), "--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"error: no usable checkpoint under {empty}; train first with `pretrain train --out {empty}`"
    ], err


@pytest.mark.slow  # scans lm-eval's whole built-in task index (~10 s)
def test_unknown_task_is_one_line(known, tmp_path, capsys):
    run, _ = known
    assert cli_main(["eval", "--checkpoint", str(run), "--tasks", "no_such_task_xyz"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "unknown lm-eval task(s): no_such_task_xyz" in err


@pytest.mark.slow  # scans lm-eval's whole built-in task index, in a subprocess (~1 min on 2 cores)
def test_task_data_that_cannot_be_loaded_is_one_line_exit_2(known, tmp_path):
    """A built-in task offline with nothing cached (its dataset is on the Hub), and a task YAML of ours whose
    data file is gone: one line, exit 2, no traceback, no results file."""
    run, _ = known
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gone.yaml").write_text(MC_YAML.format(name="gone", data=tmp_path / "gone.jsonl"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "eval",
        "--checkpoint",
        str(run),
        "--limit",
        "2",
        "--output",
        str(out),
    ]

    def fails(*args: str) -> list[str]:
        proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert not out.exists()
        return proc.stderr.strip().splitlines()

    (line,) = fails("--tasks", "hellaswag")
    assert (
        line.startswith("error: lm-eval could not load the data of hellaswag") and "Rowan/hellaswag" in line
    )
    lines = fails("--tasks", "gone", "--include-path", str(tasks))  # lm-eval warns about our YAML first
    assert "lm-eval could not load the data of gone" in lines[-1] and "gone.jsonl" in lines[-1]


def test_loglikelihood_rolling_through_the_wrapper_is_the_models_own_logprob(known):
    """lm-eval's own Instance objects through the LM wrapper: per document, whatever the batch size."""
    from lm_eval.api.instance import Instance

    from app.tools.eval import make_lm
    from app.tools.sample import load_for_inference
    from app.tools.scoring import Scorer

    run, _ = known
    model, tok, _ = load_for_inference(str(run), which="best")
    assert len(tok.encode(DOCS[0])) > 2 * model.cfg.seq_len  # several windows
    reqs = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(DOCS)]
    want = [own_logprob(model, tok, d) for d in DOCS]
    for batch in (1, 16):
        got = make_lm(Scorer(model, tok, batch)).loglikelihood_rolling(reqs)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert want[2] < 0 and want[0] < want[2]  # a longer document is less likely


def test_missing_eval_extra_is_one_line_exit_2(known, tmp_path):
    """lm_eval not importable (a sitecustomize blocks it, as if the extra were not installed)."""
    run, _ = known
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['lm_eval'] = None  # not installed\n")
    env = {**os.environ, "PYTHONPATH": str(shim)}
    base = [
        sys.executable,
        "-m",
        "app.cli",
        "eval",
        "--checkpoint",
        str(run),
        "--output",
        str(tmp_path / "r.json"),
    ]
    blocked = subprocess.run([sys.executable, "-c", "import lm_eval"], env=env, capture_output=True)
    assert blocked.returncode == 1 and b"ModuleNotFoundError" in blocked.stderr  # the shim works
    proc = subprocess.run(
        [*base, "--tasks", "hellaswag"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'pretrain[eval]'" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "r.json").exists()


def tiny_bundle(path: Path) -> Path:
    """A one-item CORE bundle: enough for a whole `pretrain eval` in a second."""
    (path / "eval_data").mkdir(parents=True)
    (path / "eval_data" / "lm.jsonl").write_text(
        json.dumps({"context": "ROMEO:", "continuation": " O"}) + "\n"
    )
    (path / "core.yaml").write_text(
        "icl_tasks:\n- {label: lm, dataset_uri: lm.jsonl, num_fewshot: [0], icl_task_type: language_modeling}\n"
    )
    return path


def test_device_cuda_without_a_gpu_and_an_unwritable_output_fail_at_the_start(known, tmp_path, capsys):
    """One line, exit 2, before the model loads or any task runs (no CORE line printed)."""
    run, _ = known
    core = [
        "eval",
        "--checkpoint",
        str(run),
        "--tasks",
        "core",
        "--core-dir",
        str(tiny_bundle(tmp_path / "b")),
    ]

    def fails(*args: str) -> str:
        assert cli_main([*core, *args]) == 2
        cap = capsys.readouterr()
        assert len(cap.err.strip().splitlines()) == 1 and "CORE" not in cap.out, cap
        return cap.err

    if not torch.cuda.is_available():
        assert "--device cuda but no CUDA device" in fails(
            "--device", "cuda", "--output", str(tmp_path / "r.json")
        )
    err = fails("--output", "/proc/pretrain-eval/results.json")
    assert "--output /proc/pretrain-eval is not writable" in err and f"uid {os.getuid()}" in err
    assert "fsGroup" in err
    assert "is a directory" in fails("--output", str(tmp_path))
    assert cli_main([*core, "--output", str(tmp_path / "new" / "r.json")]) == 0  # a missing dir is made
    assert "CORE: " in capsys.readouterr().out and (tmp_path / "new" / "r.json").exists()


def test_an_unwritable_run_dir_fails_before_evaluating(known, tmp_path, capsys):
    """The default results dir (RUN_DIR/eval) on a read-only volume: one line at the start naming the
    path, the uid and --output; nothing evaluated."""
    import shutil

    run, _ = known
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    bundle = tiny_bundle(tmp_path / "b")
    if os.geteuid() != 0:
        copy.chmod(0o555)
    elif not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(copy)]).returncode != 0:
        pytest.skip("running as root on a filesystem without chattr +i: no directory is unwritable")
    try:
        code = cli_main(["eval", "--checkpoint", str(copy), "--tasks", "core", "--core-dir", str(bundle)])
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(copy)], check=True)
        copy.chmod(0o755)
    cap = capsys.readouterr()
    assert code == 2 and "CORE" not in cap.out
    (line,) = cap.err.strip().splitlines()
    assert f"results dir {copy / 'eval'} is not writable by uid {os.getuid()}" in line
    assert line.endswith("or pass --output FILE to write the results elsewhere")
    assert not (copy / "eval").exists()
