"""`pretrain export --format hf`: the folder loads in Hugging Face transformers and is the same model.

For every path (a trained classic run through the CLI; written checkpoints of classic tied and untied
models, GQA and plain attention, a vocabulary that is not a multiple of 64, the tiny preset with every
switch on, each switch alone, a looped model with deep supervision, the char tokenizer) the exported folder
loads with AutoModelForCausalLM (trust_remote_code only for our own code) and AutoTokenizer, and against
our own model loaded from the same checkpoint: fp32 logits over a full sequence agree to 1e-5, greedy
`generate` (transformers' KV cache) gives our greedy tokens, a left-padded batch gives the rows of the
unpadded ones, and the tokenizer gives our ids. lm-eval's own `hf` model, run as its CLI, scores a local
task as `pretrain eval` does. The checkpoints of the switch matrix are written through the checkpoint
package with random non-zero weights (zero-initialised projections would hide a mistake), into run dirs
the export reads like any other.

vLLM (no CPU wheel on PyPI) and llama.cpp's converter (not packaged) cannot run here: docs/serving.md.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.cli import main as cli_main
from app.config import LoopConfig, ModelConfig, load_config
from app.data.corpus import documents
from app.data.tokenizer import Tokenizer, load_tokenizer, train_bpe, train_char
from app.tools.hf_export import SWITCHES as NEUTRAL
from app.tools.sample import load_for_inference
from app.trainer.checkpoint.writer import CheckpointWriter
from app.trainer.model.generate import generate
from app.trainer.model.gpt import build_model
from tests.conftest import CACHE, cli_env, pretrain
from tests.inference_helpers import trained_run

pytest.importorskip("transformers", reason="the Hugging Face export tests need the eval extra (make setup)")

TEXTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "  two spaces, a tab\tand trailing space ",
    "Ünïcödé and an emoji 😀, digits 1234.",
]
SMALL = {"seq_len": 64, "n_layer": 2, "d_model": 64, "n_head": 4}
SWITCHES = {  # each model switch of docs/recipes.md, on
    "mlp": "relu2",
    "qk_norm": True,
    "attn_scale": 0.2,
    "parameter_free_norms": True,
    "embed_norm": True,
    "logit_softcap": 15.0,
    "value_embeds": 1,
    "x0_skip": True,
    "unet_skips": True,
}
LOOPED = {"loop": LoopConfig(prelude=1, recurrent=2, coda=1, recurrence=3, deep_supervision=True)}


# ---------------------------------------------------------------- run dirs and exports


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is faster than two that wait on each other (and on the
    other tests' processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return list(itertools.islice(documents(), 40))


def bpe_2048() -> Tokenizer:
    (data,) = CACHE.glob("shakespeare-bpe2048-*")  # the embedded corpus, prepared by conftest
    return load_tokenizer(data)


def write_run(
    root: Path, tok: Tokenizer, seed: int = 0, preset: str | None = None, newer: bool = False, **model
) -> Path:
    """A run dir as `pretrain train` leaves it (one checkpoint with its tokenizer, a metrics log), holding
    a model of random non-zero weights written through the checkpoint package. newer: the model has a
    weight this version's GPT does not (as a checkpoint of a later version would)."""
    cfg = load_config(preset)
    base = vars(cfg.model) if preset else SMALL  # a preset's model, or a small one with the switches off
    cfg.model = ModelConfig(**{**base, **model, "vocab_size": tok.vocab_size})
    torch.manual_seed(seed)
    net = build_model(cfg.model)
    if newer:
        net.register_parameter("later_gate", torch.nn.Parameter(torch.ones(3)))
    with torch.no_grad():
        for p in net.parameters():  # matrices around 0, gains and mixing weights around 1
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() > 1 else 0.2) + (p.dim() == 1))
    root.mkdir(parents=True)
    tok.save(root)
    rows = [
        {"kind": "event", "event": "start", "step": 0},
        {"kind": "eval", "step": 5, "val_loss": 3.5, "val_bpb": 1.25},
    ]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"config": cfg.to_dict(), "tokens": 5 * 1024, "val_loss": 3.5}
    CheckpointWriter(root, 0, 1).save(5, net, None, {"step": 5}, meta, extra_files=[root / "tokenizer.json"])
    (root / "tokenizer.json").unlink()  # only the checkpoint carries it, as in a real run dir
    return root


def export(run: Path, out: Path, *flags: str) -> str:
    """`pretrain export RUN --output OUT --format hf FLAGS` in-process; its stdout."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli_main(["export", str(run), "--output", str(out), "--format", "hf", *flags]) == 0
    return stdout.getvalue()


# ---------------------------------------------------------------- the checks every path passes


def greedy_until_eot(tokens: list[int], eot: int) -> list[int]:
    """Tokens up to and including the first document boundary (where `generate` stops)."""
    return tokens[: tokens.index(eot) + 1] if eot in tokens else tokens


def assert_same_model(run: Path, out: Path, custom: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, tok, _ = load_for_inference(str(run), which="latest")
    cfg = ours.cfg
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=custom).eval()
    assert type(model).__name__ == ("PretrainGPTForCausalLM" if custom else "LlamaForCausalLM")
    assert model.config.vocab_size == cfg.vocab_size  # the padded rows are gone
    hf_tok = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = hf_tok(text)["input_ids"]
        assert ids == tok.encode(text), text
        assert hf_tok.decode(ids) == tok.decode(ids)
    assert hf_tok.eos_token_id == tok.eot_id == model.generation_config.eos_token_id

    ids = torch.tensor([tok.encode("\n\n".join(TEXTS * 40))[: cfg.seq_len]])
    assert ids.shape[1] == cfg.seq_len
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours(ids).logits, rtol=0, atol=1e-5)

    # greedy decoding through transformers' KV cache, one row and a left-padded batch of three
    prompts = [ids[0, :12].tolist(), ids[0, 20:25].tolist(), ids[0, 40:49].tolist()]
    new = 16
    want = [generate(ours, torch.tensor([p]), new, temperature=0)[0, len(p) :].tolist() for p in prompts]
    one = model.generate(torch.tensor([prompts[0]]), max_new_tokens=new, do_sample=False)[0, 12:].tolist()
    assert one == greedy_until_eot(want[0], tok.eot_id)
    width = max(map(len, prompts))
    batch = torch.tensor([[tok.eot_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    rows = model.generate(batch, attention_mask=mask, max_new_tokens=new, do_sample=False)[:, width:]
    for row, expected in zip(rows.tolist(), want, strict=True):
        assert greedy_until_eot(row, tok.eot_id) == greedy_until_eot(expected, tok.eot_id)

    # the padded batch's logits are the rows' own: Llama numbers positions from a row's start unless
    # told (generate tells it, as here); our own code counts a row's real tokens itself
    positions = {} if custom else {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, **positions).logits
        for r, p in enumerate(prompts):
            alone = model(torch.tensor([p])).logits[0]
            torch.testing.assert_close(padded[r, width - len(p) :], alone, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- the paths


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, str]:
    """The inference tests' run (trained through the CLI: classic, tied, GQA), exported through the CLI."""
    run = trained_run()
    out = tmp_path_factory.mktemp("hf") / "trained"
    return run, out, export(run, out)


def test_a_trained_classic_run_is_a_plain_llama(trained):
    run, out, stdout = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4  # GQA
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-5
    assert not list(out.glob("*.py"))  # no custom code: transformers' own Llama
    assert "LlamaForCausalLM" in stdout and "trust_remote_code" not in stdout
    assert_same_model(run, out, custom=False)


def test_generation_config_is_pretrain_samples_defaults(trained):
    from transformers import GenerationConfig

    from app.tools.sample import add_arguments

    run, out, _ = trained
    flags = argparse.ArgumentParser()
    add_arguments(flags)
    generation = GenerationConfig.from_pretrained(out)
    for key in ("temperature", "top_k", "top_p", "max_new_tokens"):
        assert getattr(generation, key) == flags.get_default(key), key
    eot = load_tokenizer(next(run.glob("checkpoints/step_*"))).eot_id
    assert generation.do_sample and generation.eos_token_id == generation.pad_token_id == eot


def test_untied_plain_attention_with_a_vocabulary_off_64(tmp_path, corpus):
    tok = train_bpe(corpus, 1000)
    assert tok.vocab_size % 64 and ModelConfig(vocab_size=tok.vocab_size).padded_vocab == 1024
    run = write_run(tmp_path / "run", tok, tie_embeddings=False, n_kv_head=0)
    export(run, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == 1000
    assert_same_model(run, tmp_path / "hf", custom=False)


def test_char_tokenizer(tmp_path, corpus):
    tok = train_char(corpus)
    run = write_run(tmp_path / "run", tok, seed=1, n_kv_head=2)
    export(run, tmp_path / "hf")
    tokenizer = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "WordLevel" and tokenizer["decoder"]["type"] == "Fuse"
    assert_same_model(run, tmp_path / "hf", custom=False)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok("§")["input_ids"] == tok.encode("§") == [1]  # outside the alphabet: the unknown id


def test_tiny_preset_with_every_switch_needs_its_own_code(tmp_path):
    from transformers import AutoModelForCausalLM

    # the tiny preset's switches, and the two it leaves off
    run = write_run(tmp_path / "run", bpe_2048(), preset="tiny", attn_scale=0.12, parameter_free_norms=True)
    model = load_for_inference(str(run))[0].cfg
    assert all(getattr(model, k) != off for k, off in NEUTRAL.items()), model  # every switch on
    stdout = export(run, tmp_path / "hf")
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["PretrainGPTForCausalLM"] and config["final_logit_softcapping"] == 15
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    for name in ("configuration_pretrain_gpt.py", "modeling_pretrain_gpt.py"):  # torch and transformers only
        tree = ast.parse((out / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        assert {m.split(".")[0] for m in imported} <= {"math", "torch", "transformers"}, imported
    assert "trust_remote_code=True" in stdout
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(out)
    assert_same_model(run, out, custom=True)
    ours, tok, _ = load_for_inference(str(run))
    eager = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, attn_implementation="eager")
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():  # the written-out attention (no kernel) is the same model
        torch.testing.assert_close(eager(ids).logits, ours(ids).logits, rtol=0, atol=1e-5)


def test_a_looped_model_gives_each_loop_its_own_cache_layer(tmp_path):
    """Exported by the CLI in a process without transformers (nor lm-eval): the container image has no
    eval extra, and its export Job writes the folder all the same."""
    run = write_run(
        tmp_path / "run", bpe_2048(), seed=2, n_kv_head=2, unet_skips=True, value_embeds=1, **LOOPED
    )
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\nsys.modules['transformers'] = sys.modules['lm_eval'] = None\n"
    )
    env = cli_env(PYTHONPATH=str(shim))
    blocked = subprocess.run([sys.executable, "-c", "import transformers"], env=env, capture_output=True)
    assert blocked.returncode == 1 and b"ModuleNotFoundError" in blocked.stderr  # the shim works
    proc = pretrain("export", str(run), "--output", str(tmp_path / "hf"), "--format", "hf", env=env)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["block_order"] == [0, 1, 2, 1, 2, 1, 2, 3] and config["num_hidden_layers"] == 8
    assert_same_model(run, tmp_path / "hf", custom=True)


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_each_switch_alone(tmp_path, switch):
    run = write_run(tmp_path / "run", bpe_2048(), seed=3, n_kv_head=2, **{switch: SWITCHES[switch]})
    export(run, tmp_path / "hf")
    assert_same_model(run, tmp_path / "hf", custom=True)


# ---------------------------------------------------------------- the folder


def test_shards_bfloat16_and_force_leaves_no_stale_shard(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run = write_run(tmp_path / "run", bpe_2048(), tie_embeddings=False)
    out = tmp_path / "hf"
    export(run, out, "--max-shard-size", "200k", "--dtype", "bfloat16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    for shard in shards:  # at most 200 kB of tensors each, unless one tensor alone is larger
        held = [n for n, f in index["weight_map"].items() if f == shard.name]
        assert len(held) == 1 or shard.stat().st_size <= 200_000 + 8 * 1024, (shard.name, held)
    with safe_open(shards[0], "pt") as f:
        assert f.metadata()["format"] == "pt" and f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    ours, _, _ = load_for_inference(str(run))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    vocab = ours.cfg.vocab_size
    assert torch.equal(
        model.lm_head.weight, ours.head.weight[:vocab].to(torch.bfloat16)
    )  # cast, nothing else
    assert torch.equal(
        model.model.layers[1].mlp.down_proj.weight, ours.blocks[1].mlp.w_down.weight.bfloat16()
    )

    export(run, out, "--force")  # one file now: the shards and their index go
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert not list(out.glob(".pretrain-export*"))
    assert_same_model(run, out, custom=False)


def read_card(path: Path) -> tuple[dict, str]:
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)  # the Hub client's own parser and metadata checks
    return card.data.to_dict(), card.text


def test_model_card(tmp_path):
    run = write_run(tmp_path / "run", bpe_2048(), seed=4, **LOOPED)
    data_dir = tmp_path / "data"  # a data dir prepared from a Hub dataset
    data_dir.mkdir()
    sources = ["hf://datasets/acme/prose/train/0.parquet", "hf://datasets/acme/prose/train/1.parquet"]
    (data_dir / "manifest.json").write_text(json.dumps({"sources": sources}))
    meta_path = next(run.glob("checkpoints/step_*/meta.json"))
    (run / "budget").mkdir()
    (run / "budget" / "ledger.json").write_text(json.dumps({"spent_usd": 12.5, "cap_usd": 35}))
    (run / "eval").mkdir()
    results = {"greedy_mc": {"alias": "greedy_mc", "acc,none": 0.75, "acc_stderr,none": 0.1}}
    ours = {
        "step": 5,
        "tasks": ["greedy_mc", "core"],
        "core": {"core": 0.4, "tasks": {"lm": {"accuracy": 0.5}}},
    }
    (run / "eval" / "step_000005-greedy_mc+core.json").write_text(
        json.dumps({"pretrain": ours, "results": results, "n-shot": {"greedy_mc": 0}})
    )
    (run / "eval" / "step_000004-old.json").write_text(
        json.dumps({"pretrain": {"step": 4}, "results": {"x": {"acc,none": 1}}})
    )
    meta = json.loads(meta_path.read_text())
    meta["config"]["data"]["dataset"] = str(data_dir)
    meta["data"] = {"dir": str(data_dir)}
    meta_path.write_text(json.dumps(meta))  # (hashes cover the files meta.json lists, not meta.json)

    export(run, tmp_path / "plain")
    data, text = read_card(tmp_path / "plain" / "README.md")
    assert "license" not in data and "No license was chosen at export" in text  # never guessed
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"pretrain", "custom_code", "looped"} <= set(data["tags"]) and data["datasets"] == ["acme/prose"]
    (index,) = data["model-index"]
    got = {(r["dataset"]["name"], m["type"]): m["value"] for r in index["results"] for m in r["metrics"]}
    assert got == {("greedy_mc", "acc"): 0.75, ("CORE", "core"): 0.4, ("CORE lm", "accuracy"): 0.5}
    assert "trust_remote_code=True" in text and "vLLM cannot serve it" in text
    assert "3.5000, 1.2500 bits per byte (step 5)" in text and "5,120" in text and "$12.50" in text

    export(run, tmp_path / "mit", "--license", "mit")
    data, text = read_card(tmp_path / "mit" / "README.md")
    assert data["license"] == "mit" and "No license" not in text


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    run = write_run(tmp_path / "run", bpe_2048())
    empty_run = tmp_path / "nothing"
    empty_run.mkdir()
    (empty_run / "metrics.jsonl").write_text("")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")

    def fails(*args: str) -> str:
        assert cli_main(["export", *args]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        return err

    out = str(tmp_path / "out")
    assert "invalid choice: 'onnx'" in fails(str(run), "--output", out, "--format", "onnx")
    assert "invalid choice: 'float16'" in fails(
        str(run), "--output", out, "--format", "hf", "--dtype", "float16"
    )
    assert "--dtype apply to --format hf only" in fails(str(run), "--output", out, "--dtype", "bfloat16")
    assert "not a Hub license identifier" in fails(
        str(run), "--output", out, "--format", "hf", "--license", "My License"
    )
    assert "no usable checkpoint" in fails(str(empty_run), "--output", out, "--format", "hf")
    assert "is not empty" in fails(str(run), "--output", str(full), "--format", "hf")
    assert not Path(out).exists() and [p.name for p in full.iterdir()] == ["keep.txt"]
    newer = write_run(tmp_path / "newer", bpe_2048(), newer=True)  # never exported without a weight
    assert "tensor later_gate that the Hugging Face export does not know" in fails(
        str(newer), "--output", out, "--format", "hf"
    )
    assert not any(Path(out).iterdir())  # nothing half-written is left


# ---------------------------------------------------------------- lm-eval's own hf model


LL_TASK = """task: continuation_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
"""
ROLLING_TASK = """task: rolling_bpb
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
PAIRS = [  # contexts that end at a word: the continuation's tokens are its own
    ("ROMEO:\nBut soft, what light through yonder", " window breaks?"),
    ("JULIET:\nO Romeo, Romeo! wherefore art", " thou Romeo?"),
    ("HAMLET:\nTo be, or not to be, that is the", " question:"),
    ("", "First Citizen:\nBefore we proceed any further"),
    ("KING RICHARD III:\nNow is the winter of our ", "discontent"),
]
DOCS = ["MACBETH:\nIs this a dagger which I see before me?", "PORTIA:\nThe quality of mercy is not strained."]


@pytest.mark.slow  # lm-eval's CLI in a subprocess loads transformers, datasets and the harness (~1 min)
def test_lm_eval_hf_model_scores_like_pretrain_eval(trained, tmp_path):
    """`lm_eval --model hf --model_args pretrained=DIR` on the Llama export and `pretrain eval` on its
    checkpoint score the same local tasks: log-likelihoods (each request's, and the rolling ones behind
    bits per byte) within 1e-4."""
    from app.tools.scoring import Scorer

    run, out, _ = trained
    model, tok, _ = load_for_inference(str(run), which="latest")
    context = "ROMEO:\nBut soft, what light through"  # and the model's own greedy continuation: acc 1 on it
    ids = tok.encode(context)
    greedy = generate(model, torch.tensor([ids]), 3, temperature=0)[0, len(ids) :].tolist()
    assert tok.encode(context + tok.decode(greedy)) == ids + greedy  # its tokens are its own
    pairs = [*PAIRS, (context, tok.decode(greedy))]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    ll = tmp_path / "ll.jsonl"
    ll.write_text("".join(json.dumps({"context": c, "continuation": x}) + "\n" for c, x in pairs))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    (tasks / "continuation_ll.yaml").write_text(LL_TASK.format(data=ll))
    (tasks / "rolling_bpb.yaml").write_text(ROLLING_TASK.format(data=docs))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    names = "continuation_ll,rolling_bpb"

    ours_file = tmp_path / "ours.json"
    assert (
        cli_main(
            ["eval", "--checkpoint", str(run), "--which", "latest", "--tasks", names]
            + ["--include-path", str(tasks), "--output", str(ours_file), "--device", "cpu"]
        )
        == 0
    )
    lm_eval = Path(sys.executable).with_name("lm_eval")
    cmd = [str(lm_eval), "--model", "hf", "--model_args", f"pretrained={out}", "--tasks", names]
    cmd += [
        "--include_path",
        str(tasks),
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path / "lm"),
        "--log_samples",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    theirs = json.loads(next((tmp_path / "lm").rglob("results_*.json")).read_text())["results"]
    ours = json.loads(ours_file.read_text())["results"]
    mean_ll = {
        name: -math.log(r["continuation_ll"]["perplexity,none"])
        for name, r in (("ours", ours), ("hf", theirs))
    }
    assert mean_ll["hf"] == pytest.approx(mean_ll["ours"], abs=1e-4)
    nbytes = sum(len(d.encode()) for d in DOCS)
    total = {
        k: -r["rolling_bpb"]["bits_per_byte,none"] * nbytes * math.log(2)
        for k, r in (("ours", ours), ("hf", theirs))
    }
    assert total["hf"] == pytest.approx(total["ours"], abs=1e-4) and total["ours"] < 0
    assert theirs["continuation_ll"]["acc,none"] == ours["continuation_ll"]["acc,none"] >= 1 / len(pairs)

    # each request: lm-eval's own log-likelihood of the export, and ours (what `pretrain eval` computes)
    want = Scorer(model, tok).loglikelihood(pairs)
    samples = next((tmp_path / "lm").rglob("samples_continuation_ll_*.jsonl")).read_text().splitlines()
    got = {json.loads(s)["doc_id"]: json.loads(s)["resps"][0][0] for s in samples}
    assert len(got) == len(pairs) and want[-1][1]
    for i, (loglik, greedy) in enumerate(want):
        assert float(got[i][0]) == pytest.approx(loglik, abs=1e-4) and got[i][1] == str(greedy)
