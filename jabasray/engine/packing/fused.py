"""Fused optimizer updates: torch.optim's single-tensor SGD, Adam and Adagrad updates applied once
to the stacked ``[K_g, P]`` parameters of a group, with per-member hyperparameters as ``[K_g, 1]``
columns. Tested against ``torch.optim`` itself (tests/test_packing_fused.py)."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["sgd_step", "adam_step", "adagrad_step", "col"]


# Each function is torch.optim's single-tensor update (torch/optim/{sgd,adam,adagrad}.py,
# ``_single_tensor_*``) applied to stacked tensors; per-member hyperparameters are tensors of
# shape [K_g, 1, ..., 1] (float32, i.e. the same rounding as torch's Python-scalar arguments).

def sgd_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, has_buf: bool,
              lr: torch.Tensor, momentum: torch.Tensor | None, dampening: torch.Tensor | None,
              wd: torch.Tensor | None, nesterov: bool) -> None:
    """SGD (torch.optim.SGD docstring):
    ``g <- g + wd*p``; ``b <- g`` (first step) or ``b <- mu*b + (1-tau)*g``;
    ``d <- g + mu*b`` (Nesterov) or ``d <- b``; ``p <- p - lr*d``. ``momentum is None``: d = g."""
    if wd is not None:
        g = g + wd * p
    if momentum is not None:
        assert buf is not None and dampening is not None
        if has_buf:
            buf.mul_(momentum).add_(dampening * g)   # dampening holds (1 - tau)
        else:
            buf.copy_(g)
        g = g + momentum * buf if nesterov else buf
    p.sub_(lr * g)


def adam_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               one_minus_b1: torch.Tensor, b2: torch.Tensor, one_minus_b2: torch.Tensor,
               step_size: torch.Tensor, bc2_sqrt: torch.Tensor, eps: torch.Tensor,
               wd: torch.Tensor | None) -> None:
    """Adam (torch.optim.Adam docstring): ``g <- g + wd*p``; ``m <- lerp(m, g, 1-b1)``;
    ``v <- b2*v + (1-b2)*g^2``; ``p <- p - (lr/(1-b1^t)) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``."""
    if wd is not None:
        g = g + wd * p
    m.lerp_(g, one_minus_b1)
    sq = g * g                                   # (1-b2)*g*g, as addcmul(v, g, g, value=1-b2)
    v.mul_(b2).add_(sq.mul_(one_minus_b2))
    denom = v.sqrt().div_(bc2_sqrt).add_(eps)    # few temporaries: the update is memory-bound
    p.addcdiv_(m * step_size, denom, value=-1)


def adagrad_step(p: torch.Tensor, g: torch.Tensor, s: torch.Tensor, clr: torch.Tensor,
                  eps: torch.Tensor, wd: torch.Tensor | None) -> None:
    """Adagrad (torch.optim.Adagrad docstring): ``g <- g + wd*p``; ``s <- s + g^2``;
    ``p <- p - clr * g / (sqrt(s) + eps)`` with ``clr = lr / (1 + (t-1)*lr_decay)``."""
    if wd is not None:
        g = g + wd * p
    s.addcmul_(g, g)
    p.addcdiv_(g * clr, s.sqrt().add_(eps), value=-1)


def col(vals: Sequence[float], ref: torch.Tensor) -> torch.Tensor:
    """Per-member scalars as a ``[K_g, 1]`` tensor (dtype of ``ref``: the same float32 rounding
    torch applies to a Python-scalar optimizer argument)."""
    return torch.tensor(list(vals), dtype=ref.dtype, device=ref.device).view(-1, 1)
