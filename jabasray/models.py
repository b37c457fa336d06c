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


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convolutions with BatchNorm and an identity (or 1x1 strided)
    shortcut [He et al. 2016]."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A CIFAR-style ResNet (3x32x32 inputs): a 3x3 stem, three stages of ``blocks`` basic
    blocks at ``width``, 2x and 4x channels (strides 1, 2, 2), global average pooling, a linear
    classifier. ``blocks=1, width=16``: ~0.08M parameters (ResNet-8-like); ``blocks=3``: ResNet-20."""

    def __init__(self, num_classes: int = 10, width: int = 16, blocks: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for stage, stride in enumerate((1, 2, 2)):
            cout = width * 2 ** stage
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, stride if b == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
