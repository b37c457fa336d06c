"""Datasets that ship with a package: scikit-learn's bundled digits (1797 8x8 images)."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .validation import check_float


def load_digits_split(val_fraction: float = 0.2, seed: int = 0, image: bool = True
                      ) -> tuple[TensorDataset, TensorDataset]:
    """Digits as ``(train, val)`` TensorDatasets; inputs scaled to [0, 1].

    ``image=True`` gives inputs of shape (N, 1, 8, 8), else (N, 64). The split is stratified
    by a fixed permutation of ``seed`` so every process builds the same split.
    """
    from sklearn.datasets import load_digits

    check_float("val_fraction", val_fraction, min_value=0.0, max_value=1.0, min_exclusive=True,
                max_exclusive=True)
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    rng = np.random.default_rng(seed)
    val_idx, train_idx = [], []
    for c in np.unique(y):                         # stratified split
        idx = rng.permutation(np.flatnonzero(y == c))
        k = max(1, int(round(len(idx) * val_fraction)))
        val_idx.extend(idx[:k]); train_idx.extend(idx[k:])
    train_idx = np.sort(np.array(train_idx)); val_idx = np.sort(np.array(val_idx))
    Xt = torch.from_numpy(X)
    if image:
        Xt = Xt.view(-1, 1, 8, 8)
    yt = torch.from_numpy(y.astype(np.int64))
    return (TensorDataset(Xt[train_idx], yt[train_idx]), TensorDataset(Xt[val_idx], yt[val_idx]))


@torch.no_grad()
def accuracy(model: torch.nn.Module, dataset: TensorDataset, batch_size: int = 512,
             device: str | torch.device = "cpu") -> float:
    """Top-1 accuracy of ``model`` on ``dataset`` (eval mode, restored afterwards)."""
    was_training = model.training
    model.eval()
    correct = 0
    X, y = dataset.tensors
    for i in range(0, len(y), batch_size):
        out = model(X[i:i + batch_size].to(device))
        correct += int((out.argmax(1).cpu() == y[i:i + batch_size]).sum())
    model.train(was_training)
    return correct / max(1, len(y))
