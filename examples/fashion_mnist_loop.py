"""Ray Train's PyTorch quick start (FashionMNIST), keeping its own training loop.

The script below is Ray Train's, with six lines changed, each marked ``# jabasray``: two imports
(``prepare_model``, ``prepare_data_loader``, ``report``, ``get_context`` come from
``jabasray.train`` instead of ``ray.train``), the optimizer handed to ``prepare_optimizer``,
``range(n)`` becoming ``epochs(n, model=..., optimizer=...)`` (where jabasray checkpoints,
restores and re-places), ``TorchTrainer`` becoming ``JabasTorchTrainer`` and one added
``job_config=`` line (the global batch's bounds). Ray's own ``RunConfig`` and
``ScalingConfig`` are taken as they are (``use_gpu=False``: GPUs emulated on CPU).
``tests/test_fashion_mnist_port.py`` turns those six lines back and runs the result under Ray
Train itself. Inside the loop nothing else changes: jabasray owns the batch size (each batch
is this GPU's share of the current global batch, which adapts every p iterations), scales the
LR with the global batch, and runs the virtual stream workers behind ``model``. Ray's version
also saves a checkpoint in ``report``; here the driver checkpoints (``report`` ignores one).

FashionMNIST itself is not downloaded: the data is generated with its shape (1x28x28 images,
10 classes, a faint class template under noise; as ``fashion_mnist_quickstart.py``). Run::

    python examples/fashion_mnist_loop.py [--epochs 3] [--storage-path jabasray_runs]
    jabasray train --script examples/fashion_mnist_loop.py --epochs 3 --initial-global-batch 128 \\
        --min-local-batch 16
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import CrossEntropyLoss
from torch.optim import SGD
from torch.utils.data import DataLoader

from ray.train import RunConfig, ScalingConfig
from jabasray.train import JabasTorchTrainer, JobConfig, epochs, prepare_optimizer       # jabasray
from jabasray.train import get_context, prepare_data_loader, prepare_model, report       # jabasray

train_loop_config = {"epochs": 3, "lr": 0.02}


class NeuralNetwork(nn.Module):
    def __init__(self, hidden: int = 128) -> None:     # 512 in Ray's example; 128 for CPUs
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_relu_stack(self.flatten(x))


def fashion_mnist_like(n: int = 2048, seed: int = 1) -> torch.utils.data.TensorDataset:
    """``n`` FashionMNIST-shaped samples (see the module notes)."""
    templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(0.1 * templates[y] + torch.randn(n, 1, 28, 28, generator=g), y)


def train_loop_per_worker(config: dict) -> None:
    # Model, Loss, Optimizer
    model = NeuralNetwork()
    model = prepare_model(model)
    criterion = CrossEntropyLoss()
    optimizer = prepare_optimizer(SGD(model.parameters(), lr=config["lr"], momentum=0.9))  # jabasray

    # Data
    train_loader = DataLoader(fashion_mnist_like(), batch_size=128, shuffle=True)
    train_loader = prepare_data_loader(train_loader)

    # Training
    for epoch in epochs(config["epochs"], model=model, optimizer=optimizer):       # jabasray
        if get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        for images, labels in train_loader:
            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        metrics = {"loss": loss.item(), "epoch": epoch}
        report(metrics)
        if get_context().get_world_rank() == 0:
            print(metrics)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--storage-path", default="jabasray_runs")
    ap.add_argument("--name", default=None, help="run name (default: unique per run)")
    args = ap.parse_args()
    config = dict(train_loop_config, epochs=args.epochs)
    trainer = JabasTorchTrainer(                                                   # jabasray
        train_loop_per_worker, train_loop_config=config,
        job_config=JobConfig(epochs=args.epochs, initial_global_batch=128, min_local_batch=16),  # jabasray
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=args.storage_path, name=args.name))
    result = trainer.fit()
    print(result)


if __name__ == "__main__":
    main()
