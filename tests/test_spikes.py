"""Loss spikes: the detector, and a real training with injected high-loss batches: the detector records the
spike, the JSONL log has it, the Prometheus metric is raised, and skipped updates leave the weights alone."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request

import torch

from app.trainer.checkpoint import store as ckpt
from app.trainer.stopping.spikes import SpikeDetector, spike_rows
from tests.conftest import FAST, train_rows
from tests.prom_helpers import free_port, sets

INJECT_AT, BATCHES, MAX_STEPS = 60, 3, 5000
# A 2-layer model 60 steps in has a loss near 6; random tokens cost ~9: a spike at 1.3x its moving average.
COMMON = [
    *FAST,
    *sets("optim.lr=3e-3", "schedule.warmup_steps=10", "train.spike_factor=1.3"),
]


# ---------------------------------------------------------------- the detector


def test_detector_flags_losses_above_k_times_the_moving_average():
    det = SpikeDetector(factor=3.0, beta=0.9, warmup=5)
    assert not any(det.update(10.0) for _ in range(5))  # warm-up: never a spike, even if high
    assert [det.update(x) for x in (2.0, 2.0)] == [False, False]
    avg = det.avg
    assert det.update(3.1 * avg) and det.count == 1
    assert det.avg == avg, "a spike is not folded into the average"
    assert det.update(float("nan")) and det.count == 2  # NaN is a spike
    assert not det.update(avg)


def test_detector_state_round_trips():
    det = SpikeDetector(factor=2.0, warmup=2)
    for x in (5.0, 4.0, 4.0, 20.0):
        det.update(x)
    again = SpikeDetector(factor=2.0, warmup=2)
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert again.state_dict() == det.state_dict() and again.count == 1


def test_spike_rows_are_random_tokens_seeded_by_step():
    rows = torch.zeros(4, 17, dtype=torch.int32)
    a, b = spike_rows(rows, 7, 100), spike_rows(rows, 7, 100)
    assert torch.equal(a, b) and a.shape == rows.shape and a.dtype == torch.int32
    assert not torch.equal(spike_rows(rows, 8, 100), a) and int(a.max()) < 100 and int(a.min()) >= 0


# ---------------------------------------------------------------- a real training


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_injected_spike_is_detected_logged_exported_and_skipped(tmp_path, procs):
    run, ref = tmp_path / "spiked", tmp_path / "reference"
    port = free_port()
    # The reference run trains the same 60 steps without a spike (in the background meanwhile). Same
    # max_steps and no max_tokens, so the same LR schedule (a max_tokens end would be the schedule's
    # horizon); its checkpoint of step 60 is compared, and it is stopped once that is written.
    reference = procs.pretrain(
        *("train", "--out", str(ref), "--max-steps", str(MAX_STEPS), *COMMON),
        *sets(f"checkpoint.every_steps={INJECT_AT}"),
    )
    # log_every=1000: after the spikes no step is logged for a while, so the spike gauge stays 1 to be read.
    spiked = procs.pretrain(
        *("train", "--out", str(run), "--max-steps", str(MAX_STEPS), *COMMON),
        *sets(
            "train.log_every=1000",
            f"drill.spike_at_step={INJECT_AT}",
            f"drill.spike_batches={BATCHES}",
            "train.skip_spike_updates=true",
            f"checkpoint.every_steps={INJECT_AT + BATCHES}",
        ),
        *("--metrics-port", str(port)),
    )
    ckpt_dir = run / "checkpoints" / f"step_{INJECT_AT + BATCHES:06d}"
    ref_dir = ref / "checkpoints" / f"step_{INJECT_AT:06d}"  # a step dir appears whole (atomic rename)

    def spiked_and_saved() -> bool:
        if ref_dir.is_dir():
            reference.stop()  # it has what the comparison needs
        return len(train_rows(run)) >= BATCHES and ckpt_dir.is_dir()

    spiked.wait_until(spiked_and_saved, f"the spikes and {ckpt_dir.name}", timeout=180, poll=0.05)
    metrics = _scrape(port)

    rows = train_rows(run)
    assert [r["step"] for r in rows[:BATCHES]] == [INJECT_AT + i + 1 for i in range(BATCHES)], rows
    assert all(r["spike"] and r["injected_spike"] and r["loss"] > 1.3 * 5 for r in rows[:BATCHES])
    assert metrics["pretrain_loss_spikes_total"] == BATCHES
    assert metrics["pretrain_loss_spike"] == 1
    assert metrics["pretrain_step"] >= INJECT_AT + BATCHES  # set every step; training goes on
    assert not math.isnan(metrics["pretrain_train_loss"])

    (run / "stop.json").write_text(
        json.dumps({"mode": "graceful", "cause": "user", "reason": "test done", "written_unix": time.time()})
    )
    assert spiked.wait(timeout=120) == 0, spiked.tail()
    text = spiked.output
    assert len(re.findall(r"loss spike at step \d+: .* \(update skipped\)", text)) == BATCHES, text
    state = json.loads((ckpt_dir / "trainer_state.json").read_text())
    assert state["spikes"]["count"] == BATCHES  # the detector's count is checkpointed

    # Skipped updates: the weights after 60 steps + 3 skipped spike steps equal those after 60 steps.
    reference.wait_for_file(ref_dir, timeout=180)
    reference.stop()
    spiked_w = ckpt.load_model_state(ckpt.verify(ckpt_dir)[0])
    ref_w = ckpt.load_model_state(ckpt.verify(ref_dir)[0])
    assert set(spiked_w) == set(ref_w)
    for name, t in ref_w.items():
        assert torch.equal(spiked_w[name], t), f"{name} changed during skipped spike steps"
