"""A loop whose DataLoader has its own ``collate_fn`` (padded variable-length sequences as a
dict), without Ray, in float64.

Proves: the GPU actor of a ``JabasTorchTrainer`` job (the trainer's own hooks, not built by
hand) batches the loop's samples with the loop's collate - each rank's micro-batches collated
once, split, each round's joined for the loop - and ends an interval of 2 VSWs x 2
accumulation rounds with the same weights as the same job through the hooks API with that
``collate_fn`` and a ``step_fn``; the probe and the profiler's rows use the same collate (a
default_collate of these samples would fail: the sequences differ in length); a loader
without a collate_fn still batches with default_collate.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jabasray.actors.gpu_actor import GPUActor, IntervalRequest
from jabasray.actors.hooks import JobHooks, probe_job
from jabasray.actors.placement import Slot
from jabasray.actors.rendezvous import Rendezvous
from jabasray.config import JobConfig, RunConfig
from jabasray.train import (JabasTorchTrainer, epochs, prepare_data_loader, prepare_model,
                            prepare_optimizer)
from jabasray.train.actor import LoopGPUActor

pytestmark = pytest.mark.usefixtures("float64")

N = 48
JOB = JobConfig(epochs=1, seed=4)


class Sequences(torch.utils.data.Dataset):
    """Sample i: a (length_i, 4) sequence, length 1..5, and a class label."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(1, 6, (N,), generator=g).tolist()
        self.x = [torch.randn(n, 4, generator=g) for n in self.lengths]
        self.y = torch.randint(0, 3, (N,), generator=g).tolist()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def pad_collate(samples):
    """Pad to the longest sequence: {"x": (B, L, 4), "mask": (B, L), "y": (B,)}."""
    longest = max(len(x) for x, _ in samples)
    x = torch.zeros(len(samples), longest, 4)
    mask = torch.zeros(len(samples), longest)
    for i, (s, _) in enumerate(samples):
        x[i, :len(s)], mask[i, :len(s)] = s, 1.0
    return {"x": x, "mask": mask, "y": torch.tensor([y for _, y in samples])}


class PoolNet(torch.nn.Module):
    """Per-step tanh features, masked mean over time, a linear head (padding changes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x, mask):
        h = torch.tanh(self.inp(x)) * mask[..., None]
        return self.out(h.sum(1) / mask.sum(1, keepdim=True))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def dict_step(model, batch):
    return F.cross_entropy(model(batch["x"], batch["mask"]), batch["y"])


def loop(config):
    loader = prepare_data_loader(torch.utils.data.DataLoader(Sequences(), batch_size=8,
                                                             collate_fn=pad_collate))
    model = prepare_model(PoolNet())
    opt = prepare_optimizer(sgd(model.parameters()))
    for _ in epochs(1, model=model, optimizer=opt):
        for batch in loader:
            F.cross_entropy(model(batch["x"], batch["mask"]), batch["y"]).backward()
            opt.step()


def interval(actor, iterations=3):
    actor.setup(Rendezvous("127.0.0.1", 29500, 1))
    actor.configure(2, 1, 4)                        # 2 VSWs x 2 accumulation rounds of B_L = 4
    req = IntervalRequest(epoch=0, cursor=0, num_iterations=iterations, local_batch=4, layout=[4],
                          iteration=0, base_lr=None, base_batch=16, lr_scaling="none",
                          warmup_iterations=0, similarity=False)
    rep = actor.run_interval(req)
    assert rep.num_iterations == iterations and rep.samples == 16 * iterations
    return [p.detach().clone() for p in actor.worker.model.parameters()]


def test_a_loops_collate_fn_trains_as_the_hooks_apis_collate_fn(tmp_path):
    t = JabasTorchTrainer(loop, job_config=JOB, run_config=RunConfig(str(tmp_path), "x"))
    hooks, c = t.trainer.hooks, t.calls
    # the probe and the profiler's rows batch with the loop's collate (default_collate would fail)
    report = probe_job(c.model_fn, c.optimizer_fn, None, hooks, want_profile_rows=True)
    assert report.error is None and report.dataset_size == N
    assert isinstance(report.profile_rows, list) and len(report.profile_rows[0][0]) == Sequences().lengths[0]
    slot = Slot(rank=0, node="n0", gpu_type="fast", speed=1.0, group=0, pair=0)
    mine = LoopGPUActor(slot, 1, JOB, c.model_fn, c.optimizer_fn, None, None, "cpu", False,
                        hooks=hooks)
    got = interval(mine)
    mine.shutdown()
    ref_hooks = JobHooks(dataset_fn=Sequences, step_fn=dict_step, collate_fn=pad_collate)
    ref = GPUActor(slot, 1, JOB, PoolNet, sgd, None, None, "cpu", False, hooks=ref_hooks)
    want = interval(ref)
    ref.shutdown()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    torch.manual_seed(JOB.seed)
    assert any(not torch.equal(a, b) for a, b in zip(got, PoolNet().parameters()))   # it trained


def test_the_loop_collate_hook_is_default_collate_without_one():
    from jabasray.train.actor import LoopCallables

    ds = torch.utils.data.TensorDataset(torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 2]))

    def plain(config):
        prepare_data_loader(torch.utils.data.DataLoader(ds, batch_size=2))

    c = LoopCallables(plain, None, 1)
    assert c.loop_collate() is torch.utils.data.default_collate
    x, y = c.collate_fn([ds[0], ds[2]])
    assert torch.equal(x, ds.tensors[0][[0, 2]]) and y.tolist() == [0, 2]
    from jabasray.train import bridge
    bridge.active().abandon()
