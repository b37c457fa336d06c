"""Stacked state of a pack: members, execution groups, runs of equal optimizer kind, and the
optimizer slots stacked per run -- with ONE table (:data:`SLOT_KEYS`) mapping every stacked
slot to the ``torch.optim`` state key it holds, used both to take the state over
(:func:`read_state`) and to write it back (:func:`flush_run`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

__all__ = ["SLOT_KEYS", "STEP_COUNTED", "read_state", "flush_run", "write_member", "grouped_cross_entropy"]

#: Fused optimizer kind -> {stacked slot name: ``torch.optim`` state key}. Plain ``"sgd"``
#: gets a ``"buf"`` slot only when a member switches momentum on mid-pack.
SLOT_KEYS: dict[str, dict[str, str]] = {
    "sgd": {"buf": "momentum_buffer"},
    "sgd_momentum": {"buf": "momentum_buffer"},
    "sgd_nesterov": {"buf": "momentum_buffer"},
    "adam": {"m": "exp_avg", "v": "exp_avg_sq"},
    "adagrad": {"sum": "sum"},
}
#: Kinds whose ``torch.optim`` state also counts steps (``state["step"]``).
STEP_COUNTED = ("adam", "adagrad")



@dataclass
class _Member:
    id: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch_size: int
    arch: tuple
    kind: str
    batchable: bool
    structure: tuple = ()
    acts: tuple = ()


@dataclass
class _Run:
    """Consecutive members ``lo..hi-1`` of a group that share one optimizer kind: their rows of
    the flat tensors get ONE fused update; ``state`` slots are ``[hi-lo, P]``."""
    kind: str
    lo: int
    hi: int
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)        # per member (adam/adagrad)
    has_buf: bool = False                                 # sgd momentum buffers exist
    row_has_buf: list[bool] | None = None                 # per member, once a run mixes sgd flavours
    # hyper-parameter columns on the device, rebuilt only when a member's param_groups change
    # (the packed step then copies nothing host -> device: no host sync in steady state)
    hp_key: tuple | None = None
    cols: dict[str, torch.Tensor] = field(default_factory=dict)
    cols_gen: int = 0                                     # bumped when ``cols`` are new tensors
    t: torch.Tensor | None = None                         # [hi-lo, 1] float64 step counts (adam/adagrad)

    def row_flags(self) -> list[bool]:
        """Per-member "momentum buffer exists" flags (``has_buf`` for every row until a
        mixed SGD run tracked them one by one)."""
        return self.row_has_buf if self.row_has_buf is not None else [self.has_buf] * (self.hi - self.lo)


@dataclass
class _Group:
    """Members executed together. A batched group keeps ALL its parameters in one flat
    ``[K_g, P]`` tensor (``flat``; gradients in ``gflat``), so a fused optimizer update is a
    handful of tensor ops per run of equal optimizer kinds, not per parameter. ``stacked``
    holds one leaf view ``[K_g, *shape]`` of ``flat`` per parameter name for the forward."""
    members: list[_Member]
    batched: bool
    kind: str
    names: list[str] = field(default_factory=list)
    layout: dict[str, tuple[int, int, tuple[int, ...]]] = field(default_factory=dict)  # off, numel, shape
    flat: torch.Tensor | None = None
    gflat: torch.Tensor | None = None
    stacked: dict[str, torch.Tensor] = field(default_factory=dict)
    runs: list[_Run] = field(default_factory=list)
    max_batch: int = 0
    vmapped: Callable | None = None
    folded: Callable | None = None
    checked: bool = False
    weights: torch.Tensor | None = None                   # [K_g, B] loss weights (1/b_k on each prefix)

    def param_view(self, k: int, name: str, t: torch.Tensor | None = None) -> torch.Tensor:
        """Member k's slice of a ``[K_g, P]`` tensor (default ``flat``) shaped like ``name``."""
        off, n, shape = self.layout[name]
        t = self.flat.data if t is None else t
        return t[k, off:off + n].view(shape)


def grouped_cross_entropy(out: torch.Tensor, y: torch.Tensor, g: "_Group") -> torch.Tensor:
    """Mean cross-entropy of every member over ITS first ``b_k`` rows, in one call.

    ``out`` is ``[K_g, B, C]``; per-sample losses ``[K_g, B]`` are masked to each member's prefix
    and averaged over ``b_k``: the same value and gradient as ``cross_entropy(out[k, :b_k],
    y[:b_k])`` (mean reduction), up to the order of the floating-point sum.
    """
    K_g, B = out.shape[0], out.shape[1]
    per = nn.functional.cross_entropy(out.permute(0, 2, 1), y.unsqueeze(0).expand(K_g, B), reduction="none")
    if g.weights is None or g.weights.shape != per.shape or g.weights.device != per.device:
        w = torch.zeros(K_g, B, dtype=per.dtype, device=per.device)
        for k, m in enumerate(g.members):
            w[k, :m.batch_size] = 1.0 / m.batch_size
        g.weights = w
    return (per * g.weights).sum(1)


def _gather(g: _Group, run: _Run, named: list[dict[str, nn.Parameter]], key: str) -> torch.Tensor:
    """Stack optimizer state ``key`` of the run's members into one ``[hi-lo, P]`` tensor."""
    out = torch.zeros(run.hi - run.lo, g.flat.shape[1], dtype=g.flat.dtype, device=g.flat.device)
    for r, k in enumerate(range(run.lo, run.hi)):
        o = g.members[k].optimizer
        for n in g.names:
            v = o.state.get(named[k][n], {}).get(key)
            if v is not None:
                g.param_view(r, n, out).copy_(v)
    return out


def _step_of(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter]) -> int:
    counts = {int(float(opt.state.get(p, {}).get("step", 0))) for p in params.values()}
    if len(counts) != 1:
        raise ValueError(f"optimizer state must have one step count for all parameters, got {sorted(counts)}")
    return counts.pop()


def read_state(g: _Group, run: _Run, named: list[dict[str, nn.Parameter]]) -> None:
    """Take over the run's optimizer state as flat ``[hi-lo, P]`` slots (:data:`SLOT_KEYS`)."""
    ks = range(run.lo, run.hi)
    if run.kind == "generic" or run.kind == "sgd":
        return
    if run.kind.startswith("sgd"):
        status = {g.members[k].optimizer.state.get(named[k][n], {}).get("momentum_buffer") is not None
                  for n in g.names for k in ks}
        if len(status) > 1:
            # some members past their first step, some not: let each member's own optimizer
            # step (exact, rare: only when members join mid-training)
            run.kind = "generic"
            return
        run.has_buf = status == {True}
    if run.kind in STEP_COUNTED:
        run.steps = [_step_of(g.members[k].optimizer, named[k]) for k in ks]
    for slot, key in SLOT_KEYS[run.kind].items():
        run.state[slot] = _gather(g, run, named, key)


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim gives ``state["step"]`` (``torch.optim.optimizer._get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def flush_run(g: _Group, run: _Run) -> None:
    """Write the run's stacked weights, gradients and optimizer slots back into every member
    (parameters get their own storage again; state keys from :data:`SLOT_KEYS`)."""
    for r in range(run.hi - run.lo):
        write_member(g, run, r, weights=True)


def write_member(g: _Group, run: _Run, r: int, weights: bool) -> None:
    """Write row ``r`` of the run (member ``run.lo + r`` of the group) back into that member:
    its optimizer slots (cloned: the member's state owns its storage) and, with ``weights``,
    its parameters and gradients (then they no longer alias the stacked storage). Without
    ``weights`` the pack goes on unchanged: the member's module keeps aliasing its rows."""
    flags = run.row_flags()
    slots = {s: k for s, k in SLOT_KEYS.get(run.kind, {}).items() if s in run.state}
    k = run.lo + r
    m = g.members[k]
    named = dict(m.model.named_parameters())
    opt = m.optimizer
    if run.kind.startswith("sgd"):       # a buffer only where the member has taken one
        has_state = flags[r] and opt.param_groups[0].get("momentum", 0) != 0
    elif run.kind == "adam":
        has_state = run.steps[r] > 0
    else:
        has_state = run.kind == "adagrad"
    for n in g.names:
        p = named[n]
        if weights:
            p.data = g.param_view(k, n).clone()
            p.grad = g.param_view(k, n, g.gflat).clone()
        if not has_state:
            continue
        st = opt.state[p]
        if run.kind in STEP_COUNTED:
            st["step"] = torch.tensor(float(run.steps[r]), dtype=_scalar_dtype())
        for slot, key in slots.items():
            st[key] = g.param_view(r, n, run.state[slot]).clone()
