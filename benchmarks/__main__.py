"""`make bench` = `python -m benchmarks [NAME ...]`: run every benchmarks/bench_*.py (or the named ones).

Each module exposes `run() -> list[str]` and reports ratios against a baseline measured in the same
run, never absolute targets: these machines are shared and noisy.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    names = argv or sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    for name in names:
        module = importlib.import_module(
            f"benchmarks.{name if name.startswith('bench_') else 'bench_' + name}"
        )
        print(f"== {name}", flush=True)
        start = time.time()
        for line in module.run():
            print(f"   {line}", flush=True)
        print(f"   ({time.time() - start:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
