"""The optimizer: AdamW for every parameter (optim.name=adamw), or Muon for the hidden weight matrices and
AdamW for the rest (optim.name=muon). Either way one torch Optimizer with four named parameter groups
(GROUPS), each at its own peak LR, so checkpoints keep torch's standard state dict. Under DDP and FSDP2
each rank orthogonalises a share of the matrices and the ranks exchange the results (ShardedMuon); the
update is the single-process one. Details: docs/recipes.md ("Optimizers and parameter groups", "Muon
under DDP and FSDP2").
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


def newton_schulz(update: torch.Tensor, group: dict) -> torch.Tensor:
    """torch's Muon orthogonalisation of one whole matrix (it casts to bf16 first and returns bf16)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])


def newton_schulz_batched(stack: torch.Tensor, group: dict) -> torch.Tensor:
    """torch's _zeropower_via_newtonschulz over a stack of same-shape matrices (k, rows, cols) in bf16: the
    same operations per matrix, one batched matmul for all k instead of k matmuls. On CPU each result
    equals torch's per-matrix one bit for bit (tests/test_optim.py); a GPU's batched kernels may round the
    last bf16 bit differently, which changes nothing between ranks (every rank applies the same results)."""
    a, b, c = group["ns_coefficients"]
    if group["ns_steps"] >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    x = stack.bfloat16()
    tall = stack.size(-2) > stack.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=group["eps"])  # spectral norm at most 1
    for _ in range(group["ns_steps"]):
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of an FSDP2 parameter (a DTensor), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _shard_rows(rows: int, world: int) -> list[int]:
    """The rows of each rank under FSDP2's Shard(0): torch.chunk's split (the last ranks may hold none)."""
    per = -(-rows // world)
    return [max(0, min(per, rows - r * per)) for r in range(world)]


# The fallback base keeps this module importable on a torch without Muon, so that such a torch is refused
# in one line at start-up (app/trainer/features.py) instead of failing at import.
class ShardedMuon(torch.optim.Muon if hasattr(torch.optim, "Muon") else torch.optim.Optimizer):
    """torch.optim.Muon's update (the lines of its _single_tensor_muon) for plain tensors and for FSDP2's
    DTensor shards, with a skip decided on the device (`found_inf`, as GradScaler sets it).

    Whole matrices (one process, or DDP: every rank holds every matrix and the same averaged gradient) are
    orthogonalised batched by shape, one Newton-Schulz over the stack of a shape's matrices. Under DDP
    (`share`, a process group, set by build_optimizer) the matrices of one shape are dealt out in
    contiguous shares of ceil(count / world) matrices, each rank orthogonalises its share as one stack, and
    one all-gather per shape (in bf16, started without waiting, so the next shape's Newton-Schulz overlaps
    it) brings every rank every result: each matrix is orthogonalised once, not on every rank (nanochat's
    DistMuon and the modded-nanogpt record do the same). The update is the one-process update, and every
    rank applies the same bytes, so the ranks' weights stay identical (tests/test_optim.py, 2 gloo ranks
    against torch.optim.Muon). A shape whose count does not divide by the world size leaves the last
    ranks idle for its remainder.

    Under FSDP2 each rank holds some rows of each matrix. The matrices of
    one shape are dealt out to the ranks in turns of world-size matrices; in a turn, one all-to-all brings
    each owner the rows of its matrix (in bf16, the precision Newton-Schulz runs in), the owner
    orthogonalises it, and a second all-to-all brings every rank its rows of each result. So each matrix is
    orthogonalised once, on one rank (as in nanochat's and modded-nanogpt's distributed Muon), not on every
    rank after an all-gather per matrix, and the update is bit-identical to the one-process update
    (tests/test_optim.py). The turns run one after another: communication does not overlap Newton-Schulz.

    A skipped step (a non-finite gradient, or train.skip_spike_updates) keeps every parameter and momentum
    buffer, decided on the device: the momentum's weight and the weight decay become 0 and 1 (two 0-dim
    tensors per group), and per matrix the gradient and the update are zeroed in place. With fused AdamW
    `found_inf` comes with every step, so those two in-place passes over each matrix are what the skip
    costs; nothing is allocated (tests/test_optim.py)."""

    share = None  # DDP: the process group whole matrices are shared out over (None: one process's work)

    @torch.no_grad()
    def step(self, closure=None):  # the closure, if any, is MuonAdamW.step's to evaluate
        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf.bool()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            weight = 1 - group["momentum"]
            decay = 1 - group["lr"] * group["weight_decay"]
            if skip is not None:
                weight = torch.where(skip, 0.0, weight)
                decay = torch.where(skip, 1.0, decay)
            updates = [self._momentum(p, group, weight, skip) for p in params]
            for p, orthogonal in zip(params, self._orthogonalise(params, updates, group), strict=True):
                if skip is not None:
                    orthogonal.masked_fill_(skip, 0.0)  # this rank's rows of a result it owns
                local = _local(p)
                local.mul_(decay)
                local.add_(orthogonal, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape))

    def _momentum(self, p: torch.Tensor, group: dict, weight, skip: torch.Tensor | None) -> torch.Tensor:
        """Momentum and the Nesterov update, on this rank's rows (elementwise: a shard is enough)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
        if skip is not None:  # a non-finite gradient would poison the buffer even at weight 0
            grad.masked_fill_(skip, 0.0)
        buf.lerp_(grad, weight)
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _orthogonalise(self, params: list, updates: list, group: dict) -> list[torch.Tensor]:
        """Each parameter's orthogonalised update, as this rank's rows of it."""
        out: list = [None] * len(params)
        turns: dict[tuple, list[int]] = {}  # sharded matrices by shape
        whole: dict[tuple, list[int]] = {}  # whole matrices by shape
        for i, p in enumerate(params):
            (turns if hasattr(p, "device_mesh") else whole).setdefault(tuple(p.shape), []).append(i)
        gathers = [
            _orthogonalise_shape([updates[i] for i in members], group, self.share)
            for members in whole.values()
        ]
        for members, results in zip(whole.values(), gathers, strict=True):
            for i, result in zip(members, results(), strict=True):
                out[i] = result
        for shape, members in turns.items():
            world = params[members[0]].device_mesh.size()
            for first in range(0, len(members), world):
                turn = members[first : first + world]
                owned = _orthogonalise_turn(params[turn[0]], [updates[i] for i in turn], group, shape)
                for i, rows in zip(turn, owned, strict=True):
                    out[i] = rows
        return out


def _adjust_lr(lr: float, adjust_lr_fn, shape) -> float:
    from torch.optim._muon import _adjust_lr as torch_adjust_lr

    return torch_adjust_lr(lr, adjust_lr_fn, shape)


def _orthogonalise_shape(updates: list[torch.Tensor], group: dict, share):
    """Whole matrices of one shape, orthogonalised as a stack: all of them here (`share` None), or this
    rank's contiguous share of them and an all-gather of every rank's share, started here and waited for
    by the returned function, which gives every matrix's result in order (bf16)."""
    if share is None:
        stack = newton_schulz_batched(torch.stack([u.bfloat16() for u in updates]), group)
        return lambda: stack.unbind()
    import torch.distributed as dist

    world, rank = dist.get_world_size(share), dist.get_rank(share)
    per = -(-len(updates) // world)
    mine = updates[rank * per : (rank + 1) * per]  # the last ranks may hold fewer, or none
    rows, cols = updates[0].shape
    send = updates[0].new_zeros((per, rows, cols), dtype=torch.bfloat16)
    if mine:
        send[: len(mine)] = newton_schulz_batched(torch.stack([u.bfloat16() for u in mine]), group)
    gathered = send.new_empty((world * per, rows, cols))
    # bf16 travels as its bytes: gloo has no bf16, and the bits are all the update reads
    work = dist.all_gather_into_tensor(
        gathered.view(-1).view(torch.uint8), send.view(-1).view(torch.uint8), group=share, async_op=True
    )

    def results() -> list[torch.Tensor]:
        work.wait()
        return list(gathered[: len(updates)].unbind())

    return results


def _orthogonalise_turn(p, updates: list[torch.Tensor], group: dict, shape: tuple) -> list[torch.Tensor]:
    """One turn of FSDP2's Muon (ShardedMuon): rank j owns updates[j] (this rank's rows of each); returns
    this rank's rows of every orthogonalised update. Two all-to-alls over the parameters' mesh."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise NotImplementedError(f"Muon supports FSDP2's row sharding only, not {p.placements}")
    mesh = p.device_mesh.get_group()
    world, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
    rows, cols = shape
    mine = _shard_rows(rows, world)
    owned = rank < len(updates)
    # bf16 travels as its bytes: gloo has no bf16, and the bits are all Newton-Schulz reads
    send = torch.cat([u.bfloat16().reshape(-1) for u in updates]).view(torch.uint8)
    to_owners = [2 * mine[rank] * cols] * len(updates) + [0] * (world - len(updates))
    from_ranks = [2 * n * cols if owned else 0 for n in mine]
    gathered = send.new_empty(sum(from_ranks))
    dist.all_to_all_single(gathered, send, from_ranks, to_owners, group=mesh)
    if owned:  # the pieces arrive in rank order, which is row order
        result = newton_schulz(gathered.view(torch.bfloat16).view(rows, cols), group).contiguous()
        back = result.reshape(-1).view(torch.uint8)
    else:
        back = send.new_empty(0)
    returned = send.new_empty(sum(to_owners))
    dist.all_to_all_single(returned, back, to_owners, from_ranks, group=mesh)
    pieces = returned.view(torch.bfloat16).view(len(updates), mine[rank], cols)
    return list(pieces.unbind())


def _adamw(groups: list[dict], cfg: OptimConfig, fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None
    )


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: ShardedMuon steps the groups marked "muon", torch's AdamW the others.
    They share this object's param group dicts and its state, so state_dict/load_state_dict (and
    torch.distributed.checkpoint's full state dicts) see one optimizer of the standard shape."""

    def __init__(self, groups: list[dict], cfg: OptimConfig, fused: bool, share=None) -> None:
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
            self._children["muon"].share = share
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


def ddp_share(gpt: torch.nn.Module):
    """The process group Muon shares its whole matrices over: the default group when this process is one
    of several and holds whole parameters (DDP: the same matrices and averaged gradients on every rank),
    else None (one process; or FSDP2, whose DTensor shards ShardedMuon exchanges by rows)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if any(hasattr(p, "device_mesh") for p in gpt.parameters()):
        return None
    return dist.group.WORLD


def build_optimizer(gpt: torch.nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The run's optimizer for the GPT (unwrapped from DDP). Collective under several ranks with Muon:
    every rank must build it, as every rank steps it."""
    from app.trainer.parallel.fp8 import scale_after_step

    fused = fused_adamw(cfg, device)
    groups = param_groups(gpt, cfg)
    if cfg.name == "muon":  # torch.optim.Muon is there: features.require checked at start-up
        optimizer = MuonAdamW(groups, cfg, fused, ddp_share(gpt))
    else:
        optimizer = _adamw(groups, cfg, fused)
    if hook := scale_after_step(gpt):  # FP8 under FSDP2: the next forward's float8 scales, after the update
        optimizer.register_step_post_hook(hook)
    return optimizer


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
    """The Muon groups' momentum for the next step (app/trainer/optimization/schedule.py muon_momentum_at), set per
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
