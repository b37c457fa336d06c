"""Small models for burst-parallel execution (tests/test_burst_exec.py, benchmarks/burst_exec.py).

Three shapes of layer graph, each traceable by ``torch.fx`` with every layer mapping a batch to a
batch: a VGG-like chain (:class:`ChainCNN`), residual blocks (:class:`ResidualNet`: the shortcut
is a direct edge branch -> join) and Inception-like parallel branches joined by a concat
(:class:`BranchNet`).  ``width`` scales the channels, ``hidden`` the fully connected layers; the
benchmark uses bigger ones than the tests.  Inputs are ``(N, 3, size, size)``, 10 classes.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class ChainCNN(nn.Module):
    """conv-relu x2, pool, conv-relu x2, pool, flatten, fc-relu, fc (VGG's shape in small)."""

    def __init__(self, width: int = 4, hidden: int = 32, size: int = 8, batch_norm: bool = False) -> None:
        super().__init__()
        w = width
        norm = (lambda c: nn.BatchNorm2d(c)) if batch_norm else (lambda c: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), norm(w), nn.ReLU(inplace=True),
            nn.Conv2d(w, w, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2))
        self.fc1 = nn.Linear(2 * w * (size // 4) ** 2, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.features(x), 1)
        return self.fc2(F.relu(self.fc1(x)))


class _Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))) + x)


class ResidualNet(nn.Module):
    """stem conv, ``blocks`` residual blocks (conv-relu-conv + identity), pool, fc."""

    def __init__(self, width: int = 4, blocks: int = 2, size: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*[_Residual(width) for _ in range(blocks)])
        self.fc = nn.Linear(width * (size // 2) ** 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(torch.flatten(F.max_pool2d(x, 2), 1))


class BranchNet(nn.Module):
    """stem conv, then three branches (1x1 conv; 1x1 then 3x3 conv; 3x3 avg-pool then 1x1 conv)
    concatenated along channels (Inception's block in small), pool, fc."""

    def __init__(self, width: int = 4, size: int = 8) -> None:
        super().__init__()
        w = width
        self.stem = nn.Conv2d(3, w, 3, padding=1)
        self.b1 = nn.Conv2d(w, w, 1)
        self.b2a = nn.Conv2d(w, w, 1)
        self.b2b = nn.Conv2d(w, w, 3, padding=1)
        self.b3 = nn.Conv2d(w, w, 1)
        self.fc = nn.Linear(3 * w * (size // 2) ** 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        one = F.relu(self.b1(x))
        two = F.relu(self.b2b(F.relu(self.b2a(x))))
        three = F.relu(self.b3(F.avg_pool2d(x, 3, stride=1, padding=1)))
        x = torch.cat([one, two, three], 1)
        return self.fc(torch.flatten(F.max_pool2d(x, 2), 1))


MODELS = {"chain": ChainCNN, "residual": ResidualNet, "branches": BranchNet}
