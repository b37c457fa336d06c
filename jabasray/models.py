"""Small models defined in the repo (no torchvision): the embedded default of ``jabasray train``
and the models used by tests, examples and benchmarks."""
from __future__ import annotations

import torch
from torch import nn

from .validation import check_choice

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU,
               "leaky_relu": nn.LeakyReLU, "elu": nn.ELU}


def activation(name: str) -> nn.Module:
    """Activation module by name; one of ``ACTIVATIONS``."""
    return ACTIVATIONS[check_choice("activation", name, sorted(ACTIVATIONS))]()


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 single-channel digits (10 classes), ~10k parameters."""

    def __init__(self, channels: int = 16, hidden: int = 64, num_classes: int = 10,
                 act: str = "relu", batch_norm: bool = False) -> None:
        super().__init__()
        norm = (lambda c: nn.BatchNorm2d(c)) if batch_norm else (lambda c: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), norm(channels), activation(act),
            nn.Conv2d(channels, channels, 3, padding=1), norm(channels), activation(act),
            nn.MaxPool2d(2),                                   # 8x8 -> 4x4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(channels * 16, hidden), activation(act), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:                   # flat 64-feature input -> image
            x = x.view(-1, 1, 8, 8)
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """A plain MLP: ``in_features -> hidden... -> num_classes`` with the named activation."""

    def __init__(self, in_features: int = 64, hidden: tuple[int, ...] = (64,), num_classes: int = 10,
                 act: str = "relu") -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_features
        for h in hidden:
            layers += [nn.Linear(prev, h), activation(act)]
            prev = h
        layers.append(nn.Linear(prev, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))
