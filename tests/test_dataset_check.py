"""``dataset_fn`` builds the training set on every GPU actor; each actor checks that it built
the dataset the probe saw (length, first and last sample), so different files on different
nodes cannot silently duplicate or skip samples. Pure checks first, then one run on the session
Ray instance whose dataset changes between the probe and the actors: one line naming the node."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.hooks import check_same_dataset, dataset_fingerprint, sample_digest
from jabasray.errors import DatasetMismatch


def _ds(n: int = 10, shift: float = 0.0) -> TensorDataset:
    X = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + shift
    return TensorDataset(X, torch.arange(n) % 2)


def test_fingerprint_is_the_same_for_equal_data_built_apart():
    a, b = _ds(), _ds()
    assert a is not b and dataset_fingerprint(a) == dataset_fingerprint(b)
    assert check_same_dataset(b, dataset_fingerprint(a)) is None
    assert check_same_dataset(b, None) is None          # nothing expected: no check


@pytest.mark.parametrize("other, what", [
    (_ds(11), "(11 samples, the probe's 10)"),
    (TensorDataset(torch.flip(_ds().tensors[0], [0]), torch.flip(_ds().tensors[1], [0])),
     "(its first and last samples differ from the probe's)"),
    (TensorDataset(torch.cat([_ds().tensors[0][:-1], torch.zeros(1, 3)]), _ds().tensors[1]),
     "(its last sample differs from the probe's)"),
])
def test_length_order_and_content_differences_are_named(other, what):
    msg = check_same_dataset(other, dataset_fingerprint(_ds()))
    assert msg.startswith("dataset_fn built a different dataset on node ") and what in msg
    assert msg.endswith("every GPU actor must see the same dataset: the same files on every "
                        "node (a shared or cloud path) in the same order") and "\n" not in msg


def test_sample_digest_covers_tensors_arrays_images_and_plain_values():
    from PIL import Image

    t = torch.ones(2, 2)
    assert sample_digest((t, 1)) == sample_digest((torch.ones(2, 2), 1))
    assert sample_digest((t, 1)) != sample_digest((t, 2))
    assert sample_digest(t) != sample_digest(t.double())            # dtype counts
    assert sample_digest(t) != sample_digest(t.reshape(4))          # shape counts
    assert sample_digest(torch.ones(3, dtype=torch.bfloat16)) != sample_digest(torch.zeros(3, dtype=torch.bfloat16))
    img = np.zeros((4, 4, 3), dtype=np.uint8)
    other = img.copy()
    other[0, 0, 0] = 1
    assert sample_digest(Image.fromarray(img)) == sample_digest(Image.fromarray(img.copy()))
    assert sample_digest(Image.fromarray(img)) != sample_digest(Image.fromarray(other))
    assert sample_digest({"x": t, "y": "cat"}) != sample_digest({"x": t, "y": "dog"})


def _growing_dataset_fn(counter: str):
    """Each call builds one more sample than the call before (files being added while the job
    starts): the probe and the actors see different datasets."""
    def dataset_fn():
        with open(counter) as fh:
            n = int(fh.read())
        with open(counter, "w") as fh:
            fh.write(str(n + 1))
        ds, _ = tiny_data(n)
        return ds
    return dataset_fn


@pytest.mark.ray
def test_an_actor_whose_dataset_differs_from_the_probes_stops_the_run_in_one_line(ray_session, tmp_path):
    from jabasray.actors.driver import DriverOptions
    from jabasray.actors.trainer import JabasTrainer
    from jabasray.config import RunConfig
    from jabasray.types import ClusterSpec, NodeSpec
    from test_trainer import job

    counter = tmp_path / "n"
    counter.write_text("100")
    tr = JabasTrainer(model_fn, None, optimizer_fn, loss_fn, job(1),
                      # one GPU: one actor building another dataset proves the check, and each
                      # GPU actor is a Ray worker importing torch
                      cluster=ClusterSpec(nodes=[NodeSpec("n0", "fast", 1, speed=1.0)]),
                      run_config=RunConfig(str(tmp_path), "r"), perf_model=perf_model(),
                      options=DriverOptions(driver="local"),
                      dataset_fn=_growing_dataset_fn(str(counter)))
    with pytest.raises(DatasetMismatch) as e:
        tr.fit()
    msg = str(e.value)
    node = ray_session.util.get_node_ip_address()
    assert msg.startswith(f"dataset_fn built a different dataset on node {node} (") and "\n" not in msg
    assert "samples, the probe's 100)" in msg
    assert int(counter.read_text()) >= 101        # the probe and the actor built it
