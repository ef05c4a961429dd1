"""`pretrain export RUN_DIR --output DIR --format hf`: the run's model as a Hugging Face folder.

Why: what a run buys is a model, and users keep models where their tools read them: transformers,
lm-eval's `hf` model, vLLM and the other serving engines, the Hub. This writes the folder they load:
config.json, generation_config.json, the weights (model.safetensors, or shards and their index above
--max-shard-size), tokenizer.json and tokenizer_config.json, and a model card (README.md, app/tools/hf_card.py).

The classic architecture (no model switch, not looped) is exactly transformers' LlamaForCausalLM: our RoPE
rotates the first half of each head against the second (transformers' rotate_half, so q and k need no
permutation), and GQA is its num_key_value_heads. Every other model ships its own modeling code beside the
weights (app/tools/hf/, `auto_map` in config.json), loaded with trust_remote_code=True. Either way the
embedding and head lose their padding rows (padded_vocab -> vocab_size: our logits never had them), and the
weights stream from the checkpoint's shards, of any world size, one tensor at a time.

Detail: docs/serving.md, "Outside the project: transformers, lm-eval, vLLM, llama.cpp".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from app.config import ModelConfig, config_from_dict
from app.data.tokenizer import EOT, CharTokenizer, Tokenizer, load_tokenizer
from app.errors import UserError
from app.trainer.checkpoint import store as ckpt

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CODE_DIR = Path(__file__).parent / "hf"  # shipped as package data (pyproject.toml)
CODE_FILES = ("configuration_pretrain_gpt.py", "modeling_pretrain_gpt.py")
LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")  # the Hub's license identifiers: apache-2.0, mit, cc-by-4.0
# `pretrain sample`'s defaults (its flags'; tests/test_export_hf.py keeps the two in step): generation_config.json
SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 1.0, "max_new_tokens": 200}
STAGING = ".pretrain-export"  # inside --output while writing; its files move into place at the end

# The model switches a Llama cannot express (their neutral values): any other value needs our own code.
SWITCHES = {
    "mlp": "swiglu",
    "qk_norm": False,
    "attn_scale": 0.0,
    "parameter_free_norms": False,
    "embed_norm": False,
    "logit_softcap": 0.0,
    "value_embeds": 0,
    "x0_skip": False,
    "unet_skips": False,
}
# The other fields of ModelConfig this exporter translates (zero_init and the loop's training weights only
# shape training). A field added to ModelConfig later is refused unless it is at its default.
TRANSLATED = {
    *("vocab_size", "vocab_multiple", "seq_len", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff"),
    *("rope_base", "tie_embeddings", "norm_eps", "init_std", "zero_init", "loop", *SWITCHES),
}

# our tensor names -> transformers' (Llama's names, and the custom code's for the switches)
TOP_NAMES = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
    "skip_weights": "model.skip_weights",
}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.value_mix": "self_attn.value_mix",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
    "resid_scale": "resid_scale",
    "x0_scale": "x0_scale",
}


@dataclass
class HFExport:
    """What an export wrote, for the command's summary."""

    out: Path
    step: int
    architecture: str  # LlamaForCausalLM | PretrainGPTForCausalLM
    custom_code: bool
    parameters: int
    dtype: str
    files: list[str]


# ---------------------------------------------------------------- config


def check_supported(model: ModelConfig) -> None:
    """UserError for a model this exporter cannot write faithfully (a newer switch, an unknown MLP)."""
    if model.mlp not in ("swiglu", "relu2"):
        raise UserError(f"model.mlp={model.mlp} has no Hugging Face export; swiglu and relu2 do")
    default = ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        value = getattr(model, f.name)
        if f.name not in TRANSLATED and value != getattr(default, f.name):
            raise UserError(
                f"model.{f.name}={value} has no Hugging Face export yet; `--format report` exports the run"
            )


def is_classic(model: ModelConfig) -> bool:
    """No switch on and not looped: exactly a LlamaForCausalLM."""
    return not model.looped and all(getattr(model, k) == v for k, v in SWITCHES.items())


def llama_config(model: ModelConfig, eot: int, tied: bool, dtype: str) -> dict:
    """config.json of a LlamaForCausalLM. Llama's defaults differ from ours (rms_norm_eps 1e-6, an untied
    head, bos/eos 1/2): every field is written. rope_theta beside rope_parameters for older readers."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.d_model // model.n_head,
        "hidden_act": "silu",
        "max_position_embeddings": model.seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_base},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "initializer_range": model.init_std,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "use_cache": True,
        "dtype": dtype,
    }


def custom_config(model: ModelConfig, eot: int, tied: bool, dtype: str) -> dict:
    """config.json of our own code (app/tools/hf/configuration_pretrain_gpt.py names every field)."""
    lp = model.loop
    if model.looped:  # each run of a recurrent block is a layer of its own (its own KV cache slot)
        recurrent = list(range(lp.prelude, lp.prelude + lp.recurrent))
        order = [
            *range(lp.prelude),
            *recurrent * lp.recurrence,
            *range(lp.prelude + lp.recurrent, model.n_blocks),
        ]
    else:
        order = list(range(model.n_layer))
    return {
        "architectures": ["PretrainGPTForCausalLM"],
        "model_type": "pretrain_gpt",
        "auto_map": {
            "AutoConfig": "configuration_pretrain_gpt.PretrainGPTConfig",
            "AutoModel": "modeling_pretrain_gpt.PretrainGPTModel",
            "AutoModelForCausalLM": "modeling_pretrain_gpt.PretrainGPTForCausalLM",
        },
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": len(order),
        "num_attention_heads": model.n_head,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.d_model // model.n_head,
        "max_position_embeddings": model.seq_len,
        "rope_theta": model.rope_base,
        "rms_norm_eps": model.norm_eps,
        "initializer_range": model.init_std,
        "mlp": model.mlp,
        "qk_norm": model.qk_norm,
        "attn_scale": model.attn_scale or None,
        "parameter_free_norms": model.parameter_free_norms,
        "embed_norm": model.embed_norm,
        "final_logit_softcapping": model.logit_softcap or None,  # the name vLLM and Gemma use
        "x0_skip": model.x0_skip,
        "num_value_embeds": model.value_embeds,
        "value_embed_tables": model.value_embed_tables,
        "unet_skip_pairs": [list(pair) for pair in model.skip_pairs],
        "block_order": order,
        "tie_word_embeddings": tied,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "use_cache": True,
        "dtype": dtype,
    }


def generation_config(eot: int) -> dict:
    """`pretrain sample`'s sampling defaults, ending at the document boundary."""
    return {"do_sample": True, **SAMPLING, "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}


# ---------------------------------------------------------------- tokenizer


def hf_tokenizer_json(tok: Tokenizer) -> tuple[str, str | None]:
    """(tokenizer.json, its unknown token). A BPE is a `tokenizers` file already. The char tokenizer
    becomes a WordLevel model over its alphabet with a per-character split and a fuse decoder: the same
    ids (the boundary 0, unknown characters 1, the alphabet from 2), decoded back to the same text."""
    if not isinstance(tok, CharTokenizer):
        return tok.to_json(), None
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    unk = "\ufffd" if "\ufffd" not in tok.stoi else "<|unk|>"  # what our decode shows for id 1
    hf = HFTokenizer(models.WordLevel({EOT: tok.eot_id, unk: 1, **tok.stoi}, unk_token=unk))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # (?m): "." takes "\n" too
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens([EOT])
    return hf.to_str(pretty=True), unk


def tokenizer_config(unk: str | None, seq_len: int) -> dict:
    """A PreTrainedTokenizerFast with the boundary token as bos, eos and pad (nothing is added to a text:
    our tokenizers add no special tokens either)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": unk,
        "model_max_length": seq_len,
        "clean_up_tokenization_spaces": False,
    }


# ---------------------------------------------------------------- weights


def hf_name(name: str) -> str:
    """Our tensor name as transformers names it; UserError for one this exporter does not know."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    if m := re.fullmatch(r"value_embeds\.(\d+)\.weight", name):
        return f"model.value_embeds.{m.group(1)}.weight"
    if (m := re.fullmatch(r"blocks\.(\d+)\.(.+)", name)) and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}"
    raise UserError(f"the checkpoint holds a tensor {name} that the Hugging Face export does not know")


class Weights:
    """The checkpoint's tensors under transformers' names (`source`: ours by theirs), in the export's
    dtype, embedding and head cut to the true vocabulary (`rows`): the reader interface that
    `write_consolidated` streams a file from, one tensor at a time (only the rows kept are read)."""

    def __init__(
        self, reader, source: dict[str, str], rows: dict[str, int], dtype: torch.dtype, progress
    ) -> None:
        self.reader = reader  # a checkpoint's ShardReader
        self.source = source
        self.rows = rows
        self.out_dtype = dtype
        self.progress = progress  # a tqdm bar, advanced by the bytes of each tensor read

    @classmethod
    def of(cls, reader, vocab: int, dtype: torch.dtype, progress) -> Weights:
        source = {hf_name(n): n for n in reader.names()}
        rows = {h: vocab for h, n in source.items() if n in ("tok_emb.weight", "head.weight")}
        return cls(reader, source, rows, dtype, progress)

    def subset(self, names: list[str]) -> Weights:
        return Weights(
            self.reader, {h: self.source[h] for h in names}, self.rows, self.out_dtype, self.progress
        )

    def names(self) -> list[str]:
        return list(self.source)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.reader.shape(self.source[name])
        return (self.rows.get(name, shape[0]), *shape[1:]) if shape else shape

    def dtype(self, name: str) -> torch.dtype:
        return self.out_dtype

    def full(self, name: str) -> torch.Tensor:
        out = torch.empty(self.shape(name), dtype=self.out_dtype)
        self.reader.read(self.source[name], out)  # the box from the origin: the rows kept, cast on the copy
        self.progress.update(out.nbytes)
        return out

    def nbytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * self.out_dtype.itemsize


def shard(weights: Weights, max_bytes: int) -> list[list[str]]:
    """Tensors in order, packed into files of at most max_bytes (a larger tensor gets a file of its own),
    as transformers' save_pretrained shards."""
    files: list[list[str]] = [[]]
    size = 0
    for name in weights.names():
        n = weights.nbytes(name)
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def write_weights(stage: Path, weights: Weights, max_bytes: int) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors and model.safetensors.index.json."""
    from app.trainer.checkpoint.format import write_consolidated

    groups = shard(weights, max_bytes)
    if len(groups) == 1:
        write_consolidated(stage / "model.safetensors", weights)
        return ["model.safetensors"]
    files, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        write_consolidated(stage / name, weights.subset(group))
        files.append(name)
        weight_map |= dict.fromkeys(group, name)
    total = sum(weights.nbytes(n) for n in weights.names())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_json(stage / "model.safetensors.index.json", index)
    return [*files, "model.safetensors.index.json"]


# ---------------------------------------------------------------- the export


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check_options(dtype: str, license: str | None, max_shard_size: int) -> None:
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if license is not None and not LICENSE_ID.fullmatch(license):
        raise UserError(
            f"--license {license!r} is not a Hub license identifier; use one such as apache-2.0 or mit"
        )
    if max_shard_size <= 0:
        raise UserError(f"--max-shard-size must be > 0, got {max_shard_size}")


def write_folder(
    run_dir: Path,
    info: ckpt.CheckpointInfo,
    out: Path,
    facts: dict,
    dtype: str = "float32",
    license: str | None = None,
    max_shard_size: int = 5 * 10**9,
) -> HFExport:
    """Write the Hugging Face folder of checkpoint `info` of `run_dir` into `out` (checked by the caller,
    app/tools/export.py, as are the options); `facts`: the run's val losses and spend for the model card.
    UserError (one line) for a model it cannot export. The files are written into a staging dir inside
    `out` and moved into place at the end, so a failed export leaves `out` as it was, and a --force export
    leaves no weight file of an older one."""
    from tqdm import tqdm

    from app.tools.hf_card import model_card

    cfg = config_from_dict(info.meta.get("config") or {})
    model = cfg.model
    check_supported(model)
    if not (info.path / "tokenizer.json").is_file():
        raise UserError(
            f"checkpoint {info.path} has no tokenizer.json; it cannot be exported for transformers"
        )
    tok = load_tokenizer(info.path)
    classic = is_classic(model)

    stage = out / STAGING
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        with ckpt.open_reader(info) as reader:
            tied = "head.weight" in reader.tied
            total = sum(math.prod(reader.shape(n)) for n in reader.names()) * DTYPES[dtype].itemsize
            bar = tqdm(
                total=total, unit="B", unit_scale=True, desc="weights", disable=not sys.stderr.isatty()
            )
            with bar:
                weights = Weights.of(reader, model.vocab_size, DTYPES[dtype], bar)
                files = write_weights(stage, weights, max_shard_size)
        config = (llama_config if classic else custom_config)(model, tok.eot_id, tied, dtype)
        write_json(stage / "config.json", config)
        write_json(stage / "generation_config.json", generation_config(tok.eot_id))
        tokenizer_json, unk = hf_tokenizer_json(tok)
        (stage / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        write_json(stage / "tokenizer_config.json", tokenizer_config(unk, model.seq_len))
        files = ["config.json", "generation_config.json", *files, "tokenizer.json", "tokenizer_config.json"]
        if not classic:
            for name in CODE_FILES:
                shutil.copyfile(CODE_DIR / name, stage / name)
            files += CODE_FILES
        parameters = sum(math.prod(weights.shape(n)) for n in weights.names())
        card = model_card(run_dir, info, cfg, not classic, parameters, dtype, license, facts)
        (stage / "README.md").write_text(card, encoding="utf-8")
        files = ["README.md", *files]
        install(stage, out, files)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return HFExport(out, info.step, config["architectures"][0], not classic, parameters, dtype, files)


def install(stage: Path, out: Path, files: list[str]) -> None:
    """Move the staged files into `out`, first removing the weight and code files of an earlier export
    there (a --force over an export sharded otherwise must not leave stale shards beside the new ones)."""
    stale = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|(configuration|modeling)_\w+\.py")
    for old in out.iterdir():
        if old.is_file() and stale.fullmatch(old.name) and old.name not in files:
            old.unlink()
    for name in files:
        os.replace(stage / name, out / name)
        os.chmod(out / name, 0o644)


def report(run_dir: Path, done: HFExport) -> str:
    """The command's summary: what was written, and how to load it."""
    remote = ", trust_remote_code=True" if done.custom_code else ""
    lines = [
        f"exported {run_dir} -> {done.out} (Hugging Face): checkpoint step {done.step}, {done.architecture}, "
        f"{done.parameters:,} parameters in {done.dtype}"
        + (" with its own modeling code (load with trust_remote_code=True)" if done.custom_code else ""),
        *(f"  {done.out / name}" for name in done.files),
        f'load: AutoModelForCausalLM.from_pretrained("{done.out}"{remote})',
    ]
    return "\n".join(lines)
