"""The CIFAR-sized workloads of the packed-trials benchmark: their data are the generated images
every other reader sees, and their members (a CIFAR-sized MLP, a small CNN) pack -- trained in a
pack, each member trains exactly as it would alone on the same shared-stream batches."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import TensorDataset

from jabasray.data import ImageFiles, cifar_sized_split, write_image_files
from jabasray.tuner.cifar_sized import cifar_mlp_spec, small_cnn_spec
from jabasray.tuner.pack_runner import PackRunner
from tuner_helpers import STREAM, Alone

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

A = {"batch_size": 20, "optimizer": "adam", "lr": 1e-3, "activation": "relu"}
B = {"batch_size": 40, "optimizer": "momentum", "lr": 1e-2, "activation": "tanh"}
C = {"batch_size": 30, "optimizer": "adagrad", "lr": 1e-2, "activation": "relu"}
D = {"batch_size": 10, "optimizer": "adam", "lr": 3e-3, "activation": "relu"}
MEMBERS = {"a": A, "b": B, "c": C, "d": D}


def test_in_memory_images_equal_the_files_every_reader_sees(tmp_path):
    train, val = cifar_sized_split(12, 5, seed=3)
    for ds, root in ((train, write_image_files(tmp_path / "t", 12, seed=3)),
                     (val, write_image_files(tmp_path / "v", 5, seed=4))):
        files = ImageFiles(root)
        assert len(files) == len(ds)
        for i in range(len(ds)):
            x, y = files[i]
            assert torch.equal(x, ds.tensors[0][i]) and y == int(ds.tensors[1][i])
    assert train.tensors[0].shape == (12, 3, 32, 32) and train.tensors[0].dtype == torch.float32
    assert train.tensors[1].dtype == torch.int64
    with pytest.raises(ValueError, match="^n_val"):
        cifar_sized_split(4, 0)


def small_images_float64():
    """120 training and 40 validation images in float64 (the float64 models of the fixture)."""
    return tuple(TensorDataset(ds.tensors[0].double(), ds.tensors[1])
                 for ds in cifar_sized_split(120, 40, seed=0))


@pytest.mark.parametrize("make_spec", [cifar_mlp_spec, small_cnn_spec], ids=["cifar_mlp", "small_cnn"])
def test_cifar_sized_members_pack_and_train_as_alone(make_spec):
    spec = dataclasses.replace(make_spec(steps_per_unit=2), data_fn=small_images_float64)
    run = PackRunner(spec, STREAM)
    refs = {k: Alone(c, spec) for k, c in MEMBERS.items()}
    for k, c in MEMBERS.items():
        run.load(k, c)
    for _ in range(2):
        pos = run.position
        rows = run.unit(list(MEMBERS))
        for k, ref in refs.items():
            loss, metric = ref.unit(pos)
            assert rows[k]["train_loss"] == pytest.approx(loss, rel=1e-10)
            assert rows[k]["accuracy"] == pytest.approx(metric, abs=1e-9)
            assert rows[k]["pack_size"] == 4
    # the four members are ONE batched group (vmap over stacked parameters), none run by its
    # own module
    assert [(len(ids), batched) for ids, batched, _ in run.pack.groups()] == [(4, True)]
