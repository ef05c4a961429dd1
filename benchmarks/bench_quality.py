"""What the recipe buys: held-out loss of training recipes on the embedded Shakespeare, on CPU.

Every recipe x seed is one run of the real training step (app/train.py `train_step`, the model, optimizer,
schedule and loader that `pretrain train` builds from the recipe's config). All runs live in this one
process and take turns: the next step always goes to the run that has done the smallest share of its
planned steps, so the runs advance together and whatever else loads the machine slows them alike. Each
run's time is the sum of its own steps (data, forward, backward, update; evaluations excluded), on the
same threads. Every run is scored on the same held-out text, the whole validation split, cut into
windows of the run's sequence length: nats per token, and bits per UTF-8 byte (comparable across
tokenizers).

Printed per recipe (median over seeds): steps, tokens, training seconds and their ratio to the baseline's,
final held-out loss and its ratio to the baseline's, and tokens-to-target and time-to-target: the tokens
(seconds) after which the run's held-out loss first reaches the baseline's final loss (linear between
evaluations; "-" if never). The baseline is `tiny` on the AdamW recipe (AdamW, cosine, 400 steps: the
preset before the speedrun recipe), kept here verbatim so that later changes to the preset do not move it.

    python -m benchmarks quality                       # the recipes, 3 seeds (about 40 min on 2 busy cores)
    python -m benchmarks.bench_quality --ablation      # each switch alone on and off (docs/recipes.md)
    python -m benchmarks.bench_quality --seeds 1 --scale 0.25   # a quick look: 1 seed, quarter-length runs
    python -m benchmarks.bench_quality --fit           # the constants of `pretrain plan`'s loss prediction
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from app.config import Config, apply_overrides, config_from_dict, load_config
from app.data.loader import Prefetcher, TokenWindows, TrainLoader, fit_vocab, resolve_data_dir
from app.data.manifest import Manifest
from app.train import train_step
from app.trainer.model.gpt import build_model
from app.trainer.optimization.optimizer import build_optimizer, set_muon_momentum
from app.trainer.optimization.schedule import annealed_at, lr_at, muon_momentum_at
from app.trainer.parallel.distributed import DistEnv
from app.trainer.parallel.runtime import autocast_for, grad_accum_steps
from app.trainer.reporting.steplog import StepLog

SEEDS = (1337, 1338, 1339)
EVALS = 8  # held-out evaluations per run, at equal shares of its steps (and one before the first step)
EVAL_BATCH = 32

# The tiny preset on the AdamW recipe (before the speedrun recipe), every key it set (the rest are the
# config defaults, which keep every later switch off): the baseline every recipe is measured against.
TINY_BEFORE_33 = {
    "preset": "tiny",
    "model": {
        "seq_len": 128,
        "n_layer": 4,
        "d_model": 192,
        "n_head": 6,
        "n_kv_head": 2,
        "tie_embeddings": True,
    },
    "data": {"dataset": "embedded", "tokenizer": "bpe", "vocab_size": 2048},
    "train": {"seed": 1337, "micro_batch_size": 32, "max_steps": 400, "eval_every": 100, "eval_batches": 8},
    "optim": {"lr": 0.002, "min_lr": 0.0002},
    "schedule": {"name": "cosine", "warmup_steps": 30},
}
BASELINE = "tiny-adamw"  # tiny on the AdamW recipe
SPEEDRUN = "tiny-speedrun"


def tiny_before_33(overrides: list[str]) -> Config:
    """The baseline's config with `key=value` overrides (values as strings, as --set takes them)."""
    return apply_overrides(config_from_dict(TINY_BEFORE_33), overrides, None)


@dataclass
class Recipe:
    name: str
    preset: str | None  # None: TINY_BEFORE_33
    overrides: list[str] = field(default_factory=list)

    def config(self, seed: int, scale: float) -> Config:
        if self.preset is None:
            cfg = tiny_before_33(self.overrides)
        else:
            cfg = load_config(self.preset, overrides=self.overrides)
        cfg.train.seed = seed
        cfg.train.prefetch = 0  # the batch is read inside the timed step, on the same thread
        cfg.train.max_steps = max(1, round(cfg.train.max_steps * scale))
        return cfg


RECIPES = [
    Recipe(BASELINE, None),
    Recipe("tiny", "tiny"),
    Recipe(SPEEDRUN, SPEEDRUN),
]

# The speedrun recipe's choices, each as the config keys it sets. The ablation takes each choice whose
# keys differ between the baseline and tiny-speedrun: alone on the baseline (its keys at tiny-speedrun's
# values) and alone off tiny-speedrun (its keys at the baseline's values).
SWITCHES: dict[str, list[str]] = {
    "Muon": ["optim.name", "optim.matrix_lr", "optim.muon_lr_adjust"],
    "Muon momentum warm-up": ["optim.muon_momentum_warmup_steps", "optim.muon_momentum_start"],
    "learning rates": ["optim.lr", "optim.min_lr", "optim.embedding_lr", "optim.head_lr", "optim.scalar_lr"],
    "WSD schedule": ["schedule.name", "schedule.decay_fraction"],
    "document-aligned windows": ["data.align_to_documents"],
    "ReLU²": ["model.mlp", "model.d_ff"],
    "QK-norm": ["model.qk_norm", "model.attn_scale"],
    "zero-init projections": ["model.zero_init"],
    "logit soft-cap": ["model.logit_softcap"],
    "value embeddings": ["model.value_embeds"],
    "x0 skip": ["model.x0_skip"],
    "U-net skips": ["model.unet_skips"],
    "embedding norm": ["model.embed_norm"],
    "parameter-free norms": ["model.parameter_free_norms"],
    "untied head": ["model.tie_embeddings"],
    "16 sequences per step": ["train.micro_batch_size"],  # steps and warm-ups rescaled: the same tokens
}


def _value(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _settings(cfg: Config, keys: list[str]) -> list[str]:
    """`key=value` items that set `keys` as `cfg` has them."""
    items = []
    for key in keys:
        value = _value(cfg, key)
        items.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return items


def _same_tokens(into: Config, batch_from: Config) -> list[str]:
    """`into`'s step counts rescaled to `batch_from`'s micro-batch: the same tokens and warm-up tokens."""
    ratio = into.train.micro_batch_size / batch_from.train.micro_batch_size
    steps = {
        "train.max_steps": into.train.max_steps,
        "schedule.warmup_steps": into.schedule.warmup_steps,
        "optim.muon_momentum_warmup_steps": into.optim.muon_momentum_warmup_steps,
    }
    return [f"{key}={round(value * ratio)}" for key, value in steps.items()]


def ablation_recipes(half: str = "both") -> list[Recipe]:
    """The two references and, per switch, the baseline with it (half "on"), tiny-speedrun without it
    ("off"), or both."""
    base = Recipe(BASELINE, None).config(SEEDS[0], 1.0)
    fast = load_config(SPEEDRUN)
    recipes = [Recipe(BASELINE, None)] if half != "off" else []
    recipes += [Recipe(SPEEDRUN, SPEEDRUN)] if half != "on" else []
    for name, keys in SWITCHES.items():
        if _settings(base, keys) == _settings(fast, keys):
            continue
        on, off = _settings(fast, keys), _settings(base, keys)
        if "train.micro_batch_size" in keys:
            on, off = on + _same_tokens(base, fast), off + _same_tokens(fast, base)
        if half in ("on", "both"):
            recipes.append(Recipe(f"{BASELINE} + {name}", None, on))
        if half in ("off", "both"):
            recipes.append(Recipe(f"{SPEEDRUN} - {name}", SPEEDRUN, off))
    return recipes


class HeldOut:
    """The whole validation split in windows of one sequence length: the same text for every run."""

    def __init__(self, data_dir: Path, seq_len: int, vocab_size: int) -> None:
        self.windows = TokenWindows(data_dir, "val", seq_len, vocab_size)
        self.bytes_per_token = Manifest.load(data_dir).bytes_per_token("val")

    @torch.no_grad()
    def loss(self, model: torch.nn.Module) -> float:
        """Mean nats per token over every window."""
        model.eval()
        total = 0.0
        for first in range(0, self.windows.count, EVAL_BATCH):
            index = torch.arange(first, min(first + EVAL_BATCH, self.windows.count)).numpy()
            x, y = self.windows.batch(index)
            total += float(model(x, y).loss) * len(index)
        model.train()
        return total / self.windows.count

    def bits_per_byte(self, nats: float) -> float:
        return nats / math.log(2) / self.bytes_per_token


@dataclass
class Point:
    step: int
    tokens: int
    seconds: float  # training time so far
    loss: float  # held-out nats/token


class Run:
    """One recipe x seed: the trainer's model, optimizer, loader and schedule, stepped from outside."""

    def __init__(self, recipe: Recipe, seed: int, scale: float, held_out: dict) -> None:
        cfg = self.cfg = recipe.config(seed, scale)
        self.recipe, self.seed = recipe, seed
        data_dir = resolve_data_dir(cfg.data, log=lambda line: print(f"   ({line})", file=sys.stderr))
        fit_vocab(cfg.model, Manifest.load(data_dir), data_dir)
        key = (str(data_dir), cfg.model.seq_len)
        if key not in held_out:
            held_out[key] = HeldOut(data_dir, cfg.model.seq_len, cfg.model.vocab_size)
        self.held_out = held_out[key]
        device = torch.device("cpu")
        torch.manual_seed(seed)
        self.model = build_model(cfg.model)
        self.optimizer = build_optimizer(self.model, cfg.optim, device)
        t, m = cfg.train, cfg.model
        loader = TrainLoader(
            data_dir, m.seq_len, t.micro_batch_size, 0, 1, seed, m.vocab_size, cfg.data.align_to_documents
        )
        self.batches = Prefetcher(loader, device, 0)
        self.accum = grad_accum_steps(cfg, 1)
        self.tokens_per_step = self.accum * t.micro_batch_size * m.seq_len
        self.autocast = autocast_for(cfg, device)
        self.steplog = StepLog(DistEnv())
        self.max_steps = t.max_steps
        self.eval_steps = {round(k * self.max_steps / EVALS) for k in range(EVALS + 1)}
        self.step, self.seconds = 0, 0.0
        self.curve: list[Point] = []

    @property
    def done(self) -> bool:
        return self.step >= self.max_steps and self.curve[-1].step == self.step

    def advance(self) -> None:
        """Evaluate if due, else one timed training step."""
        if self.step in self.eval_steps and (not self.curve or self.curve[-1].step != self.step):
            loss = self.held_out.loss(self.model)
            self.curve.append(Point(self.step, self.step * self.tokens_per_step, self.seconds, loss))
            self.steplog.read()  # the step log is only kept short here
            return
        cfg = self.cfg
        lr = lr_at(self.step, cfg.schedule, cfg.optim, self.max_steps)
        start = time.perf_counter()
        # as Trainer.step: the momentum follows the LR's decay
        annealed = annealed_at(self.step, cfg.schedule, cfg.optim, self.max_steps)
        set_muon_momentum(self.optimizer, muon_momentum_at(self.step, annealed, cfg.optim))
        train_step(
            model=self.model,
            optimizer=self.optimizer,
            batches=self.batches,
            accum=self.accum,
            autocast=self.autocast,
            grad_clip=cfg.optim.grad_clip,
            step=self.step + 1,
            lr=lr,
            log=self.steplog,
        )
        self.seconds += time.perf_counter() - start
        self.step += 1

    def reach(self, target: float, axis: str) -> float:
        """Tokens or seconds (`axis`) at which the held-out loss first reaches `target`; inf if never."""
        for a, b in zip(self.curve, self.curve[1:], strict=False):
            if b.loss <= target:
                x0, x1 = getattr(a, axis), getattr(b, axis)
                return x0 + (x1 - x0) * (a.loss - target) / (a.loss - b.loss) if a.loss > target else x0
        return math.inf


def train_all(runs: list[Run]) -> None:
    """Interleaved: the run with the smallest share of its steps done goes next (ties: list order)."""
    total = sum(r.max_steps for r in runs)
    reported = 0
    start = time.time()
    while not all(r.done for r in runs):
        run = min((r for r in runs if not r.done), key=lambda r: r.step / r.max_steps)
        run.advance()
        done = sum(r.step for r in runs)
        if done * 20 >= (reported + 1) * total:  # a progress line every 5%
            reported = done * 20 // total
            print(
                f"   ({done / total:.0%} of {total:,} steps, {time.time() - start:.0f}s)",
                file=sys.stderr,
                flush=True,
            )


def _median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(values) if len(finite) * 2 > len(values) else math.inf


def _si(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}K"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}" if math.isfinite(value) else "-"


def report(recipes: list[Recipe], runs: list[Run], seeds: tuple[int, ...]) -> list[str]:
    by_recipe = {r.name: [run for run in runs if run.recipe is r] for r in recipes}
    base = by_recipe[BASELINE]
    target = statistics.median(r.curve[-1].loss for r in base)
    base_seconds = statistics.median(r.seconds for r in base)
    base_bpb = base[0].held_out.bits_per_byte(target)
    held = base[0].held_out
    lines = [
        f"{len(recipes)} recipes x {len(seeds)} seeds {list(seeds)}, interleaved in one process on "
        f"{torch.get_num_threads()} threads; held-out text: the whole validation split "
        f"({held.windows.count * held.windows.seq_len:,} tokens of the baseline's tokenizer)",
        f"baseline: {BASELINE} (AdamW, cosine, {base[0].max_steps} steps of 32 x 128 tokens); target: its final held-out "
        f"loss, {target:.4f} nats/token = {base_bpb:.4f} bits/byte, after {base_seconds:.0f}s of training",
        "per recipe, medians over seeds: steps and tokens; train s = training time (evaluations excluded), "
        "x time = / the baseline's;",
        "  final held-out loss in nats/token and bits/byte, x loss = / the baseline's (in bits/byte); "
        "tokens and seconds to target = when its held-out loss",
        f"  first reached the target (linear between its {EVALS} evaluations; - = never), x time = seconds "
        "to target / the baseline's training time",
        f"{'recipe':<16} {'steps':>5} {'tokens':>6} {'train s':>7} {'x time':>6} {'nats/tok':>8} "
        f"{'bits/B':>6} {'x loss':>6} {'seed spread':>11} {'tok to target':>13} {'s to target':>11} {'x time':>6}",
    ]
    for recipe in recipes:
        rs = by_recipe[recipe.name]
        seconds = statistics.median(r.seconds for r in rs)
        loss = statistics.median(r.curve[-1].loss for r in rs)
        bpb = statistics.median(r.held_out.bits_per_byte(r.curve[-1].loss) for r in rs)
        tokens_to = _median([r.reach(target, "tokens") for r in rs])
        seconds_to = _median([r.reach(target, "seconds") for r in rs])
        spread = max(r.curve[-1].loss for r in rs) - min(r.curve[-1].loss for r in rs)
        lines.append(
            f"{recipe.name:<16} {rs[0].max_steps:>5} {_si(rs[0].max_steps * rs[0].tokens_per_step):>6} "
            f"{seconds:>7.0f} {seconds / base_seconds:>6.3f} {loss:>8.4f} {bpb:>6.4f} {bpb / base_bpb:>6.3f} "
            f"{f'{spread:.4f}' if len(rs) > 1 else '-':>11} {_si(tokens_to):>13} "
            f"{f'{seconds_to:.0f}' if math.isfinite(seconds_to) else '-':>11} {_ratio(seconds_to, base_seconds):>6}"
        )
    return lines


def ablation_report(recipes: list[Recipe], runs: list[Run]) -> list[str]:
    """Per switch: the final held-out loss it changes, alone on the baseline and alone off tiny-speedrun
    (mean over seeds of the paired difference: the same seed with and without), and the spread of that
    difference over seeds, next to the seed-to-seed spread of the two references themselves."""

    def finals(name: str) -> dict[int, float]:
        return {r.seed: r.curve[-1].loss for r in runs if r.recipe.name == name}

    def spread(values: list[float]) -> str:
        return f"{max(values) - min(values):.4f}" if len(values) > 1 else "-"

    base, fast = finals(BASELINE), finals(SPEEDRUN)
    references = [
        f"{name} {', '.join(f'{v:.4f}' for v in values.values())} (spread {spread(list(values.values()))})"
        for name, values in ((BASELINE, base), (SPEEDRUN, fast))
        if values
    ]
    lines = [
        f"references, final held-out nats/token per seed: {'; '.join(references)}",
        f"{'switch':<26} {'alone on ' + BASELINE:>24} {'spread':>7} {'alone off ' + SPEEDRUN:>24} {'spread':>7}",
    ]
    for name in SWITCHES:
        on, off = finals(f"{BASELINE} + {name}"), finals(f"{SPEEDRUN} - {name}")
        if not on and not off:
            continue
        gain_on = [base[seed] - loss for seed, loss in on.items()]  # > 0: the switch lowers the loss
        gain_off = [loss - fast[seed] for seed, loss in off.items()]  # > 0: the recipe misses it
        mean_on = f"{statistics.mean(gain_on):+.4f}" if gain_on else "-"
        mean_off = f"{statistics.mean(gain_off):+.4f}" if gain_off else "-"
        lines.append(f"{name:<26} {mean_on:>24} {spread(gain_on):>7} {mean_off:>24} {spread(gain_off):>7}")
    lines.append("(gains in nats/token of final held-out loss: > 0 = the switch helps; paired by seed)")
    return lines


def verdict(runs: list[Run]) -> list[str]:
    """The speedrun recipe's bar: tiny-speedrun reaches the baseline's final loss in at most half its time."""
    base = [r for r in runs if r.recipe.name == BASELINE]
    fast = [r for r in runs if r.recipe.name == SPEEDRUN]
    if not base or not fast:
        return []
    target = statistics.median(r.curve[-1].loss for r in base)
    base_seconds = statistics.median(r.seconds for r in base)
    ratio = _median([r.reach(target, "seconds") for r in fast]) / base_seconds
    per_seed = ", ".join(
        f"seed {f.seed} {_ratio(f.reach(target, 'seconds'), b.seconds)}"
        for f, b in zip(fast, base, strict=True)
    )
    ok = "met" if ratio <= 0.5 else "NOT met"
    reached = f"in {ratio:.3f}x" if math.isfinite(ratio) else "never, within"
    return [
        f"the speedrun recipe's bar: {SPEEDRUN} reaches the target {reached} the baseline's training time (median of "
        f"{len(fast)} seeds; per seed against the same seed's baseline: {per_seed}); at most 0.5: {ok}"
    ]


# ---------------------------------------------------------------- the constants of `pretrain plan`'s fit

FIT_STEPS = (50, 100, 200, 400)  # the baseline's run lengths behind L(D) (app/tools/plan.py EMBEDDED_TINY)


def fit_recipes() -> list[Recipe]:
    """The baseline ended at each of FIT_STEPS (each its own run: the cosine ends at its own length), and
    the two speedrun recipes whose losses the fit predicts."""
    lengths = [Recipe(f"{BASELINE} {n}", None, [f"train.max_steps={n}"]) for n in FIT_STEPS[:-1]]
    return [*lengths, Recipe(BASELINE, None), Recipe("tiny", "tiny"), Recipe(SPEEDRUN, SPEEDRUN)]


def fit_power_law(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(E, B, beta) of L(D) = E + B / D^beta by least squares over (D, L) points: for each beta of a grid
    E and B are a linear least-squares fit; the beta with the smallest squared error wins."""
    best = (math.inf, 0.0, 0.0, 0.0)
    for step in range(1, 401):
        beta = step * 0.005
        xs = [tokens**-beta for tokens, _ in points]
        ys = [loss for _, loss in points]
        x_mean = statistics.mean(xs)
        y_mean = statistics.mean(ys)
        spread = sum((x - x_mean) ** 2 for x in xs)
        b = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / spread
        e = y_mean - b * x_mean
        error = sum((e + b * x - y) ** 2 for x, y in zip(xs, ys, strict=True))
        if error < best[0]:
            best = (error, e, b, beta)
    return best[1], best[2], best[3]


def equivalent_tokens(loss: float, e: float, b: float, beta: float) -> float:
    """The tokens after which the fitted classic recipe ends at `loss` (inf below its floor E)."""
    return (b / (loss - e)) ** (1 / beta) if loss > e else math.inf


def fit_report(runs: list[Run]) -> list[str]:
    """The fit of the baseline's final loss over its tokens, its error on those runs and on the longest
    one left out, and tiny-speedrun's effective-token multiplier with the error it makes on tiny."""

    def final(name: str) -> tuple[float, float]:
        rs = [r for r in runs if r.recipe.name == name]
        return rs[0].max_steps * rs[0].tokens_per_step, statistics.median(r.curve[-1].loss for r in rs)

    names = [f"{BASELINE} {n}" for n in FIT_STEPS[:-1]] + [BASELINE]
    points = [final(name) for name in names]
    e, b, beta = fit_power_law(points)
    errors = [abs(e + b / tokens**beta - loss) for tokens, loss in points]
    e_short, b_short, beta_short = fit_power_law(points[:-1])
    longest_tokens, longest_loss = points[-1]
    left_out = abs(e_short + b_short / longest_tokens**beta_short - longest_loss)
    fast_tokens, fast_loss = final(SPEEDRUN)
    multiplier = equivalent_tokens(fast_loss, e, b, beta) / fast_tokens
    tiny_tokens, tiny_loss = final("tiny")
    tiny_error = e + b / (multiplier * tiny_tokens) ** beta - tiny_loss
    lines = [
        f"{name:<24} {_si(tokens):>6} tokens  final held-out {loss:.4f} nats/token"
        for name, (tokens, loss) in zip(names, points, strict=True)
    ]
    lines += [
        f"fit L(D) = {e:.4f} + {b:.4g} / D^{beta:.3f}: largest error on these runs {max(errors):.4f} nats/token; "
        f"fitted without the longest run, it misses that one by {left_out:.4f}",
        f"{SPEEDRUN}: {fast_loss:.4f} after {_si(fast_tokens)} tokens = the fit's loss after {multiplier:.2f}x as "
        f"many: m = {multiplier:.3f}; with that m the fit predicts tiny (the same recipe, {_si(tiny_tokens)} "
        f"tokens) {tiny_loss + tiny_error:.4f}, measured {tiny_loss:.4f} (error {tiny_error:+.4f})",
        f"app/tools/plan.py: EMBEDDED_TINY E={e:.4f}, B={b:.4g}, beta={beta:.3f}, MULTIPLIER_TINY_SPEEDRUN = "
        f'{multiplier:.3f}, error: "largest {max(errors):.3f} nats/token on the fitted runs, {left_out:.3f} on '
        f'the longest left out; tiny predicted {tiny_error:+.3f}"',
    ]
    return lines


def measure(
    recipes: list[Recipe], seeds: tuple[int, ...], scale: float, ablation: bool = False, fit: bool = False
) -> list[str]:
    held_out: dict = {}
    runs = [Run(recipe, seed, scale, held_out) for seed in seeds for recipe in recipes]
    start = time.time()
    train_all(runs)
    if ablation:
        lines = ablation_report(recipes, runs)
    elif fit:
        lines = fit_report(runs)
    else:
        lines = report(recipes, runs, seeds) + verdict(runs)
    lines.append(
        f"{len(runs)} runs, {sum(r.step for r in runs):,} steps in {time.time() - start:.0f}s of wall time"
        + (f"; run lengths scaled by {scale:g}" if scale != 1 else "")
    )
    return lines


def run() -> list[str]:
    return measure(RECIPES, SEEDS, 1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_quality", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--ablation",
        nargs="?",
        const="both",
        choices=("on", "off", "both"),
        help="each switch alone on the baseline (on), alone off tiny-speedrun (off), or both (the default)",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="measure the constants of `pretrain plan`'s loss prediction on the embedded corpus (its fit of "
        "the baseline's final loss over tokens, tiny-speedrun's token multiplier, their errors)",
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds per recipe (default 3; --ablation: 2)")
    parser.add_argument(
        "--seed",
        type=int,
        action="append",
        metavar="N",
        help="this seed instead of --seeds (repeatable): a long measurement split over processes, one seed "
        "each, pairs the same runs",
    )
    parser.add_argument(
        "--scale", type=float, default=None, help="multiply every run's steps (default 1; --ablation: 0.5)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's, one per core)"
    )
    parser.add_argument(
        "--recipe",
        nargs="+",
        action="append",
        metavar="NAME PRESET [KEY=VALUE ...]",
        help="measure these recipes against the baseline instead (PRESET 'before' = the baseline's config)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    recipes = ablation_recipes(args.ablation) if args.ablation else RECIPES
    if args.fit:
        recipes = fit_recipes()
    if args.recipe:
        recipes = [Recipe(BASELINE, None)]
        recipes += [
            Recipe(name, None if preset == "before" else preset, sets) for name, preset, *sets in args.recipe
        ]
    seeds = tuple(args.seed) if args.seed else SEEDS[: args.seeds or (2 if args.ablation else 3)]
    scale = args.scale or (0.5 if args.ablation else 1.0)
    fit = args.fit and not args.ablation and not args.recipe
    for line in measure(recipes, seeds, scale, bool(args.ablation) and not args.recipe, fit):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
