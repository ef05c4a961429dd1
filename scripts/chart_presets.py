#!/usr/bin/env python3
"""Write helm/presets.yaml: each trainer preset's batch layout as the trainer resolves it (its `base:`
chain applied: app/config/presets.py), for the chart's render-time check that `gpus` divides the preset's
global batch (the trainer would otherwise exit 2 after the pods were scheduled and the data wait was over).

    python scripts/chart_presets.py            # (re)write helm/presets.yaml (`make k8s` runs it)
    python scripts/chart_presets.py --check    # exit 1 when it differs from app/presets/

The rule it feeds is app.trainer.parallel.runtime.grad_accum_steps: with train.batch_tokens set, it must be a
multiple of micro_batch_size x seq_len x world size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "helm" / "presets.yaml"
HEADER = (
    "# Generated from app/presets/*.yaml, each with its bases applied, by scripts/chart_presets.py\n"
    "# (`make k8s`); do not edit.\n"
    "# Batch layout of each trainer preset: the chart refuses a `gpus` that train.batch_tokens does not\n"
    "# divide into micro_batch_size x seq_len x gpus (app/trainer/parallel/runtime.py grad_accum_steps).\n"
)


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from app.config import DEFAULT_PRESET, load_config, preset_names

    table = {}
    for name in preset_names():
        cfg = load_config(preset=name)
        table[name] = {
            "seq_len": cfg.model.seq_len,
            "micro_batch_size": cfg.train.micro_batch_size,
            "batch_tokens": cfg.train.batch_tokens,
        }
    return HEADER + yaml.safe_dump({"default": DEFAULT_PRESET, "presets": table}, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date with app/presets/; run `make k8s`", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date")
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
