"""Ray Train's PyTorch quick start (FashionMNIST), ported to JabasTrainer.

Ray Train's version (abridged)::

    def train_func():
        model = NeuralNetwork()                                  # 28x28 -> 10 classes
        model = ray.train.torch.prepare_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        loader = DataLoader(FashionMNIST(...), batch_size=64, shuffle=True)
        loader = ray.train.torch.prepare_data_loader(loader)
        for epoch in range(epochs):
            for X, y in loader:
                loss = nn.CrossEntropyLoss()(model(X), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
            ray.train.report({"loss": ...}, checkpoint=...)

    trainer = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(storage_path=..., name=...))
    result = trainer.fit()

Here the loop is jabasray's (adaptive batching owns the batch size and scales the LR as the
batch grows): you hand in the model, the data, the optimizer and the loss. FashionMNIST itself
is not downloaded: the data is generated with the same shape (1x28x28 images, 10 classes) and a
learnable structure (a fixed random template per class plus noise), small enough that the three
epochs train in seconds on an emulated GPU pair (a first run also starts Ray, profiles the model
once and places the actors: 2.5 minutes wall on a loaded 2-core machine). Run::

    python examples/fashion_mnist_quickstart.py [--epochs 3] [--storage-path jabasray_runs]
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from jabasray import ClusterSpec, JobConfig, RunConfig
from jabasray.actors import JabasTrainer
from jabasray.config import CheckpointConfig, FailureConfig


class NeuralNetwork(nn.Module):
    """Ray Train quick start's model (hidden width 512 there; 128 here to stay fast on CPU)."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_relu_stack(self.flatten(x))


def fashion_mnist_like(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` FashionMNIST-shaped samples: (1, 28, 28) float images normalised as Ray's example
    normalises FashionMNIST, int64 labels 0-9; class c is a faint template c (fixed, seed 0)
    under unit noise, so a few epochs are needed to separate the classes."""
    templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = 0.1 * templates[y] + torch.randn(n, 1, 28, 28, generator=g)   # classes overlap
    return torch.utils.data.TensorDataset(x, y)


def optimizer_fn(params):
    # Ray's example: SGD at lr 1e-3 for batch 64 per worker; with momentum it learns the
    # generated data in a few epochs (the LR here is the LR at initial_global_batch)
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--storage-path", default="jabasray_runs")
    ap.add_argument("--name", default=None, help="run name (default: unique per run)")
    args = ap.parse_args()

    train, val = fashion_mnist_like(2048, seed=1), fashion_mnist_like(512, seed=2)
    # ScalingConfig(num_workers=2) -> one emulated GPU pair (a real cluster: cluster=None detects it)
    cluster = ClusterSpec.emulated({"fast": (1, 2, 1.0)})
    job = JobConfig(epochs=args.epochs, initial_global_batch=128, min_global_batch=64,
                    max_global_batch=512, min_local_batch=16, adapt_interval=4, autoscale=False)
    run_config = RunConfig(storage_path=args.storage_path, name=args.name,
                           checkpoint_config=CheckpointConfig(num_to_keep=2),
                           failure_config=FailureConfig(max_failures=1))
    trainer = JabasTrainer(NeuralNetwork, train, optimizer_fn, nn.CrossEntropyLoss(), job,
                           cluster=cluster, run_config=run_config, val_dataset=val)
    result = trainer.fit()
    print(result)
    with result.checkpoint.as_directory() as folder:    # plain torch files, as Ray Train's
        state = torch.load(f"{folder}/model.pt", weights_only=True)
    model = NeuralNetwork()
    model.load_state_dict(state)
    print(f"final validation accuracy {result.metrics['val_accuracy']:.3f}; "
          f"model restored from {result.checkpoint.path}")


if __name__ == "__main__":
    main()
