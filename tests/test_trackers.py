"""Experiment trackers on a real run, read back with each tool's own reader: TensorBoard's event reader,
an MLflow file store through MlflowClient, W&B's offline run files (its record protobufs). The run is
SIGKILLed twice between checkpoints and resumed: every step shows once, in the same tracker run. A failing
tracker warns once, counts, and never fails the run; a tracker whose extra is missing is exit 2."""

from __future__ import annotations

import json
import socket
import struct
import sys
import time
import zlib
from pathlib import Path

import pytest

from app.cli import main as cli_main
from tests.conftest import FAST, cli_env, pretrain, train_rows
from tests.procs import Procs
from tests.prom_helpers import sets

STEPS = 12
TRAIN = [
    *FAST,
    *sets("train.eval_every=6", "checkpoint.every_steps=6", "schedule.warmup_steps=2"),
    *sets("metrics.trackers=tensorboard,mlflow,wandb", "metrics.wandb_mode=offline"),
]
# W&B writes its offline file every 15 s by default: flush often, so the killed processes leave steps behind
ENV = {"WANDB_SILENT": "true", "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.2"}
# The trainer, held after logging one step, so that the test kills it there (between checkpoints 6 and 12).
HELD = """
import sys, time
from app.trainer.reporting import report
log_train = report.Reporter.train
def held(self, r, **kw):
    log_train(self, r, **kw)
    if r.step == int(sys.argv[1]):
        time.sleep(3600)
report.Reporter.train = held
from app.cli import main
sys.exit(main(sys.argv[2:]))
"""


def tracked_steps(run: Path) -> tuple[int, int, int]:
    """The last train step each tool holds on disk now: (TensorBoard, MLflow, W&B)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tb = max((e.step for e in acc.Scalars("train/loss")), default=0) if acc.Tags()["scalars"] else 0
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"]
    history = MlflowClient(tracking_uri=(run / "mlruns").as_uri()).get_metric_history(run_id, "train/loss")
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    wb = [r.history.step.num for r in wandb_records(files[-1]) if r.WhichOneof("record_type") == "history"]
    return tb, max((m.step for m in history), default=0), max(wb, default=0)


def kill_after(run: Path, step: int) -> None:
    """Train until `step` is logged and every tracker has written what it got (W&B: up to the step before,
    its row for a step closes when the next one starts), then SIGKILL."""
    with Procs(run.parent / "logs") as procs:
        proc = procs.python(
            "-c",
            HELD,
            str(step),
            "train",
            "--out",
            str(run),
            "--max-steps",
            f"{STEPS}",
            *TRAIN,
            env=cli_env(**ENV),
        )

        def written() -> bool:
            want = (step, step, step - 1)
            got = tracked_steps(run) if (run / "trackers.json").exists() else (0, 0, 0)
            return all(g >= w for g, w in zip(got, want, strict=True))

        proc.wait_until(written, f"every tracker's step {step}", timeout=300, poll=0.2)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Path:
    """Steps 1-6 (checkpoint), a restart killed at step 9, another killed at step 10 (each resumed from
    step 6), then one that trains to the end: the tracker runs are the same throughout."""
    run = tmp_path_factory.mktemp("tracked") / "run"
    pretrain(
        "train", "--out", str(run), "--max-steps", "6", *TRAIN, env=cli_env(**ENV), check=True, timeout=600
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        kill_after(run, 9)
        kill_after(run, 10)
    pretrain("train", "--out", str(run), "--max-steps", str(STEPS), *TRAIN, env=cli_env(**ENV), check=True)
    return run


def jsonl(run: Path, kind: str) -> dict[int, dict]:
    return {r["step"]: r for r in train_rows(run, kind)}


@pytest.mark.slow  # four real training processes, two of them SIGKILLed (~1 min on 2 cores)
def test_tensorboard_has_the_jsonl_rows(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    train, evals = jsonl(tracked, "train"), jsonl(tracked, "eval")
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))  # redone steps once
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert all(loss[s] == pytest.approx(train[s]["loss"], rel=1e-6) for s in train)  # float32 in TB
    assert {e.step: e.value for e in acc.Scalars("eval/val_loss")} == pytest.approx(
        {s: r["val_loss"] for s, r in evals.items()}, rel=1e-6
    )
    assert [e.step for e in acc.Scalars("checkpoint/seconds")] == [6, 12]
    assert "config" in " ".join(acc.Tags()["tensors"])


@pytest.mark.slow  # four real training processes, two of them SIGKILLed (~1 min on 2 cores)
def test_mlflow_file_store_has_metrics_params_and_the_checkpoint(tracked, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tracked / "mlruns").as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "pretrain"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.info.run_id == json.loads((tracked / "trackers.json").read_text())["mlflow"]["run_id"]
    train = jsonl(tracked, "train")
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))  # redone steps once
    assert {m.step: m.value for m in history} == pytest.approx({s: r["loss"] for s, r in train.items()})
    params = run.data.params
    assert params["model.n_layer"] == "2" and params["model.d_model"] == "64"
    assert params["metrics.trackers"] == '["tensorboard", "mlflow", "wandb"]'
    events = sorted((k, json.loads(v)) for k, v in run.data.tags.items() if k.startswith("event."))
    assert [k.split(".")[2] for k, _ in events] == ["start", "stop", "start", "start", "start", "stop"]
    assert [e["step"] for _, e in events] == [0, 6, 6, 6, 6, 12] and events[-1][1]["cause"] == "planned"
    files = {f.path for f in client.list_artifacts(run.info.run_id, "checkpoint")}
    # the checkpoint as the run wrote it (sharded: `pretrain sample/serve --checkpoint DIR` reads it)
    sharded = {"model.index.json", "model-rank00000.safetensors", "meta.json", "tokenizer.json"}
    assert {f"checkpoint/{f}" for f in sharded} <= files


def wandb_records(path: Path) -> list:
    """Records of a W&B run file: LevelDB's log framing (32 KiB blocks of CRC32-checked chunks after a
    7-byte ':W&B' header) around W&B's own `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer: too small for a header
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a chunk cut by the kill
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


@pytest.mark.slow  # four real training processes, two of them SIGKILLed (~1 min on 2 cores)
def test_wandb_offline_run_has_config_history_and_the_checkpoint(tracked):
    wandb_id = json.loads((tracked / "trackers.json").read_text())["wandb"]["id"]
    paths = sorted((tracked / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(paths) == 4 and all(p.name == f"run-{wandb_id}.wandb" for p in paths)  # one run id, resumed
    records = [r for p in paths for r in wandb_records(p)]
    kinds = [r.WhichOneof("record_type") for r in records]
    config = {
        item.key or ".".join(item.nested_key): json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["model"]["n_layer"] == 2 and config["metrics"]["trackers"] == [
        "tensorboard",
        "mlflow",
        "wandb",
    ]
    rows = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    steps = [row["_step"] for row in rows]  # W&B's step is ours: each once, after the restarts too
    assert steps == sorted(set(steps))
    assert [row["_step"] for row in rows if "train/loss" in row] == list(range(1, STEPS + 1))
    loss = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert loss == pytest.approx({s: r["loss"] for s, r in jsonl(tracked, "train").items()})
    arts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert len(arts) == 2  # the final checkpoint of each process that ended with exit 0 (steps 6, 12)
    assert all(a.type == "model" and a.name == "run-checkpoint" for a in arts)
    assert {"model.index.json", "model-rank00000.safetensors", "meta.json", "tokenizer.json"} <= {
        m.path for m in arts[-1].manifest.contents
    }
    exits = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert [e.exit_code for e in exits] == [0, 0]
    assert "history" in kinds


def test_a_failing_tracker_warns_once_counts_and_the_run_goes_on(tmp_path, monkeypatch):
    """MLflow pointed at a port nobody listens on: every write fails; training does not notice."""
    from app.config import load_config
    from app.trainer.parallel.distributed import DistEnv
    from app.trainer.reporting.metrics import TrainerMetrics
    from app.trainer.reporting.report import Reporter
    from app.trainer.stopping.causes import StopCause, StopDecision

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    cfg = load_config(
        "tiny",
        overrides=["metrics.trackers=mlflow,tensorboard", f"metrics.mlflow_uri=http://127.0.0.1:{dead}"],
    )
    rep = Reporter(cfg, DistEnv(), tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rep.metrics = TrainerMetrics(port, "n0", serve_global=True, with_mfu=False, addr="127.0.0.1")
    lines: list[str] = []
    rep.log = lines.append
    for step in range(1, 6):
        rep.eval(step, 2.0 - step / 10, 1.5)
    rep.stopped(5, StopDecision(StopCause.PLANNED, "planned end: reached max_steps=5"))
    rep.close()
    warnings = [m for m in lines if m.startswith("warning: tracker mlflow failed")]
    assert len(warnings) == 1 and "could not start" in warnings[0]
    errors = rep.metrics.registry.get_sample_value("pretrain_tracker_errors_total", {"tracker": "mlflow"})
    assert errors == 1  # it never started, so nothing else was attempted
    logged = [r for r in train_rows(tmp_path, "event") if r.get("event") == "tracker_error"]
    assert [r["tracker"] for r in logged] == ["mlflow"]
    # the healthy tracker still got everything
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/val_loss")] == [1, 2, 3, 4, 5]


def test_missing_tracker_extra_and_unknown_names_are_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the wandb extra were not installed
    assert cli_main(["train", "--out", str(tmp_path), "--set", "metrics.trackers=wandb"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'pretrain[wandb]'" in err
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing started
    assert cli_main(["train", "--out", str(tmp_path), "--set", "metrics.trackers=comet"]) == 2
    assert "metrics.trackers='comet' is not valid" in capsys.readouterr().err


def test_a_tracker_failing_mid_run_is_counted_each_time_and_warned_once(tmp_path, monkeypatch):
    """MLflow starts fine (file store), then its run disappears from the store mid-run: every later write
    fails and is counted, one warning says so, and the other tracker and the log go on."""
    import shutil

    from mlflow.tracking import MlflowClient

    from app.config import load_config
    from app.trainer.parallel.distributed import DistEnv
    from app.trainer.reporting.metrics import TrainerMetrics
    from app.trainer.reporting.report import Reporter
    from app.trainer.stopping.causes import StopCause, StopDecision

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = load_config("tiny", overrides=["metrics.trackers=mlflow,tensorboard"])
    rep = Reporter(cfg, DistEnv(), tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rep.metrics = TrainerMetrics(port, "n0", serve_global=True, with_mfu=False, addr="127.0.0.1")
    lines: list[str] = []
    rep.log = lines.append
    for step in (1, 2):
        rep.eval(step, 2.0 - step / 10, 1.5)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    deadline = time.monotonic() + 60
    while True:  # the writer thread has started MLflow and written both rows
        ids = (
            json.loads((tmp_path / "trackers.json").read_text())
            if (tmp_path / "trackers.json").exists()
            else {}
        )
        run_id = ids.get("mlflow", {}).get("run_id")
        if run_id and len(client.get_metric_history(run_id, "eval/val_loss")) == 2:
            break
        assert time.monotonic() < deadline, "MLflow never got the first rows"
        time.sleep(0.05)
    (run_path,) = (tmp_path / "mlruns").glob(f"*/{run_id}")
    shutil.rmtree(run_path)  # the tracking store loses the run
    for step in (3, 4, 5):
        rep.eval(step, 2.0 - step / 10, 1.5)
    rep.stopped(5, StopDecision(StopCause.PLANNED, "planned end: reached max_steps=5"))
    rep.close()
    errors = rep.metrics.registry.get_sample_value("pretrain_tracker_errors_total", {"tracker": "mlflow"})
    assert errors == 5  # three eval rows, the stop event, closing the run: each one counted
    warnings = [m for m in lines if m.startswith("warning: tracker mlflow failed")]
    assert len(warnings) == 1 and "the run goes on without those records" in warnings[0]
    assert [r["tracker"] for r in train_rows(tmp_path, "event") if r.get("event") == "tracker_error"] == [
        "mlflow"
    ]
    assert [r["step"] for r in train_rows(tmp_path, "eval")] == [1, 2, 3, 4, 5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/val_loss")] == [1, 2, 3, 4, 5]
