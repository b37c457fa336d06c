"""Datasets that ship with a package: scikit-learn's bundled digits (1797 8x8 images), and a
generated CIFAR-sized image dataset written to disk as PNG files (:func:`write_image_files`,
read back by :class:`ImageFiles`) for jobs, examples and benchmarks that read files."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

import math
from pathlib import Path

from .validation import check_float, check_int


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(X, y)``: float64 pixels 0..16 of shape (1797, 64) and int64
    labels, equal to ``sklearn.datasets.load_digits(return_X_y=True)``.

    Read from the CSV that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, the
    file ``load_digits`` reads) without importing scikit-learn: that import (with SciPy) costs
    about 2 s of CPU, paid by every process that loads the data -- each Tune trial, packed-trial
    coordinator and job driver. Where the file is not found (another layout), the call
    falls back to ``load_digits``."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")     # locates the package, does not import it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    return X, y.astype(np.int64)


def load_digits_split(val_fraction: float = 0.2, seed: int = 0, image: bool = True
                      ) -> tuple[TensorDataset, TensorDataset]:
    """Digits as ``(train, val)`` TensorDatasets; inputs scaled to [0, 1].

    ``image=True`` gives inputs of shape (N, 1, 8, 8), else (N, 64). The split is stratified
    by a fixed permutation of ``seed`` so every process builds the same split.
    """
    check_float("val_fraction", val_fraction, min_value=0.0, max_value=1.0, min_exclusive=True,
                max_exclusive=True)
    X, y = digits_arrays()
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


MEAN, STD = 0.5, 0.25


def generated_images(n: int, seed: int = 0):
    """``n`` generated 32x32 RGB images of 10 classes (colour and stripe pattern per class,
    Gaussian noise), deterministic in ``seed``: yields ``(uint8 array [32, 32, 3], label)``."""
    check_int("n", n, min_value=1)
    rng = np.random.default_rng(seed)
    colours = np.random.default_rng(1234).uniform(40, 215, size=(10, 3))
    yy, xx = np.mgrid[0:32, 0:32]
    for _ in range(n):
        c = int(rng.integers(10))
        angle, freq = c * math.pi / 10, 2 + c % 3
        stripes = np.sin(freq * 2 * math.pi * (xx * math.cos(angle) + yy * math.sin(angle)) / 32)
        img = colours[c][None, None, :] + 30 * stripes[..., None] + rng.normal(0, 30, (32, 32, 3))
        yield np.clip(img, 0, 255).astype(np.uint8), c


def image_tensor(pixels: np.ndarray) -> torch.Tensor:
    """uint8 HWC pixels -> the normalised float32 CHW tensor every reader of these images uses."""
    x = torch.from_numpy(np.asarray(pixels, dtype=np.float32) / 255.0)
    return (x.permute(*range(x.dim() - 3), -1, -3, -2) - MEAN) / STD


def write_image_files(root: str | Path, n: int, seed: int = 0) -> Path:
    """The :func:`generated_images` of ``seed`` as ``n`` PNG files ``<root>/<i>_c<label>.png``;
    a folder that already holds ``n`` PNG files is kept. Returns ``root``."""
    from PIL import Image

    check_int("n", n, min_value=1)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    if len(list(root.glob("*.png"))) == n:
        return root
    for i, (img, c) in enumerate(generated_images(n, seed)):
        Image.fromarray(img).save(root / f"{i:06d}_c{c}.png")
    return root


def cifar_sized_split(n_train: int = 5000, n_val: int = 1000, seed: int = 0
                      ) -> tuple[TensorDataset, TensorDataset]:
    """The generated images in memory as ``(train, val)`` TensorDatasets of float32
    ``(N, 3, 32, 32)`` inputs (normalised as :class:`ImageFiles` reads them) and int64 labels;
    the validation images come from ``seed + 1``."""
    def tensors(n: int, s: int) -> TensorDataset:
        imgs, labels = zip(*generated_images(n, s))
        return TensorDataset(image_tensor(np.stack(imgs)), torch.tensor(labels, dtype=torch.int64))
    check_int("n_val", n_val, min_value=1)
    return tensors(n_train, seed), tensors(n_val, seed + 1)


class ImageFiles(torch.utils.data.Dataset):
    """One PNG per sample; the label is in the file name. Opening the folder only lists it."""

    def __init__(self, root: str | Path) -> None:
        self.files = sorted(Path(root).glob("*.png"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image
        path = self.files[i]
        with Image.open(path) as im:
            x = image_tensor(np.asarray(im.convert("RGB")))
        return x, int(path.stem.split("_c")[1])
