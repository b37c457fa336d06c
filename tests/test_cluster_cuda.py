"""Profiling on a real GPU through Ray (``@pytest.mark.cuda``: skipped without one).

Proves on a machine with a GPU: the GPU type is profiled in a Ray task holding one GPU (the
task's assigned resources), while this process - the driver - never initialises CUDA; the
profile's type is the one Ray's detection gives the node, and ``jabasray profile``'s default
name for the device (``gpu_type_name``) is the same; a driver with the node's devices shared
trains one epoch with NCCL and serves every sample once.

    python -m pytest -q -m cuda tests/test_cluster_cuda.py
"""
from __future__ import annotations

import sys

import pytest
import torch
from ray import cloudpickle

from actors_helpers import assert_each_sample_once_per_epoch, loss_fn, model_fn, optimizer_fn, tiny_data

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def ray_gpu(without_session_ray):
    ray = without_session_ray
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_profiled_in_a_task_holding_the_gpu_and_named_as_ray_detects_it(ray_gpu, tmp_path, monkeypatch):
    from jabasray.actors.placement import ray_cluster_spec
    from jabasray.actors.profiling import profile_in_tasks
    from jabasray.config import JobConfig
    from jabasray.profiler.measure import gpu_type_name

    ray = ray_gpu
    spec = ray_cluster_spec()
    (gpu_type,) = spec.gpu_types
    ds, _ = tiny_data(240)
    notes: list[str] = []
    # the driver never touches the GPU: every CUDA call of this process (a tensor on the device,
    # a device query) goes through torch.cuda._lazy_init, also where an earlier test of the same
    # process has initialised CUDA already (then is_initialized() would say nothing)
    touched: list[int] = []
    real_init = torch.cuda._lazy_init
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "_lazy_init", lambda: (touched.append(1), real_init())[1])
        profiles = profile_in_tasks(model_fn, ds, spec, loss_fn=loss_fn, optimizer_fn=optimizer_fn,
                                    device="cuda", emulate=False, min_local_batch=4,
                                    weight_sync=JobConfig().weight_sync, bucket_cap_mb=25.0,
                                    cache_dir=tmp_path / "prof", notes=notes)
    assert touched == []
    assert list(profiles) == [gpu_type] and profiles[gpu_type].device == "cuda"
    assert len(notes) == 1 and "'GPU': 1.0" in notes[0]

    @ray.remote(num_gpus=1)
    def device_name() -> str:
        return torch.cuda.get_device_name(0)
    assert gpu_type_name(ray.get(device_name.remote())) == gpu_type


def test_shared_node_devices_train_with_nccl(ray_gpu, tmp_path):
    from jabasray.actors.driver import DriverOptions, JabasDriver
    from jabasray.actors.placement import ray_cluster_spec
    from jabasray.config import JobConfig
    from actors_helpers import perf_model

    spec = ray_cluster_spec()
    if spec.nodes[0].num_gpus < 2:
        pytest.skip("needs 2 GPUs on the node (one NCCL pair)")
    ds, val = tiny_data(240)
    job = JobConfig(epochs=1, initial_global_batch=32, min_global_batch=16, max_global_batch=64,
                    min_local_batch=4, adapt_interval=2, autoscale=False, seed=1)
    t = spec.gpu_types[0]
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, spec, tmp_path / "run",
                      val_dataset=val, perf_model=perf_model({t: 1.0}),
                      options=DriverOptions(device="cuda", share_node_devices=True,
                                            record_samples=True))
    hist = drv.run()
    assert_each_sample_once_per_epoch(hist, 240)


cloudpickle.register_pickle_by_value(sys.modules[__name__])
