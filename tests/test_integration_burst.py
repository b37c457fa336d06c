"""Burst-parallel mode through the driver (``JobConfig(parallelism="burst")``) on the session Ray
instance: two emulated GPU actors train a tiny MLP with the planner's per-layer GPU counts.

Reference: plain single-process SGD over the same epoch permutations (B_G 16, the last
iteration of each epoch the 4-sample remainder).  The run is split in two: one epoch, then a
second driver resumes from the run's checkpoint (new actors) and trains two more epochs with
``force_replacement`` (epoch 2 re-places the actors: new actors, new process group); the weights
after all three must equal the reference, so resume and re-placement lose nothing and every
sample is trained once per epoch.
"""
from __future__ import annotations

import pytest
import torch

from actors_helpers import loss_fn, model_fn, optimizer_fn, tiny_data
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.config import JobConfig
from jabasray.engine.sampler import epoch_permutation
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.ray

BATCH, N = 16, 100


def reference(ds, job, epochs):
    torch.manual_seed(job.seed)
    model = model_fn()
    opt = optimizer_fn(list(model.parameters()))
    X, y = ds.tensors
    for epoch in range(epochs):
        perm = torch.as_tensor(epoch_permutation(job.seed, epoch, N))
        for cursor in range(0, N, BATCH):
            idx = perm[cursor:cursor + BATCH]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(X[idx]), y[idx]).backward()
            opt.step()
    return model.state_dict()


def test_burst_mode_trains_like_one_process_and_survives_resume_and_replacement(ray_session, host_measurements,
                                                                                tmp_path):
    ds, _ = tiny_data(N)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
    job = JobConfig(epochs=1, parallelism="burst", amp_limit=3.0, initial_global_batch=BATCH,
                    min_global_batch=BATCH, max_global_batch=BATCH, min_local_batch=4,
                    adapt_interval=3, adaptive=False, lr_scaling="none", lr=0.05, seed=3)
    run = tmp_path / "run"
    profiles = str(host_measurements(tmp_path / ".profiles"))   # the driver's default folder
    first = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job, cluster, run,
                        options=DriverOptions(evaluate=False, profile_cache_dir=profiles)).run()
    job2 = JobConfig(**{**job.to_dict(), "epochs": 3})
    drv = JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job2, cluster, run,
                      options=DriverOptions(evaluate=False, force_replacement=True,
                                            profile_cache_dir=profiles))
    hist = drv.run()
    assert any("resumed" in e for e in hist.events)
    assert hist.epochs[2].replaced and any("re-placing" in e for e in hist.events)

    names = None
    for rec in hist.intervals:
        b = rec.burst
        assert rec.plan is None and b is not None and rec.global_batch == BATCH
        names = names or set(b["gpu_counts"])
        assert set(b["gpu_counts"]) == names and set(b["gpu_counts"].values()) <= {1, 2}
        assert b["predicted_iteration_s"] > 0 and b["measured_iteration_s"] > 0
    assert len(first.intervals) == 3
    for epoch in (0, 1, 2):
        assert sum(r.samples for r in hist.intervals if r.epoch == epoch) == N   # each sample once
    got = drv.last_checkpoint.load_worker_state()["model"]
    ref = reference(ds, job, 3)
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-6, msg=key)
