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


def _actor_worker(model: nn.Module, job, device: str = "cpu") -> IIDPWorker:
    """The worker a GPU actor builds for ``job`` (the options that decide the execution)."""
    return IIDPWorker(model, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
                      torch.nn.functional.cross_entropy, device=device,
                      per_sample_loss=job.per_sample_loss, cuda_graphs=job.cuda_graphs)


def _expected_execution(w: IIDPWorker) -> str:
    if w.device.type == "cuda" and w.graph_fallback_reason() is None:
        return "graphed"
    return "batched" if w.batch_fallback_reason() is None else "per_vsw"


@pytest.mark.parametrize("per_sample_loss", [True, False])
def test_profiler_times_the_execution_the_job_worker_chooses(monkeypatch, tmp_path, per_sample_loss):
    """The profiler builds its worker with the job's engine options (job_engine_options), so
    every timed step runs the execution the job's own worker runs at that (B_L, n_vsw), and the
    profile records it."""
    from jabasray.config import JobConfig
    job = JobConfig(min_local_batch=4, per_sample_loss=per_sample_loss)
    options = measure.job_engine_options(job, num_devices=2, device="cpu")
    built: list[dict] = []
    seen: list[tuple[int, str]] = []           # (n_vsw, what the profiled step ran)
    real_init, real_step = IIDPWorker.__init__, IIDPWorker.train_step

    def init(self, *a, **kw):
        built.append(kw)
        real_init(self, *a, **kw)

    def step(self, micro_batches, *a, **kw):
        st = real_step(self, micro_batches, *a, **kw)
        seen.append((self.num_vsw, measure.step_execution(st)))
        return st
    monkeypatch.setattr(IIDPWorker, "__init__", init)
    monkeypatch.setattr(IIDPWorker, "train_step", step)
    prof = profile_model(_model(), _data(), min_local_batch=4, max_local_batch=8, max_num_vsw=3,
                         warmup=0, repeats=1, allreduce=False, cache_dir=tmp_path, gpu_type="cpu-test",
                         engine_options=options)
    monkeypatch.setattr(IIDPWorker, "__init__", real_init)
    monkeypatch.setattr(IIDPWorker, "train_step", real_step)
    assert built[0]["per_sample_loss"] is per_sample_loss and built[0]["cuda_graphs"] == "off"
    expected = {}
    for n in {n for n, _ in seen}:
        w = _actor_worker(_model(), job)
        w.configure(n, 0, 4)
        expected[n] = _expected_execution(w)
        w.close()
    assert seen and all(ran == expected[n] for n, ran in seen)
    assert expected[3] == ("batched" if per_sample_loss else "per_vsw")
    assert prof.execution == expected[3]
    assert _round_trips_execution(prof)


def _round_trips_execution(prof) -> bool:
    from jabasray.profiles import Profile
    return Profile.from_json(prof.to_json()).execution == prof.execution


def test_engine_options_enter_the_cache_key_only_when_they_change_the_step():
    from jabasray.config import JobConfig
    args = ("cpu", 8, None, 4, None, 25.0, "auto", 1, 3, "trimmed")
    base = measure.measurement_settings(*args)
    default = measure.job_engine_options(JobConfig(min_local_batch=8), 1, "cpu")
    assert default == {"per_sample_loss": True, "cuda_graphs": "off"}      # CPU: nothing captured
    assert measure.measurement_settings(*args, engine_options=default) == base
    off = measure.job_engine_options(JobConfig(min_local_batch=8, per_sample_loss=False), 4, "cpu")
    assert measure.measurement_settings(*args, engine_options=off) == {**base, "per_sample_loss": False}
    job = JobConfig(min_local_batch=8)                 # cuda_graphs="auto" by default
    assert measure.job_engine_options(job, 1, "cuda")["cuda_graphs"] == job.cuda_graphs == "auto"
    assert measure.job_engine_options(job, 2, "cuda")["cuda_graphs"] == "off"   # steps communicate
    with pytest.raises(ValueError, match="engine_options"):
        measure.measurement_settings(*args, engine_options={"precision": "bf16"})


@pytest.mark.cuda
def test_cuda_profile_of_a_single_device_job_times_graph_replays(monkeypatch, tmp_path):
    """On one CUDA device with cuda_graphs="auto" the job's steps replay a CUDA graph: the
    profiler warms up and captures before its timed steps, which are replays."""
    from jabasray.config import JobConfig
    job = JobConfig(min_local_batch=4)
    options = measure.job_engine_options(job, 1, "cuda")
    seen: list[tuple[int, str]] = []
    real = IIDPWorker.train_step

    def step(self, micro_batches, *a, **kw):
        st = real(self, micro_batches, *a, **kw)
        seen.append((self.num_vsw, measure.step_execution(st)))
        return st
    monkeypatch.setattr(IIDPWorker, "train_step", step)
    prof = profile_model(_model(), _data(), device="cuda", min_local_batch=4, max_local_batch=8,
                         max_num_vsw=2, warmup=0, repeats=2, allreduce=False, cache_dir=tmp_path,
                         engine_options=options)
    monkeypatch.setattr(IIDPWorker, "train_step", real)
    w = _actor_worker(_model().cuda(), job, "cuda")
    w.configure(2, 0, 4)
    assert _expected_execution(w) == "graphed" == prof.execution
    assert ("graphed" in {ran for _, ran in seen}) and all(b.compute_time_1 > 0 for b in prof.batches)


@pytest.mark.parametrize("device, gpus, graphs", [("cpu", 1, "off"), ("cuda", 1, "auto"), ("cuda", 2, "off")])
def test_job_perf_model_profiles_with_the_jobs_engine_options(monkeypatch, tmp_path, device, gpus, graphs):
    """The driver's profiling path hands the job's engine options to the profiler (graphs only
    for a job that can only run on one CUDA device)."""
    from jabasray.config import JobConfig
    from jabasray.profiler import cluster as pc
    from jabasray.types import ClusterSpec, NodeSpec
    seen = {}

    def fake_profile_model(*args, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")
    monkeypatch.setattr(measure, "profile_model", fake_profile_model)
    job = JobConfig(min_local_batch=4, per_sample_loss=False)
    cl = ClusterSpec(nodes=[NodeSpec("n0", "fast", gpus)])
    with pytest.raises(RuntimeError, match="stop here"):
        pc.job_perf_model(lambda: None, [(0, 0)], cl, job, loss_fn=None, optimizer_fn=None, device=device,
                          emulate=True, torch_threads=1, bucket_cap_mb=1.0, cache_dir=tmp_path)
    assert seen["engine_options"] == {"per_sample_loss": False, "cuda_graphs": graphs}
