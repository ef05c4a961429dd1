"""The model on its devices: the processes, the layout, the memory a run needs and how it is run.
One concern per file:

    distributed.py  the ranks of a run, their process groups and `agree` (a host-side all-reduce)
    runtime.py      what the machine decides: device, autocast, compile mode, residual dtype, fused matmuls
    parallelize.py  the model as a run trains it: FP8 layers, activation checkpointing, compile, DDP or FSDP2
    fp8.py          torchao's float8 layers: which layers, and the checks before converting
    memory.py       the memory estimate per GPU, before anything is allocated
    layout.py       micro-batch x gradient accumulation for the global batch; micro_batch_size=auto
    batches.py      the micro-batches a run trains on, read ahead, and the out-of-memory fit
"""
