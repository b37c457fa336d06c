"""A ready-made :class:`TrainingSpec`: an MLP on scikit-learn's digits over the Pack paper's
Table 3 hyperparameters (batch size, optimizer, learning rate, activation). Used by the
example, the benchmark and the tests; module-level functions so Ray pickles them by name."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from jabasray.data import accuracy, load_digits_split
from jabasray.models import MLP
from jabasray.planners.pack_opt import TABLE3_SPACE
from jabasray.tuner.training import TrainingSpec

#: Table 3 of the Pack paper as ``{name: values}`` (activation names as in
#: jabasray.models.ACTIVATIONS); the values of :data:`~jabasray.planners.pack_opt.TABLE3_SPACE`.
TABLE3_PARAM_VALUES: dict[str, list[Any]] = {d.name: list(d.values) for d in TABLE3_SPACE.dimensions}

OPTIMIZERS = ("adam", "sgd", "adagrad", "momentum")


def mlp_model(config: Mapping[str, Any]) -> nn.Module:
    """MLP-3 (three hidden layers, as the paper's MLP-3) sized for 8x8 digits."""
    return MLP(in_features=64, hidden=tuple(config.get("hidden", (64, 64, 64))), num_classes=10,
               act=config.get("activation", "relu"))


def optimizer_for(config: Mapping[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """``optimizer`` in adam | sgd | adagrad | momentum (SGD with momentum 0.9), at ``lr``."""
    name, lr = config.get("optimizer", "sgd"), float(config.get("lr", 0.01))
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    if name == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=lr)
    if name == "momentum":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def digits_data():
    return load_digits_split(val_fraction=0.2, seed=0, image=False)


def val_accuracy(model: nn.Module, val) -> float:
    """Validation accuracy on the model's own device (``spec.device`` may be a GPU); ``val``
    is a TensorDataset or any map-style dataset of ``(inputs, label)`` samples."""
    device = next(model.parameters()).device
    if isinstance(val, TensorDataset):
        return accuracy(model, val, device=device)
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(val, batch_size=512):
            correct += int((model(x.to(device)).argmax(1).cpu() == y).sum())
    model.train(was_training)
    return correct / max(1, len(val))


def digits_mlp_spec(steps_per_unit: int = 2, seed: int = 0, device: str = "cpu") -> TrainingSpec:
    """MLP-3 on digits; metric ``accuracy`` (validation, maximised)."""
    return TrainingSpec(model_fn=mlp_model, optimizer_fn=optimizer_for, data_fn=digits_data,
                        metric_fn=val_accuracy, metric="accuracy", mode="max",
                        steps_per_unit=steps_per_unit, seed=seed, device=device)
