"""Typed run config: dataclasses, YAML presets, `--set a.b=c` overrides and validation.

Resolution order: dataclass defaults < preset YAML < --config FILE.yaml < --set overrides < flags.
Every error is a ConfigError with one line that names the key and how to fix it. Each field's comment is
its help wherever it is shown (app/config_docs.py: the flags, docs/config.md). Drills have a section of
their own (`drill:`); keys that moved are listed in MOVED.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.budget.config import BudgetConfig
from app.config_checks import validate
from app.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_PRESET = "tiny"


@dataclass
class LoopConfig:
    """Looped transformer: prelude blocks, recurrent blocks run `recurrence` times with shared weights,
    coda."""

    prelude: int = 0  # blocks run once before the recurrent ones
    recurrent: int = 0  # blocks run `recurrence` times with shared weights; 0 = plain GPT (n_layer blocks)
    coda: int = 0  # blocks run once after the recurrent ones
    recurrence: int = 1  # how many times the recurrent blocks run per forward pass
    deep_supervision: bool = False  # a loss at the output of every recurrence
    # the weight of each recurrence's loss under deep supervision; given, supervision_weight_base is unused
    loss_weights: list[float] = field(default_factory=list)
    supervision_weight_base: float = 1.0  # loop i weighs base^i (normalised); 1 = equal (docs/recipes.md)
    improvement_reward_scale: float = 0.0  # reward each read-out's relative gain over the previous one


@dataclass
class ModelConfig:
    """The GPT: sizes, attention and initialisation (app/trainer/model.py)."""

    vocab_size: int = 0  # tokens in the vocabulary; 0 = take it from the tokenizer of the data
    vocab_multiple: int = 128  # embedding/head rows padded to a multiple of this (fast head matmul); 1 = off
    seq_len: int = 256  # tokens per training sequence (the context length)
    n_layer: int = 4  # transformer blocks (plain GPT)
    d_model: int = 256  # width of the residual stream
    n_head: int = 4  # attention heads; must divide d_model
    n_kv_head: int = 0  # key/value heads (grouped-query attention); 0 = n_head (plain multi-head attention)
    # MLP hidden width; 0 = 8/3 * d_model rounded up to a multiple of 64 (SwiGLU), 4 * d_model (relu2)
    d_ff: int = 0
    rope_base: float = 10000.0  # RoPE base frequency; above 1 (its frequencies fall with the dimension)
    tie_embeddings: bool = True  # the output head shares the token embedding's weights
    norm_eps: float = 1e-5  # RMSNorm epsilon, in (0, 1): it guards a division by zero
    init_std: float = 0.02  # standard deviation of the normal initialisation of the weights; > 0
    # Switches from the open record (modded-nanogpt) and nanochat, all off by default: docs/recipes.md

    mlp: str = "swiglu"  # the MLP: swiglu | relu2 (ReLU squared, two matrices; d_ff 0 = 4 * d_model)
    qk_norm: bool = False  # RMS-normalize each head's queries and keys (no gain) before RoPE
    attn_scale: float = 0.0  # attention logit scale; 0 = 1/sqrt(head dim)
    parameter_free_norms: bool = False  # RMSNorms without a learned gain
    embed_norm: bool = False  # RMS-normalize the token embedding (no gain) before the first block
    zero_init: bool = False  # start attn.wo, mlp.w_down and an untied head at zero
    # logits -> cap * tanh(logits / cap) (the record: 15); 0 = off; at least 1, under which the model cannot
    # learn (no token could be more than e^(2 cap) times likelier than another)
    logit_softcap: float = 0.0
    value_embeds: int = 0  # N token tables mixed into the attention values of the first and last N blocks
    x0_skip: bool = False  # each block mixes the (normalized) embedding into its input, learned weights
    unet_skips: bool = False  # late blocks add the output of their mirror early block, learned weights
    loop: LoopConfig = field(default_factory=LoopConfig)

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn_dim(self) -> int:
        if self.mlp == "relu2":
            return self.d_ff or 4 * self.d_model
        return self.d_ff or 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def mlp_matrices(self) -> int:
        """d_model x ffn_dim matrices in one MLP: SwiGLU's gate, up and down; ReLU squared's up and down."""
        return 2 if self.mlp == "relu2" else 3

    @property
    def value_embed_tables(self) -> list[int | None]:
        """Per distinct block, the value-embedding table it reads (None: none). N tables serve the first N
        blocks and, in the same order, the last N (the record's 012...012 pattern)."""
        n, k = self.n_blocks, self.value_embeds
        return [i if i < k else i - (n - k) if i >= n - k else None for i in range(n)]

    @property
    def skip_pairs(self) -> list[tuple[int, int]]:
        """U-net skips as (early block, late block): mirrored around the middle of a plain model, around the
        recurrent core of a looped one (prelude outputs into the coda); the late block adds the early one's
        output to its input."""
        if not self.unet_skips:
            return []
        if self.looped:
            first_late, pairs = (
                self.loop.prelude + self.loop.recurrent,
                min(self.loop.prelude, self.loop.coda),
            )
            return [(self.loop.prelude - 1 - i, first_late + i) for i in range(pairs)]
        pairs = self.n_layer // 2
        return [(pairs - 1 - i, self.n_layer - pairs + i) for i in range(pairs)]

    @property
    def looped(self) -> bool:
        return self.loop.recurrent > 0

    @property
    def n_blocks(self) -> int:
        """Distinct blocks with their own weights."""
        lp = self.loop
        return lp.prelude + lp.recurrent + lp.coda if self.looped else self.n_layer

    @property
    def effective_depth(self) -> int:
        """Blocks run per forward pass (recurrent ones count once per recurrence)."""
        lp = self.loop
        return lp.prelude + lp.recurrent * lp.recurrence + lp.coda if self.looped else self.n_layer


@dataclass
class DataConfig:
    """What the run trains on: the embedded corpus, or a data dir written by `pretrain prepare`."""

    # "embedded" (Shakespeare, built on first use) or a `pretrain prepare` output dir
    dataset: str = "embedded"
    tokenizer: str = "bpe"  # embedded only: the tokenizer, bpe | char
    vocab_size: int = 2048  # embedded BPE vocabulary size
    cache_dir: str = ""  # embedded data cache; "" = $PRETRAIN_CACHE or ~/.cache/pretrain
    val_fraction: float = 0.02  # embedded only: share of documents held out for validation
    # training windows start at a document boundary (its <|endoftext|>, as the record's BOS); docs/recipes.md
    align_to_documents: bool = False


@dataclass
class TrainConfig:
    """The loop: batch, length of the run, evaluation, precision, parallelism and the guards."""

    seed: int = 1337  # seeds the weights' initialisation and the data order
    # sequences per rank per forward pass; auto = the most that fits (keeps batch_tokens)
    micro_batch_size: int | str = 16
    batch_tokens: int = 0  # tokens per optimizer step over all ranks; 0 = one micro-batch per rank
    max_steps: int = 1000  # planned end after this many optimizer steps
    max_tokens: int = 0  # planned end by tokens; 0 = off
    max_hours: float = 0.0  # planned end by wall-clock hours of this run (all restarts); 0 = off
    eval_every: int = 100  # validation loss every N steps, at step 0 and at the planned end; 0 = off
    eval_batches: int = 20  # micro-batches of the validation split per evaluation, per rank
    sample_every: int = 0  # print a sample every N steps; 0 = off
    log_every: int = 10  # read the step log (loss, throughput, guards) back from the device every N steps
    early_stop_patience: int = 0  # evals without val-loss improvement before stopping; 0 = off
    early_stop_min_delta: float = 0.0  # an eval must lower the best val loss by more than this to count
    device: str = "auto"  # where to train: auto (CUDA when there is one) | cpu | cuda
    dtype: str = "auto"  # compute dtype: auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    compile: str = "auto"  # auto (on for CUDA, off for CPU) | true | false: torch.compile each block
    compile_mode: str = "default"  # torch.compile mode: default | max-autotune | max-autotune-no-cudagraphs
    # residual stream and its elementwise work under autocast: auto (bf16 where compute is bf16) | fp32 | bf16
    activation_dtype: str = "auto"
    # q/k/v and SwiGLU's gate/up as one matmul each: auto (on when train.compile is) | true | false
    fused_projections: str = "auto"
    prefetch: int = 2  # micro-batches read ahead on a side thread (pinned on CUDA); 0 = read in the loop
    collective_timeout_minutes: float = 30.0  # NCCL/gloo timeout; must exceed the longest save
    parallel: str = "ddp"  # ddp (replicas) | fsdp (sharded) | auto (FSDP when the DDP estimate does not fit)
    activation_checkpointing: bool = False  # recompute each block's activations in backward (less memory)
    fp8: str = "false"  # false | true (H100-class GPUs) | emulate (float8 math in software, any device)
    device_memory_gb: float = 0.0  # per-GPU memory for parallel=auto; 0 = detect (CUDA) / assume DDP fits
    spike_factor: float = 3.0  # a loss above this multiple of its moving average is a spike
    skip_spike_updates: bool = False  # drop the optimizer update of a step that spiked
    max_bad_steps: int = 5  # a non-finite loss or gradient skips the update; this many in a row stop the run
    stop_check_every: int = 0  # ranks agree on stops every k steps; 0 = auto (docs/performance.md)
    mfu_floor: float = 0.0  # after warm-up, MFU under this for mfu_floor_minutes: checkpoint, exit 7; 0 = off
    mfu_floor_minutes: float = 10.0  # how long MFU may stay under train.mfu_floor before the stop


@dataclass
class OptimConfig:
    """The optimizer and its parameter groups' learning rates (app/trainer/optim.py, docs/recipes.md)."""

    # optimizer: adamw | muon (Muon for the hidden matrices, AdamW for the rest; docs/recipes.md)
    name: str = "adamw"
    lr: float = 1e-3  # peak LR of norms/biases, and of every group whose own LR below is 0
    min_lr: float = 1e-4  # the LR the schedule decays to
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon, in (0, 1)
    # decoupled weight decay, not applied to norms and embeddings; times the peak LR under 1 (each step
    # multiplies the decayed weights by 1 - lr x weight_decay)
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = off, else above optim.eps
    fused: str = "auto"  # fused AdamW kernels: auto (on CUDA) | true | false
    matrix_lr: float = 0.0  # peak LR of the 2-D weights inside the blocks (Muon or AdamW); 0 = lr
    embedding_lr: float = 0.0  # peak LR of the token embedding (and a tied head); 0 = lr
    head_lr: float = 0.0  # peak LR of an untied output head; 0 = lr
    # peak LR of the `other` group (norm gains, the model switches' mixing weights); 0 = lr
    scalar_lr: float = 0.0
    muon_momentum: float = 0.95  # Muon's momentum (at the peak LR)
    # Muon's momentum rises linearly from muon_momentum_start over this many steps; 0 = off
    muon_momentum_warmup_steps: int = 0
    # Muon's momentum at the start of its warm-up (the record: 0.85 -> 0.95 over the first 300 steps)
    muon_momentum_start: float = 0.85
    # Muon's momentum when the LR has decayed to min_lr, following the LR's decay; 0 = off
    muon_momentum_end: float = 0.0
    muon_lr_adjust: str = "match_rms_adamw"  # match_rms_adamw | original (torch.optim.Muon adjust_lr_fn)


@dataclass
class ScheduleConfig:
    """The learning-rate schedule (app/trainer/schedule.py)."""

    name: str = "cosine"  # LR schedule: cosine | wsd (warmup, stable, decay) | constant
    warmup_steps: int = 100  # linear warm-up from 0 to the peak LR over this many steps
    decay_fraction: float = 0.2  # wsd: last fraction of max_steps spent decaying to min_lr


@dataclass
class CheckpointConfig:
    """When checkpoints are written, how many are kept, how they are checked (app/trainer/checkpoint/)."""

    # run-dir lease (app/trainer/lease.py): a second trainer on the run dir waits this long, then exits 142
    lease_wait_seconds: float = 600.0
    lease_stale_seconds: float = 60.0  # a lease whose heartbeat stopped this long ago is taken over
    every_steps: int = 0  # save every N steps; 0 = off
    every_minutes: float = 60.0  # save every M minutes of training (agreed by the ranks); 0 = off
    keep_last: int = 3  # keep the newest N checkpoints (and the best)
    keep_best: bool = True  # keep the checkpoint with the lowest val loss too
    drop_optimizer_older: bool = False  # strip optimizer state from kept checkpoints but the latest
    verify: str = "sha256"  # how latest/best are verified at resume: sha256 | size
    async_save: bool = True  # stage to host memory, write in the background; stops still wait for it


@dataclass
class MetricsConfig:
    """Where the run's numbers go besides the console: Prometheus, MFU's peak, experiment trackers."""

    port: int = 0  # Prometheus /metrics on this port (global rank 0 and each node's local rank 0); 0 = off
    addr: str = ""  # /metrics bind address; "" = 0.0.0.0 in a pod (KUBERNETES_SERVICE_HOST), else 127.0.0.1
    gpu_type: str = ""  # key of the peak-FLOPs table; "" = detect from the CUDA device name
    peak_tflops: float = 0.0  # override peak dense bf16 TFLOP/s per device (also enables MFU on CPU)
    progress: bool = True  # a progress bar on a terminal console (else log lines)
    # Experiment trackers fed the same records as metrics.jsonl (rank 0): any of tensorboard, mlflow, wandb
    trackers: list[str] = field(default_factory=list)
    tensorboard_dir: str = ""  # TensorBoard log dir; "" = RUN_DIR/tensorboard
    # MLflow tracking URI; "" = $MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns
    mlflow_uri: str = ""
    mlflow_experiment: str = "pretrain"  # the MLflow experiment the run is logged under
    wandb_project: str = "pretrain"  # the W&B project the run is logged under
    wandb_entity: str = ""  # W&B entity (team or user); "" = your W&B default entity
    wandb_mode: str = ""  # W&B mode: online | offline | disabled; "" = $WANDB_MODE, else online
    tracker_run_name: str = ""  # the run's name in the trackers; "" = the run dir's name
    tracker_checkpoint: bool = True  # log the final checkpoint as an artifact (MLflow, W&B) on exit 0


@dataclass
class DrillConfig:
    """Faults a run injects on purpose, to rehearse what it does about them; all off (0) in real runs."""

    # micro-batches above this many sequences fail as out of memory (a CPU rehearses
    # train.micro_batch_size=auto's halving); 0 = off
    oom_above: int = 0
    # with drill.oom_above, fail on this one rank (its RANK), as a real GPU does, leaving the others waiting
    # in a collective; "" = every rank
    oom_rank: str = ""
    # feed high-loss batches from this optimizer step on (rehearses the loss-spike alert); 0 = off
    spike_at_step: int = 0
    spike_batches: int = 3  # how many steps drill.spike_at_step feeds
    # saves of later steps fail as on a full checkpoint volume (rehearses exit 6 and its resume); 0 = off
    volume_full_after_step: int = 0


@dataclass
class Config:
    """A run's whole config: the preset it started from and one section per concern."""

    # the preset the config started from (app/presets/): chosen with --preset or a config file's `preset:`,
    # not --set (its values are applied before --set)
    preset: str = DEFAULT_PRESET
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    drill: DrillConfig = field(default_factory=DrillConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- merging


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key a user may set."""
    keys = []
    hints = typing.get_type_hints(cls)
    for field_ in dataclasses.fields(cls):
        kind = hints[field_.name]
        if dataclasses.is_dataclass(kind):
            keys += all_keys(kind, f"{prefix}{field_.name}.")
        else:
            keys.append(f"{prefix}{field_.name}")
    return keys


def suggest_key(key: str) -> str | None:
    """The valid key a user most likely meant: `train.lr` -> `optim.lr`, `model.n_layers` ->
    `model.n_layer`."""
    keys = all_keys()
    section, _, last = key.rpartition(".")
    same_last = [k for k in keys if k.rsplit(".", 1)[-1] == last]
    if same_last:
        return same_last[0]
    in_section = [k for k in keys if k.rpartition(".")[0] == section]
    for pool in (in_section, keys):
        by_last = {k.rsplit(".", 1)[-1]: k for k in pool}
        match = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.75)
        if match:
            return by_last[match[0]]
    return None


def _coerce(value: Any, typ: Any, key: str, where: str) -> Any:
    bad = ConfigError(f"{key} in {where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise bad
    if typ in (int, float) and isinstance(value, bool):
        raise bad
    if typ is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                raise bad from None
        raise bad
    if typ is float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad from None
        if not math.isfinite(number):
            raise ConfigError(f"{key} in {where}: must be a finite number, got {value!r}")
        return number
    if typ is str:
        if isinstance(value, dict | list):  # `--set key.sub=x` under a string key, or a YAML list
            raise bad
        return "" if value is None else str(value)
    if typing.get_args(typ) == (int, str):  # a number or "auto"
        if str(value).lower() == "auto":
            return "auto"
        try:
            return _coerce(value, int, key, where)
        except ConfigError:
            raise ConfigError(f"{key} in {where}: expected a whole number or auto, got {value!r}") from None
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return [_coerce(v, item, key, where) for v in value]
    raise bad


# Keys that moved: a checkpoint's meta.json still has the old names (read as the new ones); a user's
# config, --set or preset is refused in one line that names the new key.
MOVED = {
    "train.inject_oom_above": "drill.oom_above",
    "train.inject_spike_at_step": "drill.spike_at_step",
    "train.spike_batches": "drill.spike_batches",
}
FROM_CHECKPOINT = "checkpoint meta.json"


def _move_keys(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with every moved key under its new name (a copy), or ConfigError outside a checkpoint."""
    data = {section: dict(keys) if isinstance(keys, dict) else keys for section, keys in data.items()}
    for old, new in MOVED.items():
        old_section, old_key = old.split(".")
        keys = data.get(old_section)
        if not isinstance(keys, dict) or old_key not in keys:
            continue
        if where != FROM_CHECKPOINT:
            raise ConfigError(f"{old} in {where} is now {new}; set {new} instead")
        new_section, new_key = new.split(".")
        data.setdefault(new_section, {})[new_key] = keys.pop(old_key)
    return data


def merge_into(obj: Any, data: dict[str, Any], where: str, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at '{prefix.rstrip('.') or 'top level'}'")
    if not prefix and isinstance(obj, Config):
        data = _move_keys(data, where)
    hints = typing.get_type_hints(type(obj))
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            close = suggest_key(dotted)
            hint = (
                f"; did you mean '{close}'?"
                if close
                else "; see `pretrain train --print-config` for valid keys"
            )
            raise ConfigError(f"unknown config key '{dotted}' in {where}{hint}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            merge_into(getattr(obj, key), value, where, f"{dotted}.")
        else:
            setattr(obj, key, _coerce(value, typ, dotted, where))


def _dotted_to_nested(key: str, value: Any) -> dict[str, Any]:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text; pass a YAML file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{what} {path} is not valid YAML{at}; fix the syntax") from None
    if data is None:  # an empty file is almost always a mistake (wrong path, unsaved editor buffer)
        raise ConfigError(f"{what} {path} is empty; give it config keys or leave out --config")
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of config keys")
    return data


def load_config(
    preset: str | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Config:
    """Resolve and validate a config. `extra` holds dotted keys from dedicated CLI flags."""
    cfg = Config()
    file_data: dict[str, Any] = {}
    if config_file:
        file_data = load_yaml(Path(config_file), "config file")
    # a checkpoint's meta.json: the whole config its run trained with, not today's preset of that name
    if isinstance(file_data.get("config"), dict) and "step" in file_data:
        if preset:
            raise ConfigError(f"--config {config_file} is a checkpoint's whole config: leave out --preset")
        return apply_overrides(config_from_dict(file_data["config"]), overrides, extra)
    file_preset = file_data.pop("preset", None)
    name = preset or file_preset or DEFAULT_PRESET
    path = PRESET_DIR / f"{name}.yaml"
    if not path.exists():
        close = [n for n in preset_names() if n.startswith(name)][:1] or difflib.get_close_matches(
            name, preset_names(), n=1, cutoff=0.5
        )
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown preset '{name}'; {hint}choose one of: {', '.join(preset_names())}")
    cfg.preset = name
    merge_into(cfg, load_yaml(path, "preset"), f"preset {name}")
    if file_data:
        merge_into(cfg, file_data, f"config file {config_file}")
    return apply_overrides(cfg, overrides, extra)


def apply_overrides(cfg: Config, overrides: list[str] | None, extra: dict[str, Any] | None) -> Config:
    """--set items, then the dedicated flags' keys; then validate."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value (e.g. --set model.n_layer=8), got '{item}'")
        key, raw = item.split("=", 1)
        # a preset's values are applied before --set, so here its name would only relabel the run
        if key.strip().split(".")[0] == "preset":
            raise ConfigError(
                f"--set {item.strip()} would only relabel the run, not apply the preset's values: "
                f"choose the preset with --preset {raw.strip() or 'NAME'}"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        merge_into(cfg, _dotted_to_nested(key.strip(), value), "--set")
    for key, value in (extra or {}).items():
        if value is not None:
            merge_into(cfg, _dotted_to_nested(key, value), "command line")
    validate(cfg)
    return cfg


def vocab_for_estimates(cfg: Config) -> int:
    """model.vocab_size, or while the data is not known yet (--print-config, plans, `pretrain bench`):
    the embedded BPE's data.vocab_size, 128 for a char tokenizer."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    return cfg.data.vocab_size if cfg.data.tokenizer == "bpe" else 128


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a config saved in a checkpoint's meta.json."""
    cfg = Config()
    data = dict(data)
    cfg.preset = data.pop("preset", DEFAULT_PRESET)
    merge_into(cfg, data, FROM_CHECKPOINT)
    if "vocab_multiple" not in data.get("model", {}):
        cfg.model.vocab_multiple = 1  # written before vocabulary padding: its rows are the true vocab
    return cfg
