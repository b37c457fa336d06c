"""Ready-made :class:`~jabasray.tuner.training.TrainingSpec` s on CIFAR-sized inputs (3x32x32,
10 classes) over the Pack paper's Table 3 hyper-parameters: a CIFAR-sized MLP and a small CNN,
the kind of model whose single training step leaves a GPU mostly idle (Pack, section 5: packing
pays where one configuration cannot fill the device). The data are the generated images of
:func:`jabasray.data.cifar_sized_split`, built in memory (no download). Used by
``benchmarks/hyperband.py --workload``; module-level functions so Ray pickles them by name.

Neither model holds buffers or dropout, so every member packs (``vmap`` over the stacked
parameters, :mod:`jabasray.engine.packing`)."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from jabasray.data import cifar_sized_split
from jabasray.models import MLP, activation
from jabasray.tuner.digits import optimizer_for, val_accuracy
from jabasray.tuner.training import TrainingSpec

TRAIN_IMAGES, VAL_IMAGES = 5000, 1000


def cifar_sized_data():
    """(train, validation): 5000 and 1000 generated 3x32x32 images (seeds 0 and 1)."""
    return cifar_sized_split(TRAIN_IMAGES, VAL_IMAGES, seed=0)


def cifar_mlp_model(config: Mapping[str, Any]) -> nn.Module:
    """MLP 3072 -> 512 -> 256 -> 10 with the configuration's activation (1.7M parameters)."""
    return MLP(in_features=3 * 32 * 32, hidden=(512, 256), num_classes=10,
               act=config.get("activation", "relu"))


class SmallCNN(nn.Module):
    """conv3x3(32) - act - pool2 - conv3x3(64) - act - pool2 - fc(128) - act - fc(10) for 3x32x32
    inputs (0.55M parameters); no BatchNorm, so members pack."""

    def __init__(self, act: str = "relu", num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), activation(act), nn.MaxPool2d(2),     # 32 -> 16
            nn.Conv2d(32, 64, 3, padding=1), activation(act), nn.MaxPool2d(2),    # 16 -> 8
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 128), activation(act),
                                        nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def small_cnn_model(config: Mapping[str, Any]) -> nn.Module:
    return SmallCNN(act=config.get("activation", "relu"))


def cifar_mlp_spec(steps_per_unit: int = 2, seed: int = 0, device: str = "cpu") -> TrainingSpec:
    """The CIFAR-sized MLP; metric ``accuracy`` (validation, maximised)."""
    return TrainingSpec(model_fn=cifar_mlp_model, optimizer_fn=optimizer_for, data_fn=cifar_sized_data,
                        metric_fn=val_accuracy, metric="accuracy", mode="max",
                        steps_per_unit=steps_per_unit, seed=seed, device=device)


def small_cnn_spec(steps_per_unit: int = 2, seed: int = 0, device: str = "cpu") -> TrainingSpec:
    """The small CNN; metric ``accuracy`` (validation, maximised)."""
    return TrainingSpec(model_fn=small_cnn_model, optimizer_fn=optimizer_for, data_fn=cifar_sized_data,
                        metric_fn=val_accuracy, metric="accuracy", mode="max",
                        steps_per_unit=steps_per_unit, seed=seed, device=device)
