"""`pretrain plan`: what a dollar budget buys. Budget -> GPU-hours -> FLOPs -> compute-optimal model, tokens.

Chinchilla (Hoffmann et al. 2022, approach 3): L(N, D) = E + A/N^alpha + B/D^beta with training compute
C = 6 N D. Minimising L at fixed C gives N_opt = G (C/6)^(beta/(alpha+beta)),
D_opt = (C/6)^(alpha/(alpha+beta)) / G, G = (alpha A / (beta B))^(1/(alpha+beta)). N counts all
parameters, embeddings included, as in the paper. The fit is for their data and tokenizer: read the loss
as a relative guide, not a promise.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from app.budget import pricing
from app.command import count
from app.errors import UserError
from app.gpus import normalize, priced

E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28
DEFAULT_MFU = 0.4
MAX_BUDGET_USD = 1e12
# The fit's runs spanned about 6e18 to 6e23 FLOPs (70M to 16B parameters). A plan within a factor of 1,000
# of that range is an extrapolation worth printing; beyond it the formula's figures mean nothing.
FIT_FLOPS = (6e18, 6e23)
FIT_SLACK = 1e3


def compute_optimal(flops: float) -> tuple[float, float]:
    """(N, D) minimising the Chinchilla loss at C = 6 N D."""
    g = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    x = flops / 6
    return g * x ** (BETA / (ALPHA + BETA)), x ** (ALPHA / (ALPHA + BETA)) / g


@dataclass(frozen=True)
class Plan:
    budget_usd: float
    gpu: str
    gpus: int
    price_per_gpu_hour: float
    peak_tflops: float
    mfu: float
    hours: float  # wall-clock hours the budget buys
    flops: float
    params: float
    tokens: float
    loss: float

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params


def _rates(gpu: str, price: float | None, peak: float | None) -> tuple[str, float, float]:
    """(GPU type, USD per GPU-hour, peak TFLOP/s): the overrides, else the built-in tables (0: unknown)."""
    key = normalize(gpu)
    return key, pricing.price_per_gpu_hour(key, price or 0.0), peak or pricing.peak_tflops(key)


def make_plan(budget_usd: float, gpu: str, gpus: int, price=None, mfu=DEFAULT_MFU, peak=None) -> Plan:
    """The Chinchilla plan; `price` and `peak` override the built-in tables (for an unlisted GPU too)."""
    if not 0 < budget_usd <= MAX_BUDGET_USD:  # also NaN
        raise UserError(f"--budget-usd must be > 0 and at most {MAX_BUDGET_USD:g}, got {budget_usd}")
    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu is a fraction of peak in (0, 1], e.g. 0.4; got {mfu}")
    key, price, peak = _rates(gpu, price, peak)
    if price <= 0 or peak <= 0:
        missing = "--price-per-gpu-hour" if price <= 0 else "--peak-tflops"
        raise UserError(f"unknown GPU type '{gpu}': pass {missing} or use one of: {pricing.known_types()}")
    hours = budget_usd / (price * gpus)
    if hours * 60 < 1:  # less than a minute on every GPU: no step, no plan
        raise UserError(
            f"--budget-usd {budget_usd:g} buys {hours * 60:.2g} minutes on {gpus:,} x {key} at ${price:g}/GPU-hour; a plan "
            f"needs at least one minute on every GPU: raise --budget-usd to at least ${price * gpus / 60:.4g} "
            f"or use at most {max(1, math.floor(budget_usd * 60 / price)):,} --gpus"
        )
    flops = gpus * hours * 3600 * peak * 1e12 * mfu
    low, high = FIT_FLOPS[0] / FIT_SLACK, FIT_FLOPS[1] * FIT_SLACK
    if not low <= flops <= high:  # also inf and NaN
        raise UserError(
            f"--budget-usd {budget_usd:g} buys {flops:.3g} FLOPs, outside what the Chinchilla fit covers even as an "
            f"extrapolation ({low:.0e} to {high:.0e} FLOPs: its runs spanned {FIT_FLOPS[0]:.0e} to "
            f"{FIT_FLOPS[1]:.0e}); plan a budget inside that range (or check --mfu and --peak-tflops)"
        )
    n, d = compute_optimal(flops)
    return Plan(budget_usd, key, gpus, price, peak, mfu, hours, flops, n, d, CHINCHILLA.loss(n, d))


# ---------------------------------------------------------------- presets


def _model_params(cfg) -> float:
    """Exact parameter count from the config (app/trainer/parallel/memory.py's split of this repo's GPT): no torch,
    so `pretrain plan` starts in a fraction of a second. Sets an unset model.vocab_size from the data."""
    from app.trainer.parallel.memory import param_split

    if not cfg.model.vocab_size:
        cfg.model.vocab_size = cfg.data.vocab_size if cfg.data.dataset == "embedded" else 50257
    return float(param_split(cfg.model).total)


def preset_params() -> dict[str, float]:
    """Parameters per preset in app/presets/ (all of them load: tests/test_config.py)."""
    from app.config import load_config, preset_names

    return {name: _model_params(load_config(preset=name)) for name in preset_names()}


def nearest_preset(n_params: float, presets: dict[str, float]) -> tuple[str, float]:
    """Closest in log-space: a 2x bigger and a 2x smaller model are equally far."""
    name = min(presets, key=lambda k: abs(math.log(presets[k] / n_params)))
    return name, presets[name]


# ---------------------------------------------------------------- a preset per GPU type and count

PRESET_GPUS = ("b200", "h200", "h100-sxm", "a100-80gb")
PRESET_COUNTS = (8, 4)


def preset_table(args: argparse.Namespace) -> list[str]:
    """Time and cost of a preset's steps on each GPU type and count, at the layout that fits:
    time = steps x tokens/step x training FLOPs/token / (gpus x peak x MFU)."""
    from app.config import load_config
    from app.trainer.parallel.layout import fit
    from app.trainer.parallel.memory import volume_line
    from app.trainer.reporting.metrics import flops_per_token

    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu is a fraction of peak in (0, 1], e.g. 0.4; got {args.mfu}")
    cfg = load_config(preset=args.preset)
    params = _model_params(cfg)  # also fills in the vocab size that the layout and FLOPs need
    steps = cfg.train.max_steps - args.from_step
    if steps <= 0 or args.from_step < 0:
        steps_range = f"[0, train.max_steps={cfg.train.max_steps})"
        raise UserError(f"--from-step must be in {steps_range}, got {args.from_step}")
    gpus_list = (args.gpu,) if args.gpu else PRESET_GPUS
    counts = (args.gpus,) if args.gpus else PRESET_COUNTS
    # the GPUs the preset is made for (its plan: section): in the table unless --gpu/--gpus narrow it, marked
    made_for = (cfg.plan.gpus, normalize(cfg.plan.gpu_type)) if cfg.plan.gpus and cfg.plan.gpu_type else None
    if made_for and not (args.gpu or args.gpus):
        counts = tuple(dict.fromkeys((made_for[0], *counts)))
        gpus_list = tuple(dict.fromkeys((*gpus_list, made_for[1])))
    done = f" from step {args.from_step}" if args.from_step else ""
    lines = [
        f"pretrain plan --preset {cfg.preset}: {_si(params)} params, {steps:,} steps{done} "
        f"(to train.max_steps={cfg.train.max_steps:,}), {flops_per_token(cfg.model) / 1e9:.2f} GFLOPs/token, "
        f"optim.name={cfg.optim.name}, MFU {args.mfu:.0%} (--mfu); built-in prices, approximate",
        f"  {'gpus':>4}  {'gpu':<10} {'micro x accum':>13}  {'mode':<12} {'GB/GPU':>9} {'tokens':>7} "
        f"{'hours':>7} {'$/GPU-h':>8} {'cost $':>9}",
    ]
    for n in counts:
        for gpu in gpus_list:
            lay = fit(cfg, gpu, n)
            if not lay.fits:
                lines.append(f"  {n:>4}  {lay.gpu_type:<10} {'does not fit (even micro-batch 1 + AC)':>40}")
                continue
            _, price, peak = _rates(gpu, args.price_per_gpu_hour, args.peak_tflops)
            per_step = cfg.train.batch_tokens or lay.micro_batch * cfg.model.seq_len * n
            hours = steps * per_step * flops_per_token(cfg.model) / (n * peak * 1e12 * args.mfu) / 3600
            mode = lay.mode.upper() + (" + AC" if lay.checkpointing else "")
            mark = " *" if (n, lay.gpu_type) == made_for else ""
            lines.append(
                f"  {n:>4}  {lay.gpu_type:<10} {f'{lay.micro_batch} x {lay.accum}':>13}  {mode:<12} "
                f"{f'{lay.gb_per_gpu:.0f}/{lay.device_gb:.0f}':>9} {_si(steps * per_step):>7} "
                f"{hours:>7.2f} {price:>8.2f} {hours * n * price:>9,.0f}{mark}"
            )
    if made_for and made_for[0] in counts and made_for[1] in map(normalize, gpus_list):
        lines.append(
            f"  * the GPUs the preset is made for (plan.gpus={made_for[0]}, plan.gpu_type={made_for[1]}): "
            f"`pretrain train --preset {cfg.preset} --print-config` plans for them"
        )
    lines.append(volume_line(cfg, "  "))
    if cfg.train.batch_tokens:
        lines += prepare_lines(steps * cfg.train.batch_tokens, args)
    lines.append(f"  {prediction_line(predict_final_loss(cfg))}")
    lines.append(
        f"  train with one of these layouts: pretrain train --preset {cfg.preset} --gpu-type GPU --gpus N"
        + (" --resume PHASE1_RUN" if args.from_step else "")
    )
    return lines


# ---------------------------------------------------------------- the prepare, on CPUs

# Tokens per second per CPU core of `pretrain prepare` with the GPT-2 tokenizer: FineWeb-Edu's 10B-token
# sample in about 30 minutes on 16 vCPUs, a reference setup's figure (10e9 / (1800 s x 16)).
PREPARE_TOKENS_PER_CORE_SECOND = 350_000.0
DEFAULT_CPU_PRICE = 0.05  # USD per vCPU-hour: about an on-demand cloud vCPU (spot is cheaper)
DEFAULT_PREPARE_CORES = 16  # the chart's prepare.resources request


def prepare_lines(run_tokens: float, args: argparse.Namespace) -> list[str]:
    """The prepare's CPU time and cost: of --prepare-tokens (the corpus), else of the run's tokens read once.
    Billed on the CPU pool, apart from the GPU budget (the training job waits suspended meanwhile, with no
    GPU; docs/budget.md)."""
    price, cores, corpus = args.cpu_price_per_hour, args.prepare_cores, args.prepare_tokens
    if not (price >= 0 and math.isfinite(price)):
        raise UserError(f"--cpu-price-per-hour must be a number >= 0, got {price}")
    if cores < 1:
        raise UserError(f"--prepare-cores must be >= 1, got {cores}")
    if corpus is not None and not corpus >= 1:
        raise UserError(f"--prepare-tokens must be >= 1, got {corpus:g}")
    tokens = corpus or run_tokens
    what = "the corpus" if corpus else "the run's, read once; --prepare-tokens for the corpus"
    core_hours = tokens / PREPARE_TOKENS_PER_CORE_SECOND / 3600
    return [
        f"  prepare (CPU)   {_si(tokens)} tokens ({what}) at ~{_si(PREPARE_TOKENS_PER_CORE_SECOND)} tokens/s "
        f"per core: {core_hours:,.1f} core-hours, {core_hours / cores:,.2f} h on {cores} cores (--prepare-cores; "
        f"prepare.parallelism pods divide it), ${core_hours * price:,.2f} at ${price:g}/core-hour "
        "(--cpu-price-per-hour); not in the GPU budget: no GPU waits for it",
    ]


# ---------------------------------------------------------------- the loss a recipe ends at
#
# A recipe's effect is an effective-token multiplier m: a run of D tokens ends where the classic recipe
# (AdamW, cosine, no switches) ends after m x D tokens. The classic recipe's final loss comes from a fit
# L(N, D) = E + A/N^alpha + B/D^beta; a recipe's predicted loss is L(N, m x D). docs/recipes.md
# ("Predicting the final loss") has the runs behind every constant below and the errors.


@dataclass(frozen=True)
class LossFit:
    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    error: str  # how far it was from measured runs

    def loss(self, params: float, tokens: float) -> float:
        return self.E + self.A / params**self.alpha + self.B / tokens**self.beta

    def formula(self) -> str:
        size = f" + {self.A:g}/N^{self.alpha:g}" if self.A else ""
        return f"L = {self.E:g}{size} + {self.B:g}/D^{self.beta:g}"


CHINCHILLA = LossFit(
    "Chinchilla (Hoffmann et al. 2022, approach 3)",
    E,
    A,
    B,
    ALPHA,
    BETA,
    "fitted on its data and tokenizer, not yours: for GPT-2 124M after 10B FineWeb tokens it says 3.06, "
    "llm.c measured 3.28",
)
# tiny's shape (4 x d192, BPE 2048) on the embedded Shakespeare, held-out nats/token over the whole
# validation split: the classic recipe's final loss after 50, 100, 200 and 400 steps of 4,096 tokens, fitted
# by `python -m benchmarks.bench_quality --fit` (one seed, 2026-11-27): 5.6375, 5.0313, 4.5657, 4.0165. Four
# lengths over 8x of tokens cannot separate E from beta: E comes out negative, so this is an interpolation
# over 205K-1.64M tokens, not a law with an irreducible loss; outside that range its error grows (the error
# line says how much).
EMBEDDED_TINY = LossFit(
    "tiny on the embedded corpus (measured here, 205K-1.64M tokens)",
    E=-4.8051,
    A=0.0,
    B=27.75,
    alpha=0.0,
    beta=0.080,
    error="largest 0.034 nats/token on the fitted runs, 0.191 on the longest when fitted without it; "
    "tiny (800 steps) predicted 0.317 too low",
)
TINY_PARAMS = 1_967_808  # the fit holds for this size only (within 10%)
# Effective-token multipliers. tiny's recipe: tiny-speedrun's tokens against the classic recipe's tokens to
# the same held-out loss (bench_quality --fit: 3.9777 after 492K tokens is the fit's loss after 3.58x as
# many; it overstates the gain of the longer tiny run, which the error line above states). GPT-2 scale: the
# record's own figure: its dense-attention 12-layer run of 11/2024 reached llm.c's 3.28 after 1.57B tokens,
# where llm.c's AdamW run needed 10B.
MULTIPLIER_TINY_SPEEDRUN = 3.581
MULTIPLIER_RECORD = 10e9 / 1.57e9


@dataclass(frozen=True)
class LossPrediction:
    loss: float
    fit: LossFit
    params: float
    tokens: float
    multiplier: float
    recipe: str  # which multiplier applies and why


def recipe_multiplier(cfg) -> tuple[float, str]:
    """(m, why): the speedrun recipes' multiplier when the run trains with Muon, else 1 (the classic recipe)."""
    if cfg.optim.name != "muon":
        return 1.0, "classic recipe (AdamW): m = 1"
    if _embedded_tiny(cfg):
        return (
            MULTIPLIER_TINY_SPEEDRUN,
            f"speedrun recipe (Muon): m = {MULTIPLIER_TINY_SPEEDRUN:.2f}, tiny-speedrun against tiny on the "
            "AdamW recipe",
        )
    return (
        MULTIPLIER_RECORD,
        f"speedrun recipe (Muon): m = {MULTIPLIER_RECORD:.1f}, the record's tokens vs llm.c's",
    )


def _embedded_tiny(cfg) -> bool:
    return (
        cfg.data.dataset == "embedded"
        and cfg.data.tokenizer == "bpe"
        and cfg.data.vocab_size == 2048
        and abs(_fit_params(cfg) / TINY_PARAMS - 1) <= 0.1
    )


def predict_final_loss(cfg, tokens: float | None = None) -> LossPrediction:
    """The held-out loss (nats/token) a run of `cfg` ends at after `tokens` (default: its planned
    train.max_steps x tokens per step, one rank's micro-batch when train.batch_tokens is 0)."""
    params = _fit_params(cfg)
    if tokens is None:
        tokens = cfg.train.max_steps * _tokens_per_step(cfg)
    m, why = recipe_multiplier(cfg)
    fit = EMBEDDED_TINY if _embedded_tiny(cfg) else CHINCHILLA
    return LossPrediction(fit.loss(params, m * tokens), fit, params, tokens, m, why)


def _fit_params(cfg) -> float:
    """N as the fits count it, the classic model's: the blocks and one vocabulary table. Value-embedding
    tables and an untied head are part of what the recipe's multiplier measured, not more N."""
    m = cfg.model
    total = _model_params(cfg)  # also fills in an unset vocab size
    extra = m.value_embeds * m.vocab_size * m.kv_heads * (m.d_model // m.n_head)
    return total - extra - (0 if m.tie_embeddings else m.padded_vocab * m.d_model)


def _tokens_per_step(cfg) -> int:
    """train.batch_tokens, or one micro-batch of one rank (a fixed micro-batch without batch_tokens)."""
    micro = cfg.train.micro_batch_size
    return cfg.train.batch_tokens or (micro if isinstance(micro, int) else 1) * cfg.model.seq_len


def prediction_line(p: LossPrediction) -> str:
    return (
        f"predicted final loss {p.loss:.3f} nats/token after {_si(p.tokens)} tokens: fit {p.fit.name}, "
        f"{p.fit.formula()} (N {_si(p.params)} parameters, D {_si(p.multiplier * p.tokens)} effective tokens; "
        f"{p.recipe}); its error: {p.fit.error}"
    )


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--budget-usd", type=float, help="dollars to spend on training (the Chinchilla plan; needs --gpu)")
    fits = "instead of a budget: time, cost and the batch x accumulation that fits memory for this preset on"
    table = f"{', '.join(f'{n}x' for n in PRESET_COUNTS)} of {', '.join(PRESET_GPUS)}"
    made_for = "the GPUs the preset is made for, its plan: section, marked *"
    add("--preset", metavar="NAME", help=f"{fits} {table} (narrow with --gpu / --gpus; {made_for})")
    add("--gpu", help=f"GPU type: {pricing.known_types()}")
    add("--gpus", type=int, help="GPUs, all nodes (default 1); with --preset, the table covers 8 and 4")
    done = "--preset: steps already done (a phase that resumes another's checkpoint)"
    add("--from-step", type=int, default=0, metavar="N", help=f"{done}; counts train.max_steps - N (0)")
    add("--price-per-gpu-hour", type=float, help="USD per GPU-hour, > 0 (default: the built-in table)")
    add("--mfu", type=float, default=DEFAULT_MFU, help=f"expected MFU, in (0, 1] (default {DEFAULT_MFU})")
    add("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU, > 0 (default: the built-in table)")
    cpu = "USD per CPU core-hour of the prepare's CPU pool, counted apart from the GPU budget"
    add(
        "--cpu-price-per-hour",
        type=float,
        default=DEFAULT_CPU_PRICE,
        help=f"{cpu} (default {DEFAULT_CPU_PRICE})",
    )
    cores = "CPU cores of one prepare pod (the chart's prepare.resources)"
    add(
        "--prepare-cores",
        type=int,
        default=DEFAULT_PREPARE_CORES,
        help=f"{cores} (default {DEFAULT_PREPARE_CORES})",
    )
    corpus = "tokens `pretrain prepare` makes (the corpus, e.g. 10B for FineWeb-Edu's sample)"
    add("--prepare-tokens", type=count, metavar="N", help=f"{corpus}; default: the run's tokens, read once")


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_plan(plan: Plan, presets: dict[str, float]) -> list[str]:
    name, n_preset = nearest_preset(plan.params, presets)
    d_preset = plan.flops / (6 * n_preset)
    lines = [
        f"pretrain plan: ${plan.budget_usd:,.2f} on {plan.gpus} x {plan.gpu} "
        f"at ${plan.price_per_gpu_hour:.2f}/GPU-h, peak {plan.peak_tflops:g} TFLOP/s, MFU {plan.mfu:.0%}",
        f"  hours           {plan.hours:,.2f} h wall clock",
        f"  compute         {plan.flops:.3g} FLOPs (C = 6 N D)",
        f"  params N        {_si(plan.params)} (compute-optimal, embeddings included)",
        f"  tokens D        {_si(plan.tokens)} ({plan.tokens_per_param:.0f} tokens/param)",
        f"  predicted loss  {plan.loss:.3f} nats/token (Chinchilla fit: E + A/N^0.34 + B/D^0.28)",
        f"  nearest preset  {name} ({_si(n_preset)} params): {_si(d_preset)} tokens, "
        f"predicted loss {CHINCHILLA.loss(n_preset, d_preset):.3f}",
        f"  checkpoints     {12 * plan.params / 1e9:.2f} GB each (fp32 weights + AdamW state: 12 bytes/param); "
        f"volume at least {5 * 12 * plan.params / 1e9:.2f} GB (checkpoint.keep_last=3 + best + 1 being written)",
        "",
        f"across GPU types (${plan.budget_usd:,.2f}, {plan.gpus} GPU(s), MFU {plan.mfu:.0%}; "
        "built-in prices, approximate):",
        f"  {'gpu':<10} {'$/GPU-h':>8} {'TFLOP/s':>8} {'hours':>9} {'FLOPs':>9} {'params':>7} "
        f"{'tokens':>7} {'loss':>6}",
    ]
    for key in priced():
        p = make_plan(plan.budget_usd, key, plan.gpus, mfu=plan.mfu)
        lines.append(
            f"  {key:<10} {p.price_per_gpu_hour:>8.2f} {p.peak_tflops:>8g} {p.hours:>9,.1f} {p.flops:>9.2e} "
            f"{_si(p.params):>7} {_si(p.tokens):>7} {p.loss:>6.3f}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    overrides = {"--price-per-gpu-hour": args.price_per_gpu_hour, "--peak-tflops": args.peak_tflops}
    for flag, value in overrides.items():
        if value is not None and not (value > 0 and math.isfinite(value)):
            msg = f"{flag} must be a number > 0, got {value}; leave it out to use the built-in table"
            raise UserError(msg)
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {args.gpus}")
    if args.preset:
        print("\n".join(preset_table(args)))
        return 0
    if args.budget_usd is None or not args.gpu:
        budget = "--budget-usd X --gpu T (what a budget buys)"
        raise UserError(f"pass {budget} or --preset NAME (time and cost of a preset)")
    gpus = args.gpus or 1  # 0 was refused above
    plan = make_plan(args.budget_usd, args.gpu, gpus, args.price_per_gpu_hour, args.mfu, args.peak_tflops)
    plan_lines = format_plan(plan, preset_params())
    # the prepare's line closes the plan, before the table across GPU types (after the first blank line)
    table = plan_lines.index("") if "" in plan_lines else len(plan_lines)
    lines = [*plan_lines[:table], *prepare_lines(plan.tokens, args), *plan_lines[table:]]
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    from app.command import main_for

    return main_for("pretrain plan", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
