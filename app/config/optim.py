"""The optimizer's section (`optim:`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimConfig:
    """The optimizer and its parameter groups' learning rates (app/trainer/optimization/optimizer.py, docs/recipes.md)."""

    # optimizer: adamw | muon (Muon for the hidden matrices, AdamW for the rest; docs/recipes.md)
    name: str = "adamw"
    lr: float = 1e-3  # peak LR of norms/biases, and of every group whose own LR below is 0
    min_lr: float = 1e-4  # the LR the schedule decays to
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon, in (0, 1)
    # decoupled weight decay, not applied to norms and embeddings; times the peak LR under 1 (each step
    # multiplies the decayed weights by 1 - lr x weight_decay)
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = off, else above optim.eps
    fused: str = "auto"  # fused AdamW kernels: auto (on CUDA) | true | false
    matrix_lr: float = 0.0  # peak LR of the 2-D weights inside the blocks (Muon or AdamW); 0 = lr
    embedding_lr: float = 0.0  # peak LR of the token embedding (and a tied head); 0 = lr
    head_lr: float = 0.0  # peak LR of an untied output head; 0 = lr
    # peak LR of the `other` group (norm gains, the model switches' mixing weights); 0 = lr
    scalar_lr: float = 0.0
    muon_momentum: float = 0.95  # Muon's momentum (at the peak LR)
    # Muon's momentum rises linearly from muon_momentum_start over this many steps; 0 = off
    muon_momentum_warmup_steps: int = 0
    # Muon's momentum at the start of its warm-up (the record: 0.85 -> 0.95 over the first 300 steps)
    muon_momentum_start: float = 0.85
    # Muon's momentum when the LR has decayed to min_lr, following the LR's decay; 0 = off
    muon_momentum_end: float = 0.0
    muon_lr_adjust: str = "match_rms_adamw"  # match_rms_adamw | original (torch.optim.Muon adjust_lr_fn)
