"""Folded layers: K_g same-structure members run as ONE computation by folding the member axis
into the batch axis (Linear -> batched matmul, Conv2d -> grouped convolution, each member's own
activation on its rows)."""
from __future__ import annotations

import copy
import logging
from typing import Callable

import torch
from torch import nn

from jabasray.engine.packing.keys import ACTIVATION_TYPES

log = logging.getLogger(__name__)

__all__ = ["NotFoldable", "foldable", "build_folded"]


# ----------------------------------------------------------------------------- batched execution
# Two ways to run K_g same-architecture members as ONE computation on stacked parameters:
#  * vmap:   torch.vmap(functional_call(template, S, x)) -- works for any buffer-free module.
#  * folded: the member axis is folded into the batch axis ([K_g*B, ...] activations). Shape ops
#    (flatten, view(-1, ...), pooling, activations) then run unchanged and only the
#    parametrised layers change: Linear -> one batched matmul with the stacked weights, Conv2d ->
#    one grouped convolution (groups = K_g * groups). A shadow copy of the template has its
#    Linear/Conv2d children replaced by such stacked layers. It avoids vmap's per-op dispatch
#    overhead (about 10x on small CPU models) and is used when every parametrised leaf is a
#    Linear/Conv2d; the first step after a (re)build checks it against a plain forward of one
#    member and falls back to vmap if the model's forward is batch-dependent.

class _Ctx:
    """Rows of the shared input: a layer seeing ``rows`` rows gets the SHARED batch (same
    input for every member); seeing ``K_g * rows`` rows it gets the folded per-member batch."""
    rows: int = 0


class _StackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ctx: _Ctx) -> None:
        super().__init__()
        self.w, self.b, self.ctx = weight, bias, ctx            # [K_g, out, in], [K_g, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K_g = self.w.shape[0]
        n = x.shape[0]
        if n == K_g * self.ctx.rows:                               # folded [K_g*B, ..., in]
            xf = x.reshape(K_g, -1, x.shape[-1])
        elif n == self.ctx.rows:                                 # shared [B, ..., in]
            xf = x.reshape(1, -1, x.shape[-1]).expand(K_g, -1, -1)
        else:
            raise NotFoldable(f"linear input has {n} rows, expected {self.ctx.rows} or {K_g * self.ctx.rows}")
        # out_k = b_k + x_k W_k^T for every member k as ONE batched op (bias fused: baddbmm),
        # one autograd node instead of matmul's expand/reshape/bmm chain plus a broadcast add
        # (about 15-20 % less CPU time per layer's forward + backward at K_g = 1-2 on the
        # sweep's 64-wide MLP; the step's per-op overhead is what packing saves on a CPU)
        wt = self.w.transpose(1, 2)                              # [K_g, in, out]
        out = torch.bmm(xf, wt) if self.b is None else torch.baddbmm(self.b.unsqueeze(1), xf, wt)
        return out.reshape(K_g * self.ctx.rows, *x.shape[1:-1], self.w.shape[1])


class _StackedConv2d(nn.Module):
    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor | None, ctx: _Ctx) -> None:
        super().__init__()
        self.w, self.b, self.ctx = weight, bias, ctx            # [K_g, O, C/g, k, k], [K_g, O]
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        K_g, O = self.w.shape[0], self.w.shape[1]
        B = self.ctx.rows
        n, C, H, W = x.shape
        if n == K_g * B:                                           # [K_g*B, C, H, W] -> [B, K_g*C, H, W]
            xg = x.view(K_g, B, C, H, W).transpose(0, 1).reshape(B, K_g * C, H, W)
        elif n == B:
            xg = x.repeat(1, K_g, 1, 1)
        else:
            raise NotFoldable(f"conv input has {n} rows, expected {B} or {K_g * B}")
        w = self.w.reshape(K_g * O, *self.w.shape[2:])
        b = None if self.b is None else self.b.reshape(K_g * O)
        out = nn.functional.conv2d(xg, w, b, self.stride, self.padding, self.dilation, K_g * self.groups)
        Ho, Wo = out.shape[-2:]
        return out.view(B, K_g, O, Ho, Wo).transpose(0, 1).reshape(K_g * B, O, Ho, Wo)


class NotFoldable(RuntimeError):
    pass


class _MultiActivation(nn.Module):
    """Member k's own activation on member k's rows of a folded ``[K_g*B, ...]`` tensor; runs
    of consecutive members with the same activation are one call."""

    def __init__(self, acts: list[nn.Module], ctx: _Ctx) -> None:
        super().__init__()
        self.ctx = ctx
        self.runs: list[tuple[int, int, nn.Module]] = []       # (first member, end, module)
        for k, a in enumerate(acts):
            if self.runs and repr(self.runs[-1][2]) == repr(a):
                lo, _, mod = self.runs[-1]
                self.runs[-1] = (lo, k + 1, mod)
            else:
                self.runs.append((k, k + 1, a))
        self.K_g = len(acts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = self.ctx.rows
        if x.shape[0] == B and self.K_g > 1:                     # shared input: fold it first
            x = x.unsqueeze(0).expand(self.K_g, *x.shape).reshape(self.K_g * B, *x.shape[1:])
        elif x.shape[0] != self.K_g * B:
            raise NotFoldable(f"activation input has {x.shape[0]} rows, expected {B} or {self.K_g * B}")
        if len(self.runs) == 1:
            return self.runs[0][2](x)
        # one split, not a slice per run: a slice's backward writes a zero-filled tensor of
        # the whole input per run (quadratic in the pack size); the split's is one cat
        parts = x.split([(hi - lo) * B for lo, hi, _ in self.runs])
        return torch.cat([mod(part) for part, (_, _, mod) in zip(parts, self.runs)])


def foldable(model: nn.Module) -> bool:
    """Every parametrised leaf is a Linear or a zero-padded Conv2d."""
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            if isinstance(m, nn.Linear):
                continue
            if isinstance(m, nn.Conv2d) and m.padding_mode == "zeros" and not isinstance(m.padding, str):
                continue
            return False
    return True


def build_folded(models: list[nn.Module], stacked: dict[str, torch.Tensor]) -> Callable | None:
    """Shadow copy of ``models[0]`` whose Linear/Conv2d run on the stacked parameters and whose
    activations are each member's own (``models`` share :func:`structure_key`), or None."""
    template = models[0]
    if not foldable(template):
        return None
    shadow = copy.deepcopy(template)
    ctx = _Ctx()
    for name, mod in list(shadow.named_modules()):
        if isinstance(mod, ACTIVATION_TYPES) and name:
            acts = [m.get_submodule(name) for m in models]
            if len({repr(a) for a in acts}) > 1:
                parent_name, _, child = name.rpartition(".")
                parent = shadow.get_submodule(parent_name) if parent_name else shadow
                setattr(parent, child, _MultiActivation(acts, ctx))
            continue
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            w = stacked[f"{name}.weight" if name else "weight"]
            b = stacked.get(f"{name}.bias" if name else "bias")
            new = _StackedLinear(w, b, ctx) if isinstance(mod, nn.Linear) else _StackedConv2d(mod, w, b, ctx)
            if not name:
                return None                                       # the model IS one layer: use vmap
            parent_name, _, child = name.rpartition(".")
            parent = shadow.get_submodule(parent_name) if parent_name else shadow
            setattr(parent, child, new)
    for p in list(shadow.parameters()):                           # nothing trainable left
        p.requires_grad_(False)

    def run(_stacked: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        K_g = next(iter(stacked.values())).shape[0]
        ctx.rows = x.shape[0]
        out = shadow(x)
        return out.reshape(K_g, x.shape[0], *out.shape[1:])
    return run
