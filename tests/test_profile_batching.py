"""The profiler batches samples exactly as training does (:func:`jabasray.engine.loader.gather_rows`:
a TensorDataset indexed directly, anything else through the job's ``collate_fn``, else torch's
``default_collate``), so a ``dataset_fn`` of dict samples with a ``step_fn`` and no ``collate_fn``
profiles; samples that ``default_collate`` cannot batch are one ValueError line naming the hook,
raised by the probe before any actor starts. No Ray."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from actors_helpers import optimizer_fn
from jabasray.actors.hooks import JobHooks, probe_job, run_probe
from jabasray.profiler.measure import _batch_fn, profile_model


def dict_samples(n: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(1, 8, 8, generator=g), "y": torch.tensor(i % 10)} for i in range(n)]


class DictRows:
    """A map-style dataset of dict samples (what a dataset_fn returns)."""

    def __init__(self, n: int = 24) -> None:
        self.rows = dict_samples(n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def dict_step(model, batch):
    assert isinstance(batch, dict) and set(batch) == {"x", "y"}
    return F.cross_entropy(model(batch["x"]), batch["y"])


def token_step(model, batch):
    """step_fn over token batches: the first 64 (zero-padded) tokens as features."""
    x = F.pad(batch["tokens"].float(), (0, 64))[:, :64]
    return F.cross_entropy(model(x), batch["y"])


def assert_same_batch(got, want) -> None:
    """Equal structure, types, dtypes, shapes and values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for k in want:
            assert_same_batch(got[k], want[k])
    else:
        assert isinstance(got, (list, tuple)) and len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_batch(a, b)


def cycled(rows: list, n: int) -> list:
    return [rows[i % len(rows)] for i in range(n)]


# --------------------------------------------------------------------------- (a) dict samples
@pytest.mark.parametrize("n", [1, 5, 24, 50])    # 50 > len: the batch cycles through the rows
def test_dict_samples_batch_as_default_collate(n):
    ds = DictRows(24)
    got = _batch_fn(ds)(n)
    want = default_collate(cycled(ds.rows, n))
    assert_same_batch(got, want)
    assert got["x"].shape == (n, 1, 8, 8) and got["y"].shape == (n,)


def test_dict_samples_profile_without_collate_fn():
    """The reported bug: dict samples + step_fn + no collate_fn profiled through the probe's rows."""
    report = probe_job(tiny_model, optimizer_fn, None, JobHooks(dataset_fn=DictRows, step_fn=dict_step),
                       want_profile_rows=True)
    assert report.error is None and isinstance(report.profile_rows, list)
    assert_same_batch(_batch_fn(report.profile_rows)(6), default_collate(cycled(report.profile_rows, 6)))
    prof = profile_model(tiny_model, report.profile_rows, step_fn=dict_step, min_local_batch=2,
                         max_local_batch=4, max_num_vsw=2, warmup=0, repeats=1, allreduce=False)
    assert [b.local_batch for b in prof.batches] == [2, 4]
    assert all(b.compute_time_1 > 0 and 0 <= b.zeta <= 1 for b in prof.batches)


# --------------------------------------------------------------------------- (b) (x, y) pairs
@pytest.mark.parametrize("target", [int, torch.tensor])
def test_pairs_batch_as_before(target):
    g = torch.Generator().manual_seed(1)
    rows = [(torch.randn(3, 4, generator=g), target(i % 7)) for i in range(10)]
    for n in (1, 4, 13):
        items = cycled(rows, n)
        reference = (torch.stack([x for x, _ in items]), torch.as_tensor([y for _, y in items]))
        x, y = _batch_fn(rows)(n)
        assert_same_batch((x, y), reference)


class CountingTensorDataset(TensorDataset):
    def __init__(self, *tensors):
        super().__init__(*tensors)
        self.reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


def test_tensor_dataset_is_indexed_directly():
    """As training's in-memory batches (gather_rows): direct tensor indexing, a tuple, no
    per-sample reads."""
    x, y, w = torch.randn(6, 5), torch.arange(6), torch.rand(6)
    ds = CountingTensorDataset(x, y, w)            # three tensors work too
    idx = torch.arange(9) % 6
    got = _batch_fn(ds)(9)
    assert isinstance(got, tuple)
    assert_same_batch(got, (x[idx], y[idx], w[idx]))
    assert ds.reads == 0


def test_a_collate_fn_batches_a_tensor_dataset_as_a_dataloader_does():
    """With a collate_fn, a TensorDataset's samples go through it, as in a DataLoader with that
    collate_fn (training's DataLoader path and its in-memory path alike)."""
    x, y = torch.randn(6, 5), torch.arange(6)
    ds = TensorDataset(x, y)
    idx = torch.arange(9) % 6
    got = _batch_fn(ds, lambda rows: {"x": torch.stack([r[0] for r in rows]),
                                      "y": torch.stack([r[1] for r in rows])})(9)
    assert_same_batch(got, {"x": x[idx], "y": y[idx]})


def test_callable_data_is_used_as_is():
    fn = lambda n: (torch.zeros(n, 2), torch.zeros(n, dtype=torch.long))   # noqa: E731
    assert _batch_fn(fn) is fn
    with pytest.raises(ValueError, match="^data must be a map-style dataset"):
        _batch_fn(object())


# --------------------------------------------------------------------------- (c) cannot be batched
class Opaque:
    pass


def ragged_rows(n: int = 12, ragged_from: int = 0) -> list[dict]:
    """Token sequences whose lengths differ from sample ``ragged_from`` on."""
    return [{"tokens": torch.arange(3 + (i if i >= ragged_from else 0)), "y": torch.tensor(i % 2)}
            for i in range(n)]


class RaggedRows:
    def __init__(self, ragged_from: int = 0) -> None:
        self.rows = ragged_rows(70, ragged_from)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class OpaqueRows:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return Opaque()


def _one_line(msg: str, hook: str) -> None:
    assert "\n" not in msg
    assert msg.startswith(f"{hook}: samples cannot be batched by torch's default_collate (")
    assert msg.endswith("); pass collate_fn=... (a list of samples -> one batch)")


@pytest.mark.parametrize("dataset_fn", [RaggedRows, OpaqueRows])
def test_unbatchable_dataset_fn_is_one_line_naming_the_hook(dataset_fn):
    report = probe_job(tiny_model, optimizer_fn, None, JobHooks(dataset_fn=dataset_fn, step_fn=dict_step),
                       want_profile_rows=True)
    _one_line(report.error, "dataset_fn")
    assert report.hook_error is None


def test_samples_unbatchable_beyond_the_first_two_are_caught_with_the_profile_rows():
    """The step checks batch 2 and 8 samples (the per-sample-mean check); the profiler's rows
    (64) are batched by the probe too."""
    ok = probe_job(tiny_model, optimizer_fn, None, JobHooks(dataset_fn=lambda: RaggedRows(9),
                                                            step_fn=token_step),
                   want_profile_rows=False)
    assert ok.error is None                        # the first eight samples batch
    early = probe_job(tiny_model, optimizer_fn, None, JobHooks(dataset_fn=lambda: RaggedRows(5),
                                                               step_fn=token_step))
    _one_line(early.error, "dataset_fn")           # sample 5 is among the check's eight
    bad = probe_job(tiny_model, optimizer_fn, None, JobHooks(dataset_fn=lambda: RaggedRows(9),
                                                             step_fn=token_step),
                    want_profile_rows=True)
    _one_line(bad.error, "dataset_fn")
    assert "stack expects each tensor to be equal size" in bad.error


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray, or a Ray task, fails the test (another test may have Ray up already)."""
    import ray

    from jabasray.actors import trainer

    def refuse(*a, **k):
        raise AssertionError("Ray was used before the check")
    for target, name in ((ray, "init"), (ray, "remote"), (trainer, "ensure_ray")):
        monkeypatch.setattr(target, name, refuse)


def test_unbatchable_in_memory_dataset_raises_before_ray(no_ray):
    with pytest.raises(ValueError) as raised:
        run_probe(tiny_model, optimizer_fn, None, JobHooks(step_fn=dict_step), dataset=ragged_rows())
    _one_line(str(raised.value), "dataset")
    with pytest.raises(ValueError) as raised:      # the validation set is named as such
        run_probe(tiny_model, optimizer_fn, None, JobHooks(step_fn=dict_step), dataset=dict_samples(),
                  val_dataset=[Opaque(), Opaque()])
    _one_line(str(raised.value), "val_dataset")


def test_unbatchable_dataset_through_the_trainer_before_ray(tmp_path, no_ray):
    from jabasray import ClusterSpec, JobConfig, RunConfig
    from jabasray.actors import JabasTrainer
    from jabasray.types import NodeSpec

    trainer = JabasTrainer(tiny_model, ragged_rows(64), optimizer_fn, step_fn=dict_step,
                           job_config=JobConfig(epochs=1, initial_global_batch=16, min_global_batch=8,
                                                max_global_batch=32, min_local_batch=4, max_local_batch=8),
                           cluster=ClusterSpec(nodes=[NodeSpec("n0", "fast", 1, speed=1.0)]),
                           run_config=RunConfig(storage_path=str(tmp_path), name="ragged"), verbose=0)
    with pytest.raises(ValueError) as raised:
        trainer.preflight()
    _one_line(str(raised.value), "dataset")


def test_reading_errors_are_not_blamed_on_batching():
    class Broken:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise FileNotFoundError(f"/data/{i}.pt")

    report = probe_job(tiny_model, optimizer_fn, None, JobHooks(dataset_fn=Broken, step_fn=dict_step))
    assert report.error == "FileNotFoundError: /data/0.pt"


# --------------------------------------------------------------------------- (d) the job's collate_fn
def pad_collate(rows):
    """Pads ragged token sequences (what a user's collate_fn does)."""
    n = max(len(r["tokens"]) for r in rows)
    tokens = torch.stack([F.pad(r["tokens"], (0, n - len(r["tokens"]))) for r in rows])
    return {"tokens": tokens, "y": torch.stack([r["y"] for r in rows])}


class CountingCollate:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, rows):
        self.calls += 1
        return pad_collate(rows)


def test_the_jobs_collate_fn_batches_the_profile():
    rows = ragged_rows(12)
    collate = CountingCollate()
    got = _batch_fn(rows, collate)(17)
    assert collate.calls == 1
    assert_same_batch(got, pad_collate(cycled(rows, 17)))
    # the probe accepts samples default_collate cannot batch when collate_fn batches them
    report = probe_job(tiny_model, optimizer_fn, None,
                       JobHooks(dataset_fn=RaggedRows, collate_fn=pad_collate, step_fn=token_step),
                       want_profile_rows=True)
    assert report.error is None and isinstance(report.profile_rows, list)
