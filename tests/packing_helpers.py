"""Shared by the packing tests: the reference every packed step is compared with."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def solo_step(models, optimizers, batch_sizes, x, y, loss_fn=F.cross_entropy) -> torch.Tensor:
    """One plain step of each member alone on its own slice ``x[:b], y[:b]``
    (``zero_grad; loss.backward(); step``); returns the members' losses, stacked (detached)."""
    losses = []
    for m, o, b in zip(models, optimizers, batch_sizes):
        o.zero_grad()
        loss = loss_fn(m(x[:b]), y[:b])
        loss.backward()
        o.step()
        losses.append(loss.detach())
    return torch.stack(losses)
