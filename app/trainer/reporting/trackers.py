"""Experiment trackers (`metrics.trackers`: TensorBoard, MLflow, W&B), fed the records of metrics.jsonl on
global rank 0. A tracker must never cost a step or fail the run, so writes go through a bounded queue to
one background thread and errors are counted, not raised. A restart continues the same tracker run and
shows each step once. Details: docs/observability.md ("Experiment trackers").
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.errors import UserError
from app.files import atomic_write_json

IDS_FILE = "trackers.json"
CLOSE_SECONDS = 120.0  # how long the end of a run waits for trackers to flush


def check_trackers(names: list[str]) -> None:
    """At start, on every rank: each tracker named is known and its package installed (else exit 2)."""
    for name in names:  # each tracker's module and its pyproject extra bear its name
        if name not in KINDS:
            raise UserError(f"metrics.trackers: unknown tracker '{name}'; choose from: {', '.join(KINDS)}")
        # a module set to None in sys.modules is one Python must not import (how tests hide one)
        found = sys.modules[name] is not None if name in sys.modules else importlib.util.find_spec(name)
        if not found:
            raise UserError(
                f"metrics.trackers includes {name} but {name} is not installed: "
                f"pip install 'pretrain[{name}]' (or drop it from metrics.trackers)"
            )


def numbers(fields: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a record; lists of numbers become `<key>/<index>`."""
    out: dict[str, float] = {}
    for k, v in fields.items():
        if isinstance(v, int | float):  # bool included
            out[k] = float(v)
        elif isinstance(v, list) and all(isinstance(x, int | float) for x in v):
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(v)})
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else str(v)
    return out


# ---------------------------------------------------------------- the three tools


class TensorBoard:
    def __init__(self, run_dir: Path, mcfg: Any, ids: dict, start: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard's readers hide what earlier files hold from that step on (redone now)
        purge = None if start is None else start + (start > 0)
        log_dir = mcfg.tensorboard_dir or str(run_dir / "tensorboard")
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge)

    def config(self, cfg: dict) -> None:
        self.writer.add_text("config", "    " + json.dumps(cfg, indent=2).replace("\n", "\n    "), 0)

    def scalars(self, kind: str, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(f"{kind}/{k}", v, step)
        if kind == "checkpoint":
            self.writer.flush()

    def event(self, step: int, name: str, fields: dict) -> None:
        self.writer.add_text("events", f"{name}: {json.dumps(fields)}", step)

    def artifact(self, path: Path, step: int) -> None:
        pass  # TensorBoard has no artifacts

    def close(self, exit_code: int) -> None:
        self.writer.close()


class MLflow:
    def __init__(self, run_dir: Path, mcfg: Any, ids: dict, start: int | None) -> None:
        local = (run_dir / "mlruns").resolve().as_uri()
        uri = mcfg.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or local
        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind an opt-in; it is what we want here
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        mine = ids.get("mlflow", {})
        self.resumed = mine.get("uri") == uri and bool(mine.get("run_id"))
        self.held: dict[str, int] = {}  # metric -> the last step the run already has
        self.events = 0
        if self.resumed:
            self.run_id = mine["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            data = self.client.get_run(self.run_id).data
            for key in data.metrics:
                self.held[key] = max(m.step for m in self.client.get_metric_history(self.run_id, key))
            self.events = sum(k.startswith("event.") for k in data.tags)
        else:
            exp = self.client.get_experiment_by_name(mcfg.mlflow_experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(mcfg.mlflow_experiment)
            run = self.client.create_run(exp_id, run_name=mcfg.tracker_run_name or run_dir.name)
            self.run_id = run.info.run_id
            ids["mlflow"] = {"uri": uri, "run_id": self.run_id}

    def config(self, cfg: dict) -> None:
        if self.resumed:  # params are immutable in MLflow: the first start logged them
            return
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in flatten(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def scalars(self, kind: str, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(f"{kind}/{k}", v, now, step)
            for k, v in values.items()
            if step > self.held.get(f"{kind}/{k}", -1)
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def event(self, step: int, name: str, fields: dict) -> None:
        self.events += 1
        tag = f"event.{self.events:04d}.{name}"
        self.client.set_tag(self.run_id, tag, json.dumps({"step": step, **fields})[:5000])

    def artifact(self, path: Path, step: int) -> None:
        self.client.log_artifacts(self.run_id, str(path), "checkpoint")

    def close(self, exit_code: int) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if exit_code == 0 else "KILLED")


class WandB:
    def __init__(self, run_dir: Path, mcfg: Any, ids: dict, start: int | None) -> None:
        import wandb

        mine = ids.setdefault("wandb", {})
        run_id = mine.setdefault("id", secrets.token_hex(4))  # one W&B run across restarts
        # Offline, each process writes its own file (`wandb sync` uploads them in order): skip what they hold.
        files = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
        self.held = max(map(wandb_last_step, files), default=-1)
        self.wandb = wandb
        self.run = wandb.init(
            project=mcfg.wandb_project,
            entity=mcfg.wandb_entity or None,
            name=mcfg.tracker_run_name or run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=mcfg.wandb_mode or None,  # None: $WANDB_MODE, else online (needs $WANDB_API_KEY)
        )
        self.held = max(self.held, self.run.starting_step - 1)  # online: what the server has

    def config(self, cfg: dict) -> None:
        self.run.config.update(cfg, allow_val_change=True)

    def scalars(self, kind: str, step: int, values: dict[str, float]) -> None:
        if step > self.held:  # W&B's step is ours
            self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def event(self, step: int, name: str, fields: dict) -> None:
        self.run.summary[f"event/{name}"] = {"step": step, **fields}

    def artifact(self, path: Path, step: int) -> None:
        art = self.wandb.Artifact(f"{self.run.name}-checkpoint", type="model", metadata={"step": step})
        art.add_dir(str(path))
        self.run.log_artifact(art, aliases=["final", f"step-{step}"])

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)


KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


def wandb_last_step(path: Path) -> int:
    """The last history step in a W&B run file (LevelDB log framing: 32 KiB blocks of 7-byte-headed
    chunks, after W&B's 7-byte header, around its `Record` protobufs); read up to where a kill cut it."""
    from google.protobuf.message import DecodeError
    from wandb.proto.wandb_internal_pb2 import Record

    data, pos, chunks, last = path.read_bytes(), 7, b"", -1
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail, too short for a header
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 or pos + 7 + length > len(data):
            break
        chunks = (b"" if kind in (1, 2) else chunks) + data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            try:
                record = Record.FromString(chunks)
            except DecodeError:  # torn by the kill
                break
            last = max(last, record.history.step.num if record.HasField("history") else -1)
    return last


# ---------------------------------------------------------------- the hub


class Trackers:
    """Every tracker of the run behind one queue and one writer thread (rank 0)."""

    def __init__(
        self,
        cfg: Any,
        run_dir: Path,
        warn: Callable[[str, str, str], None],
        count_error: Callable[[str], None],
    ) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.warn, self.count_error = warn, count_error
        self.live: list[tuple[str, Any]] = []  # (name, tracker)
        self.warned: set[str] = set()
        self.dropped = 0
        self.last_checkpoint: tuple[Path, int] | None = None
        self.jobs: queue.Queue = queue.Queue(maxsize=10_000)
        self.started = False
        self.thread = threading.Thread(target=self._work, name="trackers", daemon=True)
        self.thread.start()

    # -- called by the Reporter (any thread; never blocks)

    def record(self, kind: str, step: int, fields: dict[str, Any]) -> None:
        if not self.started:  # the trainer's first record is its start event, at the step it resumed
            self.started = True
            self._put(("start", step if fields.get("event") == "start" else None))
        if kind == "event":
            name = str(fields.get("event", "event"))
            rest = {k: v for k, v in fields.items() if k != "event"}
            self._put(lambda t: t.event(step, name, rest))
            final = name == "stop" and fields.get("exit_code") == 0 and self.last_checkpoint
            if final and self.cfg.metrics.tracker_checkpoint:
                path, at = self.last_checkpoint
                self._put(lambda t: t.artifact(path, at))
            return
        if kind == "checkpoint" and "path" in fields:
            self.last_checkpoint = (Path(fields["path"]), step)
        values = numbers(fields)
        if values:
            self._put(lambda t: t.scalars(kind, step, values))

    def close(self, exit_code: int) -> None:
        self._put(lambda t: t.close(exit_code))
        self.jobs.put(None)  # blocking put: the end marker must get in
        self.thread.join(CLOSE_SECONDS)
        if self.thread.is_alive():
            self.warn("all", f"trackers still writing after {CLOSE_SECONDS:.0f} s; leaving them", "timeout")

    # -- the writer thread

    def _put(self, job: Callable | tuple) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:  # a stuck tracker: drop rather than stall training
            self.dropped += 1
            if self.dropped == 1:
                self.warn("all", "tracker queue full (a tracker is stuck?); dropping records", "queue_full")

    def _start(self, step: int | None) -> None:
        ids_path = self.run_dir / IDS_FILE
        try:
            ids = json.loads(ids_path.read_text())
        except (OSError, ValueError):
            ids = {}
        for name in self.cfg.metrics.trackers:
            try:
                self.live.append((name, KINDS[name](self.run_dir, self.cfg.metrics, ids, step)))
            except Exception as e:
                self._failed(name, e, "could not start; it is off for this run")
        atomic_write_json(ids_path, ids)
        self._each(lambda t: t.config(self.cfg.to_dict()))

    def _each(self, job: Callable[[Any], None]) -> None:
        for name, t in list(self.live):
            try:
                job(t)
            except Exception as e:
                self._failed(name, e, "the run goes on without those records")

    def _failed(self, name: str, e: Exception, consequence: str) -> None:
        self.count_error(name)
        if name not in self.warned:  # one warning per tracker; the counter shows the rest
            self.warned.add(name)
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            self.warn(name, f"tracker {name} failed ({msg}); {consequence}", msg)

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if isinstance(job, tuple):
                self._start(job[1])
            else:
                self._each(job)
