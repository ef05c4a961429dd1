"""The optimizer: AdamW for every parameter (optim.name=adamw), or Muon for the hidden weight matrices and
AdamW for the rest (optim.name=muon, nanochat's recipe). Either way one torch Optimizer with named
parameter groups, each at its own peak LR, whose state dict has torch's standard shape.

    group      parameters                                  adamw          muon           peak LR
    matrix     2-D weights inside the blocks (attention,   AdamW, decay   Muon, decay    optim.matrix_lr
               SwiGLU)
    head       the output head when untied                 AdamW, decay   AdamW, decay   optim.head_lr
    embedding  the token embedding (and a tied head)       AdamW          AdamW          optim.embedding_lr
    other      norm gains, any bias                        AdamW          AdamW          optim.lr

A group LR of 0 means optim.lr. The schedule scales every group alike: group LR = its peak x
lr_at(step) / optim.lr (so it warms up and decays with the others, to peak x min_lr / lr). The group
order is also the index order of optimizer state saved before parameter names were stored.

Muon is torch.optim.Muon. Its LR is scaled per matrix by `adjust_lr_fn` (optim.muon_lr_adjust):
match_rms_adamw (default) multiplies by 0.2 * sqrt(max(rows, cols)) so the update's RMS matches AdamW's
and matrix_lr reads like an AdamW LR; original multiplies by sqrt(max(1, rows/cols)) (Keller Jordan's
Muon, LRs around 0.02). Decoupled weight decay: W <- W (1 - lr * optim.weight_decay), as in AdamW.

Under FSDP2 a matrix's gradient is a row shard on each rank, but Newton-Schulz orthogonalises the whole
matrix. We gather: each rank all-gathers the momentum-updated gradient of one matrix at a time (one
all-gather per matrix per step), runs torch's Newton-Schulz on the full matrix, and applies its own rows.
The momentum buffer stays sharded. Every rank repeats the orthogonalisation (cheap next to a step at
these sizes), and the update is bit-identical to the single-process one (tests/test_optim.py). Under DDP
the gradients are already all-reduced, so torch's Muon runs unchanged on every rank.
"""

from __future__ import annotations

import re

import torch

from app.config import OptimConfig
from app.errors import UserError

GROUPS = ("matrix", "head", "embedding", "other")


def _group_of(gpt: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> group name."""
    emb = gpt.tok_emb.weight
    head = gpt.head.weight
    out = {}
    for name, p in gpt.named_parameters():
        if p is emb:
            out[id(p)] = "embedding"
        elif p is head:
            out[id(p)] = "head"
        elif p.dim() == 2 and name.startswith("blocks."):
            out[id(p)] = "matrix"
        else:
            out[id(p)] = "other"
    return out


def group_lrs(cfg: OptimConfig) -> dict[str, float]:
    return {
        "matrix": cfg.matrix_lr or cfg.lr,
        "head": cfg.head_lr or cfg.lr,
        "embedding": cfg.embedding_lr or cfg.lr,
        "other": cfg.lr,
    }


def param_groups(gpt: torch.nn.Module, cfg: OptimConfig) -> list[dict]:
    """The named groups (empty ones left out), in GROUPS order; parameters in model order."""
    of = _group_of(gpt)
    lrs = group_lrs(cfg)
    decay = {"matrix": cfg.weight_decay, "head": cfg.weight_decay, "embedding": 0.0, "other": 0.0}
    groups = []
    for name in GROUPS:
        params = [p for p in gpt.parameters() if p.requires_grad and of[id(p)] == name]
        if params:
            kind = "muon" if name == "matrix" and cfg.name == "muon" else "adamw"
            groups.append(
                {
                    "params": params,
                    "name": name,
                    "optimizer": kind,
                    "lr": lrs[name],
                    "lr_ratio": lrs[name] / cfg.lr,  # set_lr: group LR = scheduled LR x lr_ratio
                    "weight_decay": decay[name],
                }
            )
    return groups


# The fallback base keeps this module importable on a torch without Muon, so that such a torch is refused
# in one line at start-up (app/trainer/features.py) instead of failing at import.
class ShardedMuon(torch.optim.Muon if hasattr(torch.optim, "Muon") else torch.optim.Optimizer):
    """torch.optim.Muon, plus the gather for FSDP2's DTensor shards (see the module docstring) and a skip
    decided on the device (`found_inf`, as GradScaler sets it): the lines of torch's _single_tensor_muon,
    one matrix at a time."""

    @torch.no_grad()
    def step(self, closure=None):  # the closure, if any, is MuonAdamW.step's to evaluate
        from torch.distributed.tensor import DTensor, distribute_tensor
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf.bool()
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                sharded = isinstance(p, DTensor)
                local = p.to_local() if sharded else p
                local_buf = buf.to_local() if sharded else buf
                if skip is not None:  # one matrix's copy at a time, restored below when the step is skipped
                    kept = (local.clone(), local_buf.clone())
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
                if sharded:  # Newton-Schulz on the whole matrix; this rank applies its own rows
                    full = _zeropower_via_newtonschulz(update.full_tensor(), *args)
                    update = distribute_tensor(
                        full, p.device_mesh, p.placements, src_data_rank=None
                    ).to_local()
                else:
                    update = _zeropower_via_newtonschulz(update, *args)
                local.mul_(1 - lr * wd)
                local.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
                if skip is not None:
                    local.copy_(torch.where(skip, kept[0], local))
                    local_buf.copy_(torch.where(skip, kept[1], local_buf))


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: ShardedMuon steps the groups marked "muon", torch's AdamW the others.
    They share this object's param group dicts and its state, so state_dict/load_state_dict (and
    torch.distributed.checkpoint's full state dicts) see one optimizer of the standard shape."""

    def __init__(self, groups: list[dict], cfg: OptimConfig, fused: bool) -> None:
        adamw = [g for g in groups if g["optimizer"] == "adamw"]
        muon = [g for g in groups if g["optimizer"] == "muon"]
        self._adamw = torch.optim.AdamW(
            adamw, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
        )
        self._muon = (
            ShardedMuon(
                muon, lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=True, adjust_lr_fn=cfg.muon_lr_adjust
            )
            if muon
            else None
        )
        super().__init__(groups, defaults={})  # the same dicts, now defaulted by each child
        self._link()

    def _link(self) -> None:
        for child, kind in ((self._adamw, "adamw"), (self._muon, "muon")):
            if child is None:
                continue
            child.param_groups = [g for g in self.param_groups if g["optimizer"] == kind]
            child.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the group dicts and the state: share them again
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        found_inf = getattr(self, "found_inf", None)  # step_unless: both children skip on the device
        for child in (self._adamw, self._muon):
            if child is not None:
                child.found_inf = found_inf
                child.step()
                del child.found_inf
        return loss


def fused_adamw(cfg: OptimConfig, device: torch.device) -> bool:
    """optim.fused=auto: fused AdamW (one kernel over all tensors) on CUDA and CPU, which also lets
    step_unless skip a non-finite step on the device."""
    return device.type in ("cuda", "cpu") if cfg.fused == "auto" else cfg.fused == "true"


def build_optimizer(gpt: torch.nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    fused = fused_adamw(cfg, device)
    groups = param_groups(gpt, cfg)
    if cfg.name == "muon":  # torch.optim.Muon is there: features.require checked at start-up
        return MuonAdamW(groups, cfg, fused)
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step_unless needs no host read: fused AdamW takes `found_inf`, and so does MuonAdamW when
    its AdamW is fused (its Muon part always does)."""
    adamw = optimizer._adamw if isinstance(optimizer, MuonAdamW) else optimizer
    return isinstance(adamw, torch.optim.AdamW) and bool(adamw.defaults.get("fused"))


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """The optimizer step, skipped when `skip` (0-dim float on the parameters' device, 1.0 = skip) is set:
    no parameter, moment or step count changes. Decided on the device (GradScaler's `found_inf`) when
    skips_on_device, so the loop never waits for the GPU; otherwise read here (one device sync)."""
    if not skips_on_device(optimizer):
        if not skip.item():
            optimizer.step()
        return
    optimizer.found_inf = skip
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """`lr` is the schedule's LR for optim.lr; each group gets it times its own peak / optim.lr."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


# ---------------------------------------------------------------- resuming another mode's state


def _kind(entry: dict) -> str | None:
    if "momentum_buffer" in entry:
        return "muon"
    if "exp_avg" in entry:
        return "adamw"
    return None


def fit_state(state: dict, optimizer: torch.optim.Optimizer, gpt: torch.nn.Module) -> tuple[dict, list[str]]:
    """A checkpoint's optimizer state (keyed by parameter name) -> state for this optimizer, and lines to
    log. The param groups become this run's (so a checkpoint from another grouping or mode loads; with the
    same config they equal the saved ones). Per parameter:

      same optimizer     kept as is
      AdamW -> Muon      exp_avg becomes the momentum buffer (both are moving averages of the gradient)
      Muon -> AdamW      AdamW's moments start from zero (Muon keeps no second moment to convert)

    Anything else (state of an unknown optimizer) is refused with one line."""
    names = {id(p): n for n, p in gpt.named_parameters()}
    kind_of = {names[id(p)]: g.get("optimizer", "adamw") for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, dict] = {}
    to_muon, to_adamw = 0, 0
    for fqn, entry in state["state"].items():
        want, have = kind_of.get(fqn), _kind(entry)
        if want is None or have is None:
            raise UserError(
                f"the checkpoint's optimizer state for '{fqn}' ({sorted(entry)}) does not fit this run's "
                "optimizer; resume with the config it was trained with, or start fresh with --resume never"
            )
        if have == want:
            out[fqn] = entry
        elif want == "muon":
            out[fqn] = {"momentum_buffer": entry["exp_avg"]}
            to_muon += 1
        else:
            buf = entry["momentum_buffer"]
            out[fqn] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(buf),
                "exp_avg_sq": torch.zeros_like(buf),
            }
            to_adamw += 1
    notes = []
    if to_muon:
        notes.append(
            f"optimizer: the checkpoint was trained with AdamW; {to_muon} matrices move to Muon with their "
            "exp_avg as the momentum buffer"
        )
    if to_adamw:
        notes.append(
            f"warning: the checkpoint was trained with Muon; {to_adamw} matrices move to AdamW with moments "
            "starting from zero (Muon keeps no second moment)"
        )
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": out, "param_groups": groups}, notes


# ---------------------------------------------------------------- --print-config


def describe_groups(gpt: torch.nn.Module, cfg: OptimConfig) -> list[str]:
    """Which parameters go to which optimizer group, as YAML comments (works on a meta-device model)."""
    n_blocks = len(gpt.blocks)
    lines = [f"# optimizer groups (optim.name={cfg.name}; * = block 0..{n_blocks - 1}):"]
    for g in param_groups(gpt, cfg):
        patterns = []
        names = {id(p): n for n, p in gpt.named_parameters()}
        for p in g["params"]:
            pat = re.sub(r"^blocks\.\d+\.", "blocks.*.", names[id(p)])
            if pat not in patterns:
                patterns.append(pat)
        kind = "Muon" if g["optimizer"] == "muon" else "AdamW"
        count = sum(p.numel() for p in g["params"])
        lines.append(
            f"#   {g['name']:<9} {kind:<5} lr {g['lr']:.3g}, weight decay {g['weight_decay']:g}, "
            f"{len(g['params'])} tensors, {count:,} params: {', '.join(patterns)}"
        )
    return lines
