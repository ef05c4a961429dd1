"""The optimizer: AdamW for every parameter (optim.name=adamw), or Muon for the hidden weight matrices and
AdamW for the rest (optim.name=muon). Either way one torch Optimizer with four named parameter groups
(GROUPS), each at its own peak LR, so checkpoints keep torch's standard state dict. Under FSDP2 Muon
all-gathers one matrix at a time, because Newton-Schulz must see the whole matrix; the update is then
bit-identical to the single-process one. Details: docs/recipes.md ("Optimizers and parameter groups").
"""

from __future__ import annotations

import re

import torch

from app.config import OptimConfig
from app.errors import UserError

GROUPS = ("matrix", "head", "embedding", "other")


def _group(gpt: torch.nn.Module, name: str, p: torch.nn.Parameter) -> str:
    if p is gpt.tok_emb.weight or name.startswith("value_embeds."):  # value embeddings: lookups too
        return "embedding"
    if p is gpt.head.weight:
        return "head"
    return "matrix" if p.dim() == 2 and name.startswith("blocks.") else "other"


def param_groups(gpt: torch.nn.Module, cfg: OptimConfig) -> list[dict]:
    """The named groups (empty ones left out), in GROUPS order; parameters in model order."""
    members: dict[str, list] = {name: [] for name in GROUPS}
    for name, p in gpt.named_parameters():
        if p.requires_grad:
            members[_group(gpt, name, p)].append(p)
    lrs = {
        "matrix": cfg.matrix_lr,
        "head": cfg.head_lr,
        "embedding": cfg.embedding_lr,
        "other": cfg.scalar_lr,
    }
    return [
        {
            "params": params,
            "name": name,
            "optimizer": "muon" if name == "matrix" and cfg.name == "muon" else "adamw",
            "lr": lrs[name] or cfg.lr,
            "lr_ratio": (lrs[name] or cfg.lr) / cfg.lr,  # set_lr: group LR = scheduled LR x lr_ratio
            "weight_decay": cfg.weight_decay if name in ("matrix", "head") else 0.0,
        }
        for name, params in members.items()
        if params
    ]


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


def _adamw(groups: list[dict], cfg: OptimConfig, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: ShardedMuon steps the groups marked "muon", torch's AdamW the others.
    They share this object's param group dicts and its state, so state_dict/load_state_dict (and
    torch.distributed.checkpoint's full state dicts) see one optimizer of the standard shape."""

    def __init__(self, groups: list[dict], cfg: OptimConfig, fused: bool) -> None:
        of = {kind: [g for g in groups if g["optimizer"] == kind] for kind in ("adamw", "muon")}
        self._children = {"adamw": _adamw(of["adamw"], cfg, fused)}
        if of["muon"]:
            self._children["muon"] = ShardedMuon(
                of["muon"],
                lr=cfg.lr,
                momentum=cfg.muon_momentum,
                nesterov=True,
                adjust_lr_fn=cfg.muon_lr_adjust,
            )
        super().__init__(groups, defaults={})  # the same dicts, now defaulted by each child
        self._link()

    def _link(self) -> None:
        for kind, child in self._children.items():
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
        for child in self._children.values():
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
    return _adamw(groups, cfg, fused)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """The optimizer step, skipped when `skip` (0-dim float on the parameters' device, 1.0 = skip) is set:
    no parameter, moment or step count changes. Decided on the device (GradScaler's `found_inf`) when the
    AdamW is fused (Muon always takes `found_inf`), so the loop never waits for the GPU; otherwise read
    here (one device sync)."""
    adamw = optimizer._children["adamw"] if isinstance(optimizer, MuonAdamW) else optimizer
    if not (isinstance(adamw, torch.optim.AdamW) and adamw.defaults.get("fused")):
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


def set_muon_momentum(optimizer: torch.optim.Optimizer, momentum: float) -> None:
    """The Muon groups' momentum for the next step (app/trainer/schedule.py muon_momentum_at), set per
    step like the LR: a function of the step and its LR, so a resumed run sets the same values."""
    for group in optimizer.param_groups:
        if group.get("optimizer") == "muon":
            group["momentum"] = momentum


def fit_state(state: dict, optimizer: torch.optim.Optimizer, gpt: torch.nn.Module) -> tuple[dict, list[str]]:
    """A checkpoint's optimizer state (keyed by parameter name) -> state for this optimizer, and lines to
    log. The param groups become this run's (so a checkpoint from another grouping or mode loads; with the
    same config they equal the saved ones). Per parameter: the same optimizer's state is kept, AdamW's
    exp_avg becomes Muon's momentum buffer, Muon -> AdamW starts the moments from zero; anything else is
    refused in one line (docs/recipes.md, "Checkpoints and changing the optimizer")."""
    names = {id(p): n for n, p in gpt.named_parameters()}
    kind_of = {names[id(p)]: g.get("optimizer", "adamw") for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, dict] = {}
    to_muon, to_adamw = 0, 0
    for fqn, entry in state["state"].items():
        have = "muon" if "momentum_buffer" in entry else "adamw" if "exp_avg" in entry else None
        want = kind_of.get(fqn)
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
            zero = torch.zeros((), dtype=torch.float32)
            out[fqn] = {"step": zero, "exp_avg": torch.zeros_like(buf), "exp_avg_sq": torch.zeros_like(buf)}
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
    groups = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return {"state": out, "param_groups": groups}, notes


def describe_groups(gpt: torch.nn.Module, cfg: OptimConfig) -> list[str]:
    """Which parameters go to which optimizer group, as YAML comments for --print-config (works on a
    meta-device model)."""
    names = {id(p): n for n, p in gpt.named_parameters()}
    lines = [f"# optimizer groups (optim.name={cfg.name}; * = block 0..{len(gpt.blocks) - 1}):"]
    for g in param_groups(gpt, cfg):
        patterns = dict.fromkeys(re.sub(r"^blocks\.\d+\.", "blocks.*.", names[id(p)]) for p in g["params"])
        kind = "Muon" if g["optimizer"] == "muon" else "AdamW"
        count = sum(p.numel() for p in g["params"])
        lines.append(
            f"#   {g['name']:<9} {kind:<5} lr {g['lr']:.3g}, weight decay {g['weight_decay']:g}, "
            f"{len(g['params'])} tensors, {count:,} params: {', '.join(patterns)}"
        )
    return lines
