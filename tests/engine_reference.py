"""Shared helpers of the engine tests: a tiny model, deterministic data and the plain
single-process reference step that IIDP must reproduce."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

OPTIMIZERS: dict[str, Callable] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
}


class TinyNet(nn.Module):
    """Conv + MLP on 8x8 inputs, ~1.3k parameters; optional BatchNorm."""

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4) if batch_norm else nn.Identity()
        self.fc1 = nn.Linear(4 * 16, 12)
        self.fc2 = nn.Linear(12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


def make_model(seed: int = 0, batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return TinyNet(batch_norm)


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def split(X: torch.Tensor, y: torch.Tensor, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out, o = [], 0
    for s in sizes:
        out.append((X[o:o + s], y[o:o + s]))
        o += s
    return out


def reference_step(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor, y: torch.Tensor) -> float:
    """One plain step on the union: mean cross-entropy over all samples."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """Worst relative error over parameters: ``max ||a - b|| / (||b|| + 1e-12)`` per tensor."""
    worst = 0.0
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        worst = max(worst, float((pa - pb).detach().norm() / (pb.detach().norm() + 1e-12)))
    return worst


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def run_gloo_ranks(body: Callable[[int], object], tmp_path, world: int = 2) -> list:
    """Run ``body(rank)`` in ``world`` processes joined by a gloo process group (file store in
    ``tmp_path``, float64 default dtype, one torch thread); returns every rank's result, in rank
    order (``body`` must be a module-level function; its result is saved with ``torch.save``)."""
    import torch.multiprocessing as mp
    mp.spawn(_gloo_rank, args=(body, world, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _gloo_rank(rank: int, body: Callable[[int], object], world: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)      # as the float64 fixture in the test process
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    try:
        torch.save(body(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
