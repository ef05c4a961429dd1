"""`pretrain watch`: the budget watcher as its own process (the Kubernetes sidecar), and `--dry-run-budget`.

Settings come from BudgetConfig defaults < the `budget:` section of --config FILE.yaml < flags. As a native
sidecar (`--verdict FILE`) a watcher that cannot start must not exit (the kubelet would restart it in a loop
and the pod would hold its GPUs in Init): it leaves {"code", "reason"} in FILE for the launcher, serves an
empty /metrics for the startupProbe and waits for SIGTERM (docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import signal
import sys
import threading
import time
import traceback
import typing
from pathlib import Path
from typing import Any

from app.budget import BudgetExhausted, check_not_exhausted, open_watcher, start_watching
from app.budget.files import read_status
from app.budget.ledger import load_ledger
from app.budget.metrics import BudgetMetrics
from app.budget.policy import decide, policy_input, stop_seconds
from app.budget.pricing import no_price_error, static_rate
from app.budget.sources import make_source
from app.budget.view import ledger_path_for, state_path_for
from app.budget.watcher import Watcher
from app.config import load_yaml, merge_into
from app.config.budget import CHOICES, FLAG_NAMES, BudgetConfig, check_budget_config, flag_for
from app.config.flags import Flag, add_flag
from app.errors import UserError
from app.files import atomic_write_json, check_writable_dir, not_a_stop_file, stop_file_of

log = logging.getLogger("pretrain.budget")

DEFAULT_METRICS_PORT = 9401

# The BudgetConfig fields `pretrain watch` takes as flags (named by app.config.budget.flag_for, as in
# `pretrain train`), generated from the fields (app/config/flags.py: type, choices, help). Not given, a flag
# leaves the --config file's value (or the field's default) as it is.
WATCH_FIELDS = (
    "cap_usd",
    "gpu_type",
    "price_per_gpu_hour",
    "gpus",
    "price_table",
    "source",
    "source_path",
    "opencost_url",
    "opencost_selector",
    "poll_seconds",
    "stale_seconds",
    "alert_fraction",
    "alert_usd",
    "margin_seconds",
    "decay_fraction",
    "kube",
    "job_name",
    "job_kind",
    "namespace",
    "max_price_per_gpu_hour",
    "suspend_grace_seconds",
    "metrics_port",
    "idle_allowance_seconds",
)
WATCH_FLAGS = tuple(
    Flag(name, flag_for(name), choices=CHOICES.get(name), unset=True, dest_name=name) for name in WATCH_FIELDS
)


class RenamedFlag(argparse.Action):
    """An old flag name, still read: one line on stderr names the new one."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"note: {option_string} is now {self.new}; reading it as that", file=sys.stderr, flush=True)
        setattr(namespace, self.dest, values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    required = parser.add_argument_group("required (here or in the --config file's budget: section)")
    for spec in WATCH_FLAGS:
        add_flag(required if spec.field == "cap_usd" else parser, BudgetConfig, spec)
    # a value renamed in FLAG_NAMES is still read by its field's plain spelling (--cap-usd), with a note
    types = typing.get_type_hints(BudgetConfig)
    for dest, new in FLAG_NAMES.items():
        old = "--" + dest.replace("_", "-")
        parser.add_argument(
            old, dest=dest, type=types[dest], action=RenamedFlag, new=new, help=argparse.SUPPRESS
        )
    add = parser.add_argument
    add("--config", help="run config YAML; its `budget:` section sets the defaults")
    add("--run-dir", help="the trainer's run dir (--out): ledger, status.json, stop.json")
    add("--ledger", help="ledger path (default RUN_DIR/budget/ledger.json)")
    add("--stop-file", help="stop file the trainer polls (default RUN_DIR/stop.json)")
    add("--metrics-addr", default="", help="address /metrics binds to (0.0.0.0 in a pod, else 127.0.0.1)")
    add(
        "--exit-when-done",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exit 0 when the trainer reports done in status.json (a classic sidecar must, or the pod "
        "never ends)",
    )
    add(
        "--verdict",
        help="sidecar mode: when the watcher cannot start, write {code, reason} here, serve an empty "
        "/metrics and wait for SIGTERM instead of exiting (the launcher then ends the pod with the code)",
    )
    add(
        "--dry-run-budget",
        action="store_true",
        help="read the source and the ledger once, print the thresholds and when each would fire, then exit "
        "(a preflight: exit 2 if the run dir, the ledger or the stop file cannot be written)",
    )


def config_from_file(path: str) -> BudgetConfig:
    """BudgetConfig from the `budget:` section of a run config YAML (the chart's /etc/pretrain/config.yaml),
    read and typed as `pretrain train --config` reads it."""
    section = load_yaml(Path(path), "config file").get("budget", {})
    if not isinstance(section, dict):
        raise UserError(f"config file {path}: `budget:` must be a mapping of budget keys")
    names = [f.name for f in dataclasses.fields(BudgetConfig)]
    if unknown := [key for key in section if key not in names]:
        raise UserError(f"unknown key budget.{unknown[0]} in {path}; valid keys: {', '.join(names)}")
    cfg = BudgetConfig()
    merge_into(cfg, section, path, "budget.")
    return cfg


def build_config(args: argparse.Namespace) -> BudgetConfig:
    cfg = config_from_file(args.config) if args.config else BudgetConfig()
    cfg.metrics_port = cfg.metrics_port or DEFAULT_METRICS_PORT  # the file's 0: 9401; --metrics-port 0: off
    for dest in WATCH_FIELDS:
        value = getattr(args, dest, None)
        if value is not None:
            setattr(cfg, dest, value)
    check_budget_config(cfg)
    if cfg.cap_usd <= 0:
        raise UserError("pretrain watch needs a budget: --budget-cap-usd X with X > 0")
    return cfg


def _settings(args: argparse.Namespace) -> tuple[BudgetConfig, Path, Path, Path, float, float]:
    """(config, run dir, ledger, stop file, static USD per hour, USD per GPU-hour) from the flags."""
    cfg = build_config(args)
    if not args.run_dir and not args.ledger:
        raise UserError("pass --run-dir DIR (the trainer's --out) so the ledger and status.json are found")
    run_dir = Path(args.run_dir) if args.run_dir else Path(args.ledger).resolve().parent.parent
    ledger = Path(args.ledger) if args.ledger else ledger_path_for(run_dir)
    stop_file = stop_file_of(args.stop_file, run_dir)
    rate, price = static_rate(cfg.gpu_type, cfg.price_per_gpu_hour, max(cfg.gpus, 1), cfg.price_table)
    if price > 0 and cfg.gpus <= 0:
        raise UserError(
            "a per-GPU price needs the GPU count: --gpus N (all GPUs the job bills, nodes x GPUs per node)"
        )
    if price <= 0 and cfg.source == "static":
        raise no_price_error(cfg.gpu_type)
    if price <= 0:
        log.warning(
            "budget: no static price; if the %s source fails the watcher uses its last good rate", cfg.source
        )
    return cfg, run_dir, ledger, stop_file, rate, price


def _dur(seconds: float | None) -> str:
    if seconds is None or math.isinf(seconds):
        return "never (rate 0)"
    if seconds <= 0:
        return "now"
    total = int(round(seconds))
    hours = total // 3600
    minutes = total % 3600 // 60
    secs = total % 60
    if hours:
        return f"in {hours}h{minutes:02d}m{secs:02d}s"
    return f"in {minutes}m{secs:02d}s" if minutes else f"in {secs}s"


def write_problems(run_dir: Path, ledger_path: Path, stop_file: Path, create: bool = True) -> list[str]:
    """Why the watcher could not write its files (one line each, with the uid and the fix), or []."""
    dirs = {ledger_path.parent: "the ledger's dir", state_path_for(run_dir).parent: "--run-dir's budget dir"}
    dirs.setdefault(stop_file.parent, "the stop file's dir")
    # the stop is written by replacing the file: onto a directory that fails when the cap is reached
    problem = not_a_stop_file(stop_file)
    if problem:
        return [f"the stop file {stop_file} is {problem}; the watcher cannot write a stop onto it"]
    problems = []
    for path, what in dirs.items():
        try:
            check_writable_dir(path, what, create)
        except UserError as e:
            problems.append(str(e))
    return problems


def dry_run(
    cfg: BudgetConfig, run_dir: Path, ledger_path: Path, stop_file: Path, rate: float, price: float
) -> tuple[list[str], list[str]]:
    """What the watcher would see and do, and why it could not write its files (a preflight: exit 2 then).
    Writes nothing but a probe file in each directory the watcher would write (or its nearest parent)."""
    now = time.time()
    out = [f"budget dry run: cap ${cfg.cap_usd:.4f}, run dir {run_dir}"]
    ledger = load_ledger(ledger_path)
    spent = ledger.effective_spent()
    problems = write_problems(run_dir, ledger_path, stop_file, create=False)
    writable = "writable" if not problems else "NOT writable: the watcher would fail"
    new = "new"
    if ledger.sessions:
        new = f"{len(ledger.sessions)} sessions, {ledger.running_seconds / 3600:.2f} h charged"
    out.append(f"  ledger    {ledger_path}: spent ${spent:.4f} ({new}); {writable}")
    static = f"${price:.2f}/GPU-h x {cfg.gpus} GPUs = ${rate:.2f}/h" if price > 0 else "no static price"
    reading = make_source(cfg, rate, ledger.created_unix or now).read(now)
    if reading.ok:
        got = f"spent ${reading.spent_usd:.4f}, " if reading.spent_usd is not None else ""
        out.append(
            f"  source    {cfg.source}: ok, {got}rate ${reading.rate_usd_per_hour:.2f}/h (static: {static})"
        )
        hourly = reading.rate_usd_per_hour or rate
        if reading.spent_usd is not None:
            spent = max(spent, reading.spent_usd + hourly * max(0.0, now - reading.updated_unix) / 3600)
    else:
        hourly = max(rate, ledger.rate_usd_per_hour if ledger.source == cfg.source else 0.0)
        out.append(
            f"  source    {cfg.source}: FAILED ({reading.error}); would fall back to ${hourly:.2f}/h "
            f"({static})"
        )
        if reading.spent_usd is not None:
            spent = max(spent, reading.spent_usd)
    status = read_status(run_dir / "status.json")
    inputs = policy_input(cfg, ledger, spent, hourly, status, now)
    seen = f"status.json: step {status.step}, state {status.state}" if status else "no status.json yet"
    out.append(
        f"  trainer   {seen}; step {inputs.step_seconds:.2f} s, checkpoint {inputs.checkpoint_seconds:.2f} s "
        "(0 = not measured yet)"
    )
    decision = decide(inputs)
    per_second = hourly / 3600
    cap = cfg.cap_usd
    alert_at = min(cfg.alert_fraction * cap, cfg.alert_usd or math.inf)  # alert_usd 0 = off
    graceful_at = cap - per_second * decision.horizon_seconds
    decay_at = graceful_at - cfg.decay_fraction * cap

    def when(at: float) -> str:
        return _dur((at - spent) / per_second if per_second > 0 else None)

    write = inputs.checkpoint_write_seconds
    pending = f" + pending write {write:.1f}" if write else ""
    out.append(
        f"  policy    at ${hourly:.2f}/h, horizon {decision.horizon_seconds:.1f} s = "
        f"max(poll {cfg.poll_seconds:g}, S) + poll {cfg.poll_seconds:g} + "
        f"max(margin {cfg.margin_seconds:g}, S) with S = step {inputs.step_seconds:.1f}{pending} + "
        f"checkpoint {inputs.checkpoint_seconds:.1f} = {stop_seconds(inputs):.1f}"
    )
    out.append(f"    alert             at ${alert_at:.4f}  {when(alert_at)}")
    out.append(f"    LR decay (WSD)    at ${max(decay_at, 0):.4f}  {when(decay_at)}")
    out.append(f"    graceful stop     at ${graceful_at:.4f}  {when(graceful_at)}")
    out.append(f"    immediate stop    at ${cap:.4f}  {when(cap)}")
    act = {"graceful": "a graceful", "immediate": "an immediate"}.get(decision.stop)
    act = f"write {act} stop to {stop_file}" if act else "nothing"
    out.append(f"  now       state {decision.state}; the watcher would do: {act}")
    try:
        check_not_exhausted(cfg, run_dir)
    except BudgetExhausted as e:
        out.append(f"  trainer   would refuse to start: {e}")
    return out, problems


def _stop_on_signals(then: str = "") -> threading.Event:
    """An Event that SIGTERM or SIGINT sets (logged, with `then` after the signal's name)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("budget: %s received%s", signal.Signals(signum).name, then)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def hold(args: argparse.Namespace, code: int, reason: str) -> int:
    """Sidecar mode, the watcher cannot start: leave the verdict for the launcher, serve /metrics for the
    startupProbe, wait for SIGTERM. Returns `code` when even that is impossible."""
    print(f"error: {reason}", file=sys.stderr, flush=True)
    try:
        atomic_write_json(
            Path(args.verdict), {"code": code, "reason": reason, "source": "budget-watcher"}, durable=False
        )
    except OSError as e:
        print(f"error: cannot write the verdict {args.verdict}: {e.strerror}", file=sys.stderr, flush=True)
        return code
    port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    if port:
        try:
            BudgetMetrics().serve(port, args.metrics_addr)
        except OSError as e:
            print(f"error: cannot serve metrics on port {port}: {e.strerror}", file=sys.stderr, flush=True)
            return code
    log.info(
        f"budget: not watching; verdict in {args.verdict} (the trainer's launcher exits {code} with it); "
        "waiting for SIGTERM"
    )
    stop = _stop_on_signals()
    while not stop.wait(1.0):
        pass
    return 0


def start(args: argparse.Namespace) -> Watcher:
    """Everything that may refuse to watch: the settings, the price, the files, the ledger lock, the port."""
    cfg, run_dir, ledger_path, stop_file, rate, price = _settings(args)
    problems = write_problems(run_dir, ledger_path, stop_file)
    if problems:
        raise UserError(problems[0])
    watcher = open_watcher(
        cfg,
        max(cfg.gpus, 1),
        price,
        run_dir=run_dir,
        stop_file=stop_file,
        static_rate_usd_per_hour=rate,
        ledger_path=ledger_path,
    )
    start_watching(watcher, cfg.metrics_port, args.metrics_addr)
    return watcher


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")  # no-op if set
    if args.dry_run_budget:
        lines, problems = dry_run(*_settings(args))
        print("\n".join(lines), flush=True)
        if problems:
            raise UserError(problems[0])
        return 0
    try:
        watcher = start(args)
    except Exception as e:
        if not args.verdict:
            raise
        if isinstance(e, UserError):
            return hold(args, e.exit_code, str(e))
        tb = traceback.extract_tb(e.__traceback__)[-1]
        first = (str(e).splitlines() or [""])[0]
        where = f"{Path(tb.filename).name}:{tb.lineno}"
        return hold(args, 1, f"the budget watcher crashed: {type(e).__name__}: {first} ({where})")
    stop = _stop_on_signals("; closing the ledger")
    cfg = watcher.cfg
    log.info(
        f"budget: watching {watcher.run_dir}: cap ${cfg.cap_usd:.4f}, source {cfg.source}, static "
        f"${watcher.static_rate:.2f}/h, poll {cfg.poll_seconds:g} s, stop file {watcher.stop_file}"
    )
    try:
        why = watcher.run(stop, exit_when_done=args.exit_when_done)
    finally:
        watcher.close()
    v = watcher.view
    if v:
        log.info("budget: exiting (%s): spent $%.4f of $%.4f, state %s", why, v.spent_usd, v.cap_usd, v.state)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m app.budget.cli` runs the watcher without the top-level CLI."""
    from app.command import main_for

    return main_for("pretrain watch", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
