"""The loop's section (`train:`): batch, length of the run, evaluation, precision, parallelism, guards."""

from __future__ import annotations

from dataclasses import dataclass


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
    # torch.compile backend: inductor (generates the kernels) | aot_eager (traces forward and backward, then
    # runs them eagerly: a compile problem without code generation; the same graphs, recompiles and breaks)
    compile_backend: str = "inductor"
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
