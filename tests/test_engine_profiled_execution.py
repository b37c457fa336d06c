"""The profiler measures the engine as training runs it: batched VSWs over adjacent
micro-batches split from one batch (what the loader hands the engine), or per VSW when the
job forces it (a separate cache entry)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from jabasray.engine import IIDPWorker
from jabasray.profiler import measure
from jabasray.profiler.measure import profile_model


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 12, generator=g), torch.randint(0, 3, (64,), generator=g))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("execution", ["auto", "threads"])
def test_profiled_steps_run_as_training_runs_them(monkeypatch, tmp_path, execution):
    seen: list[tuple[int, bool, bool]] = []     # (n_vsw, batched, micro-batches adjacent & distinct)
    real = IIDPWorker.train_step

    def spy(self, micro_batches, *a, **kw):
        st = real(self, micro_batches, *a, **kw)
        xs = [x for x, _ in micro_batches]
        step = xs[0].shape[0] * xs[0].shape[1] * xs[0].element_size()
        adjacent = all(b.data_ptr() - a.data_ptr() == step for a, b in zip(xs, xs[1:]))
        seen.append((self.num_vsw, st.batched, adjacent))
        return st
    monkeypatch.setattr(IIDPWorker, "train_step", spy)
    kw = dict(min_local_batch=4, max_local_batch=8, max_num_vsw=3, warmup=0, repeats=1,
              allreduce=False, cache_dir=tmp_path, gpu_type="cpu-test", vsw_execution=execution)
    prof = profile_model(_model(), _data(), **kw)
    assert [b.local_batch for b in prof.batches] == [4, 8]
    multi = [s for s in seen if s[0] > 1]
    assert multi and all(adj for _, _, adj in seen)
    assert all(batched == (execution == "auto") for _, batched, _ in seen)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    other = "threads" if execution == "auto" else "auto"     # the other execution: its own entry
    profile_model(_model(), _data(), **{**kw, "vsw_execution": other})
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_settings_keep_old_keys_for_auto():
    a = measure.measurement_settings("cpu", 8, None, 4, None, 25.0, "auto", 1, 3, "trimmed")
    b = measure.measurement_settings("cpu", 8, None, 4, None, 25.0, "auto", 1, 3, "trimmed",
                                     vsw_execution="auto")
    c = measure.measurement_settings("cpu", 8, None, 4, None, 25.0, "auto", 1, 3, "trimmed",
                                     vsw_execution="threads")
    assert a == b and c == {**a, "vsw_execution": "threads"}
