"""Shared pieces of the real-job tests: a dataset of small sample files on disk."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
from ray import cloudpickle


def write_sample_files(root: str | Path, n: int, features: int = 64, classes: int = 10,
                       seed: int = 0) -> Path:
    """``n`` files ``<root>/s<i>.npz`` holding ``x`` (float32, ``features``) and ``y`` (int);
    returns ``root``. The same rows as :func:`in_memory_copy`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    X, y = _rows(n, features, classes, seed)
    for i in range(n):
        np.savez(root / f"s{i:05d}.npz", x=X[i], y=y[i])
    return root


def _rows(n, features, classes, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    centers = np.random.default_rng(12345).normal(size=(classes, features)).astype(np.float32)
    X = (centers[y] + 0.8 * rng.normal(size=(n, features))).astype(np.float32)
    return X, y.astype(np.int64)


def in_memory_copy(n: int, features: int = 64, classes: int = 10, seed: int = 0):
    X, y = _rows(n, features, classes, seed)
    return torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y))


class FileDataset(torch.utils.data.Dataset):
    """Reads one ``.npz`` file per sample. ``forbidden_pid``: reading a sample in that process
    raises (proves the driver never loads one)."""

    def __init__(self, root: str | Path, forbidden_pid: int | None = None) -> None:
        self.files = sorted(str(p) for p in Path(root).glob("s*.npz"))
        self.forbidden_pid = forbidden_pid

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        if self.forbidden_pid is not None and os.getpid() == self.forbidden_pid:
            raise RuntimeError("a sample was read in the driver's process")
        with np.load(self.files[i]) as z:
            return torch.from_numpy(z["x"]), int(z["y"])


class IndexedFileDataset(FileDataset):
    """Samples as dicts that also carry their index (tests that log what was served)."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return {"x": x, "y": y, "index": i}


def cosine_scheduler(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)


cloudpickle.register_pickle_by_value(sys.modules[__name__])
