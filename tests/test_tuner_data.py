"""TrainingSpec over any map-style Dataset: a dataset that is not a TensorDataset (samples
built by ``__getitem__``) streams the same batches and trains members exactly as the
TensorDataset holding the same data."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from jabasray.tuner.digits import digits_data, digits_mlp_spec
from jabasray.tuner.pack_runner import PackRunner
from jabasray.tuner.training import SharedStream, cached_data
from tuner_helpers import STREAM

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]


class Samples(Dataset):
    """Not a TensorDataset: lists of per-sample arrays, a (float64 tensor, int) per index."""

    def __init__(self, ds: TensorDataset) -> None:
        self.rows = [r.numpy().copy() for r in ds.tensors[0]]
        self.labels = [int(v) for v in ds.tensors[1]]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.rows[i]).double(), self.labels[i]


def tensor_data():
    return tuple(TensorDataset(ds.tensors[0].double(), ds.tensors[1]) for ds in digits_data())


def sample_data():
    return tuple(Samples(ds) for ds in tensor_data())


def test_stream_over_any_dataset_gives_the_same_batches():
    train = tensor_data()[0]
    a, b = SharedStream(train, STREAM, seed=3), SharedStream(Samples(train), STREAM, seed=3)
    for j in list(range(4)) + [a.steps_per_epoch - 1, a.steps_per_epoch, 3 * a.steps_per_epoch + 2]:
        for size in (None, 7):
            (xa, ya), (xb, yb) = a.batch(j, size), b.batch(j, size)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_members_train_the_same_on_a_non_tensor_dataset():
    spec_t = dataclasses.replace(digits_mlp_spec(steps_per_unit=3), data_fn=tensor_data)
    spec_s = dataclasses.replace(spec_t, data_fn=sample_data)
    cfgs = {"a": {"batch_size": 20, "optimizer": "adam", "lr": 1e-2, "activation": "relu"},
            "b": {"batch_size": 40, "optimizer": "momentum", "lr": 5e-2, "activation": "tanh"}}
    rows = []
    for spec in (spec_t, spec_s):
        run = PackRunner(spec, STREAM, data=spec.data_fn())
        for k, c in cfgs.items():
            run.load(k, c)
        rows.append([run.unit(["a", "b"]) for _ in range(3)])
    assert isinstance(cached_data(spec_s)[0], Samples)
    for ut, us in zip(*rows):
        for k in cfgs:
            assert us[k]["train_loss"] == pytest.approx(ut[k]["train_loss"], rel=1e-12)
            assert us[k]["accuracy"] == ut[k]["accuracy"]


class _Stream(IterableDataset):
    def __iter__(self):
        return iter([])


class _Singles(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, i):
        return torch.zeros(3)


def test_a_dataset_that_cannot_stream_is_a_one_line_value_error():
    with pytest.raises(ValueError, match="must be a map-style Dataset.*got _Stream"):
        SharedStream(_Stream(), 10)
    with pytest.raises(ValueError, match=r"\(inputs, target\) pairs"):
        SharedStream(_Singles(), 10).batch(0)
