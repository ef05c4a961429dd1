"""Run a module the way `python -m` does, with one function wrapped so that the process stops itself
(SIGSTOP) the N-th time it is called. A test then knows exactly where the process is when it signals it:

    PRETRAIN_TEST_PAUSE=package.module:function[:N] PRETRAIN_TEST_PAUSE_DIR=DIR \
        python -m tests.pause_at app.cli train ...

Before it stops, the process writes DIR/paused-<pid> (holding its RANK). A SIGTERM sent while it is
stopped stays pending and is handled as soon as the test sends SIGCONT, inside the paused call (Python
runs the handler at the next bytecode of the main thread); a SIGKILL kills it there. The function is
looked up on its module at call time by the code under test, or imported from it by name (a project
module imported before the wrap gets the wrapped function too), so nothing in the product knows about this.
"""

from __future__ import annotations

import functools
import importlib
import os
import runpy
import signal
import sys
import threading
from pathlib import Path


def install(spec: str, marker_dir: str) -> None:
    module_name, attr, *nth = spec.split(":")
    when = int(nth[0]) if nth else 1
    module = importlib.import_module(module_name)
    original = getattr(module, attr)
    calls = 0

    @functools.wraps(original)
    def paused(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == when:
            Path(marker_dir, f"paused-{os.getpid()}").write_text(os.environ.get("RANK", "0"))
            # to this thread, which stops before its next instruction, then every other thread (a stop
            # sent to the process could be taken by another thread while this one runs on a little)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return original(*args, **kwargs)

    setattr(module, attr, paused)
    # A project module imported before this ran (a run started warm, tests/warm.py, has them all) holds
    # what it imported by name: it gets the wrapped function too, as it would have importing it now.
    for name, loaded in list(sys.modules.items()):
        if name.split(".")[0] == "app" and loaded is not module:
            for key, value in list(vars(loaded).items()):
                if value is original:
                    setattr(loaded, key, paused)


def main() -> None:
    if spec := os.environ.get("PRETRAIN_TEST_PAUSE"):
        install(spec, os.environ["PRETRAIN_TEST_PAUSE_DIR"])
    module = sys.argv[1]
    sys.argv = sys.argv[1:]
    # as under `python -m`, the module runs as __main__ only (a run started warm has it imported already)
    sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
