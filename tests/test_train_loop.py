"""The user's own loop (``jabasray.train``) against the hooks API and plain SGD, in float64.

Proves: a ``train_loop_per_worker`` run by ``JabasTorchTrainer`` on two emulated GPUs of
different speeds, with B_G adapting, an epoch-wise LR scheduler and a GPU actor killed in
epoch 2 (the job re-placed on the GPU left, the loop entered again there and resumed at epoch 2
with its scheduler restored), serves the same samples in every interval, with the same LRs and
B_G trajectory, and ends every epoch with the same weights, optimizer and scheduler state as
the same job through the hooks API (model_fn, dataset_fn, step_fn, lr_scheduler_fn) under the
same fault; every sample is served once per epoch. With a checkpoint at every interval
boundary, a GPU actor killed mid-epoch resumes the loop at that checkpoint's sample, its
scheduler restored, and ends bit-identical to the uninterrupted loop run. (At a fixed B_G
every update equals one plain SGD step on the union of the micro-batches:
tests/test_train_loop_engine.py, no Ray.)
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from ray import cloudpickle

from jabasray.actors.checkpoint import list_checkpoints
from jabasray.actors.driver import DriverOptions
from jabasray.actors.trainer import JabasTrainer
from jabasray.config import CheckpointConfig, FailureConfig, JobConfig, RunConfig
from jabasray.types import ClusterSpec, NodeSpec
from jabasray.train import (JabasTorchTrainer, epochs, get_context, prepare_data_loader,
                            prepare_model, prepare_optimizer, report)

N = 160
CLUSTER = ClusterSpec(nodes=[NodeSpec("f", "fast", 1, speed=1.0), NodeSpec("s", "slow", 1, speed=0.5)])
ADAPTIVE = JobConfig(epochs=2, initial_global_batch=24, min_global_batch=16, max_global_batch=48,
                     min_local_batch=4, adapt_interval=2, alpha=0.25, gamma=0.9, autoscale=False,
                     lr_scaling="linear", seed=3)


def digits64():
    """The first N digits rows, float64 features."""
    from jabasray.data import load_digits_split
    X, y = load_digits_split(image=False)[0].tensors
    return torch.utils.data.TensorDataset(X[:N].double(), y[:N])


def net():
    from jabasray.models import MLP
    return MLP(64, (32,), 10).double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def step_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def loop(config):
    """Ray Train's shape: data, model, optimizer, scheduler, the epoch loop."""
    loader = prepare_data_loader(torch.utils.data.DataLoader(digits64(), batch_size=32, shuffle=True))
    model = prepare_model(net())
    optimizer = prepare_optimizer(sgd(model.parameters()))
    scheduler = halving(optimizer) if config["scheduler"] else None
    state = {"scheduler": scheduler} if scheduler is not None else {}
    for epoch in epochs(config["epochs"], model=model, optimizer=optimizer, **state):
        assert get_context().epoch == epoch
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            report({"one": 1.0, "rank": get_context().world_rank})
        if scheduler is not None:
            scheduler.step()


cloudpickle.register_pickle_by_value(sys.modules[__name__])   # Ray workers cannot import tests


def _options(**kw):
    return DriverOptions(driver="local", record_samples=True, evaluate=False, **kw)


def _run_config(root, name):
    return RunConfig(str(root), name, checkpoint_config=CheckpointConfig(num_to_keep=None))


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """The same adaptive job through the hooks API and through the loop, each with rank 1
    killed after the first interval of epoch 1 (the driver re-places the job on the GPU left
    and redoes epoch 1 from its checkpoint)."""
    from actors_helpers import KillOnce, perf_model
    root = tmp_path_factory.mktemp("train_loop")
    common = dict(job_config=ADAPTIVE, cluster=CLUSTER, perf_model=perf_model(),
                  options=_options(failure_grace_s=10), verbose=0)
    hooks = JabasTrainer(net, optimizer_fn=sgd, dataset_fn=digits64, step_fn=step_fn,
                         lr_scheduler_fn=halving, lr_scheduler_interval="epoch",
                         run_config=_run_config(root, "hooks"),
                         callbacks=[KillOnce(epoch=1, rank=1, interval=0)], **common).fit()
    own = JabasTorchTrainer(loop, train_loop_config={"epochs": 2, "scheduler": True},
                            run_config=_run_config(root, "loop"),
                            callbacks=[KillOnce(epoch=1, rank=1, interval=0)], **common).fit()
    return hooks, own


@pytest.mark.ray
def test_loop_equals_hooks_api_with_adaptive_batch_and_replacement(runs):
    """Same samples per interval (as sets and in order), same LRs and B_G trajectory (which
    moves), and after each epoch the same weights, momentum and scheduler state as the hooks
    API's checkpoint of that epoch - across the re-placement after the failure."""
    hooks, own = runs
    hi, oi = hooks.history.intervals, own.history.intervals
    assert [(r.epoch, r.cursor, r.global_batch) for r in oi] == [(r.epoch, r.cursor, r.global_batch) for r in hi]
    assert [r.served for r in oi] == [r.served for r in hi]
    assert len({r.global_batch for r in oi}) > 1                      # B_G moved
    assert [r.lr for r in oi] == pytest.approx([r.lr for r in hi], rel=1e-12)
    ch, co = list_checkpoints(hooks.storage), list_checkpoints(own.storage)
    assert [c.epochs_done for c in co] == [c.epochs_done for c in ch] == [0, 1, 2]
    for a, b in zip(ch, co):
        wa, wb = a.load_worker_state(), b.load_worker_state()
        for k in wa["model"]:
            torch.testing.assert_close(wb["model"][k], wa["model"][k], rtol=1e-10, atol=1e-12)
        for sa, sb in zip(wa["optimizer"]["state"].values(), wb["optimizer"]["state"].values()):
            torch.testing.assert_close(sb["momentum_buffer"], sa["momentum_buffer"], rtol=1e-10, atol=1e-12)
        if b.epochs_done:     # (the checkpoint before training precedes the loop's epochs())
            assert wb["loop"]["scheduler"] == wa["lr_scheduler"]
            assert wa["lr_scheduler"]["last_epoch"] == b.epochs_done
        assert wb["optimizer"]["param_groups"][0]["lr"] == wa["optimizer"]["param_groups"][0]["lr"]
    # report(): means over the reports of both ranks (rank 0 and 1 reported: strictly between)
    e0 = own.history.epochs[0].train_metrics
    assert e0["report/one"] == 1.0 and 0.0 < e0["report/rank"] < 1.0


@pytest.mark.ray
def test_a_gpu_actor_killed_mid_epoch_reenters_the_loop_and_serves_each_sample_once(runs):
    """Rank 1 killed after the first interval of epoch 1: one failure; epoch 1 is redone on the
    GPU left, where the loop is entered again and resumes epoch 2 with its scheduler restored
    from the checkpoint (a fresh one would end at last_epoch 1); every sample is served once in
    each epoch."""
    from actors_helpers import assert_each_sample_once_per_epoch
    _, own = runs
    fail = [m for m in own.history.events if "failure" in m]
    assert len(fail) == 1 and "restarting epoch 2" in fail[0]
    assert [e.epoch for e in own.history.epochs] == [0, 1]
    assert [e.allocation for e in own.history.epochs] == [{"f": 1, "s": 1}, {"f": 1}]
    assert_each_sample_once_per_epoch(own.history, N)
    state = list_checkpoints(own.storage)[-1].load_worker_state()
    assert state["loop"]["scheduler"]["last_epoch"] == 2
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.05 / 4)


@pytest.mark.ray
def test_loop_resumes_a_gpu_actor_failure_from_the_mid_epoch_checkpoint(ray_session, tmp_path):
    """CheckpointConfig(interval_minutes=0): a checkpoint at every interval boundary. Rank 1
    killed in epoch 2 after such a checkpoint and retried on the same GPUs (drop_gpu_after=-1):
    the loop is entered again and resumes at that checkpoint's sample, not at the epoch start
    (no interval redone), its scheduler restored from the mid-epoch checkpoint; the run ends
    with the weights and momentum (float64, bit for bit), scheduler state, B_G trajectory, LRs
    and interval positions of the uninterrupted loop run, each sample served once per epoch."""
    from actors_helpers import KillOnce, assert_each_sample_once_per_epoch, perf_model
    common = dict(train_loop_config={"epochs": 2, "scheduler": True}, job_config=ADAPTIVE,
                  cluster=CLUSTER, perf_model=perf_model(), options=_options(failure_grace_s=10),
                  verbose=0)
    ref = JabasTorchTrainer(loop, run_config=_run_config(tmp_path, "whole"), **common).fit()
    rc = RunConfig(str(tmp_path), "cut",
                   checkpoint_config=CheckpointConfig(num_to_keep=None, interval_minutes=0),
                   failure_config=FailureConfig(max_failures=1, drop_gpu_after=-1))
    got = JabasTorchTrainer(loop, run_config=rc, callbacks=[KillOnce(epoch=1, rank=1, interval=0)],
                            **common).fit()
    at = next(r.cursor for r in ref.history.intervals if (r.epoch, r.interval) == (1, 1))
    events = got.history.events
    failed = next(i for i, m in enumerate(events) if m.startswith("GPU actor failure: rank 1"))
    assert events[failed + 1] == (f"resumed within epoch 2 at sample {at} from "
                                  f"{got.storage / 'checkpoints' / 'mid_epoch'}"), events
    pos = [(r.epoch, r.interval, r.cursor) for r in got.history.intervals]
    assert pos == [(r.epoch, r.interval, r.cursor) for r in ref.history.intervals]   # none redone
    assert [e.allocation for e in got.history.epochs] == [{"f": 1, "s": 1}] * 2
    assert [e.trajectory for e in got.history.epochs] == [e.trajectory for e in ref.history.epochs]
    assert [r.lr for r in got.history.intervals] == [r.lr for r in ref.history.intervals]
    assert_each_sample_once_per_epoch(got.history, N)
    wa, wb = (r.run_checkpoint.load_worker_state() for r in (ref, got))
    for k in wa["model"]:
        assert wa["model"][k].dtype == torch.float64 and torch.equal(wb["model"][k], wa["model"][k]), k
    ma, mb = wa["optimizer"]["state"], wb["optimizer"]["state"]
    assert len(ma) == len(mb) > 0
    for sa, sb in zip(ma.values(), mb.values()):
        assert torch.equal(sb["momentum_buffer"], sa["momentum_buffer"])
    assert wb["optimizer"]["param_groups"] == wa["optimizer"]["param_groups"]
    assert wb["loop"]["scheduler"] == wa["loop"]["scheduler"]      # restored mid-epoch, stepped once
    assert wa["loop"]["scheduler"]["last_epoch"] == 2
