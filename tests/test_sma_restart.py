"""When SMA restarts under adaptive batching (JobConfig.sma_restart, engine.sma.sma_restart_due).

An in-process GPUActor (no Ray, one rank, 2 learners) runs SMA while B_G moves (B_L 4 -> 8,
so gamma moves by the sqrt rule) and while an epoch-stepped scheduler halves the user's LR.
Its learners' replicas, central model z and momentum history are compared with a reference
computation of Crossbow Alg. 1 (engine.sma.sma_iteration_ on flat tensors, gradients taken at
the reference replicas on the micro-batches the actor reports it served), restarting exactly
where the rule says; the reply's ``sma_restarts`` lists those iterations.
"""
from __future__ import annotations

import copy

import pytest
import torch

from actors_helpers import loss_fn, model_fn, optimizer_fn, tiny_data
from jabasray.actors.gpu_actor import GPUActor, IntervalRequest
from jabasray.actors.hooks import JobHooks
from jabasray.actors.placement import Slot
from jabasray.actors.rendezvous import Rendezvous
from jabasray.config import JobConfig
from jabasray.engine.sma import sma_iteration_, sma_restart_due

LEARNERS = 2
BASE_BATCH = 8          # B_G of B_L = 4 with 2 learners
USER_LR = 0.05          # actors_helpers.optimizer_fn
MOMENTUM = 0.9          # SMAWorker's default mu


class Reference:
    """Alg. 1 over 2 learners on flat tensors (alpha = 1/k), same initial model as the actor."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = model_fn()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.z = torch.cat([p.detach().reshape(-1) for p in self.params]).clone()
        self.v = torch.zeros_like(self.z)
        self.replicas = [self.z.clone() for _ in range(LEARNERS)]

    def grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m = copy.deepcopy(self.model)
        ps = [p for p in m.parameters() if p.requires_grad]
        off = 0
        with torch.no_grad():
            for p in ps:
                p.copy_(w[off:off + p.numel()].view_as(p))
                off += p.numel()
        loss = loss_fn(m(x), y)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, ps)])

    def restart(self) -> None:
        self.replicas = [self.z.clone() for _ in range(LEARNERS)]
        self.v.zero_()

    def iteration(self, dataset, indices, local_batch: int, lr: float) -> None:
        X, y = dataset.tensors
        idx = torch.as_tensor(indices)
        grads = [self.grad(w, X[idx[j * local_batch:(j + 1) * local_batch]],
                           y[idx[j * local_batch:(j + 1) * local_batch]])
                 for j, w in enumerate(self.replicas)]
        sma_iteration_(self.replicas, grads, self.z, self.v, lr, 1.0 / LEARNERS, MOMENTUM)


def _actor(rule: str, ds, hooks: JobHooks | None = None) -> GPUActor:
    slot = Slot(rank=0, node="n0", gpu_type="fast", speed=1.0, group=0, pair=0)
    job = JobConfig(seed=7, sync="sma", sma_learners=LEARNERS, sma_restart=rule,
                    initial_global_batch=BASE_BATCH, min_global_batch=8, min_local_batch=4)
    actor = GPUActor(slot, 1, job, model_fn, optimizer_fn, loss_fn, ds, "cpu", False, hooks=hooks)
    actor.setup(Rendezvous("127.0.0.1", 29500, 1))
    return actor


def _request(epoch: int, cursor: int, n: int, local_batch: int, iteration: int) -> IntervalRequest:
    return IntervalRequest(epoch=epoch, cursor=cursor, num_iterations=n, local_batch=local_batch,
                           layout=[LEARNERS], iteration=iteration, base_lr=None,
                           base_batch=BASE_BATCH, lr_scaling="sqrt", warmup_iterations=0,
                           similarity=False, record_samples=True)


def _check_equal(actor: GPUActor, ref: Reference) -> None:
    w = actor.worker
    torch.testing.assert_close(w._z.flat, ref.z, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w._velocity, ref.v, rtol=1e-5, atol=1e-6)
    for learner, r in zip(w._learners, ref.replicas):
        torch.testing.assert_close(learner.flat, r, rtol=1e-5, atol=1e-6)


def _replay(ref: Reference, ds, reply, start: int, local_batch: int,
            lrs_expected: list[float]) -> None:
    """Apply the reply's iterations to the reference, restarting where the reply says."""
    per_iteration = local_batch * LEARNERS
    assert reply.lrs == pytest.approx(lrs_expected)
    for k in range(reply.num_iterations):
        if start + k in reply.sma_restarts:
            ref.restart()
        ref.iteration(ds, reply.served[k * per_iteration:(k + 1) * per_iteration], local_batch,
                      reply.lrs[k])


@pytest.mark.parametrize("rule, restarts", [("schedule", []), ("never", []), ("batch", [3])])
def test_adaptive_batch_change_rescales_the_lr_and_restarts_only_under_the_batch_rule(rule, restarts):
    """B_G 8 -> 16 at iteration 3: gamma = 0.05 * sqrt(B_G / 8) follows it under every rule;
    replicas and momentum are kept ("schedule", the default, and "never") or reset to z
    ("batch"), and the actor's state equals Alg. 1 replayed with exactly those restarts."""
    ds, _ = tiny_data(240)
    actor = _actor(rule, ds)
    ref = Reference(seed=7)
    try:
        actor.configure(LEARNERS, 0, 4)
        first = actor.run_interval(_request(0, 0, 3, 4, 0))
        assert first.sma_restarts == []
        _replay(ref, ds, first, 0, 4, [USER_LR] * 3)
        _check_equal(actor, ref)
        replicas_before = [learner.flat.clone() for learner in actor.worker._learners]
        assert any(not torch.equal(r, actor.worker._z.flat) for r in replicas_before)

        actor.configure(LEARNERS, 0, 8)                        # adaptive batching: B_G 8 -> 16
        second = actor.run_interval(_request(0, 24, 3, 8, 3))
        assert second.sma_restarts == restarts
        _replay(ref, ds, second, 3, 8, [USER_LR * 2 ** 0.5] * 3)
        _check_equal(actor, ref)
    finally:
        actor.shutdown()


@pytest.mark.parametrize("rule, restarts", [("schedule", [4]), ("batch", [4]), ("never", [])])
def test_epoch_stepped_schedule_change_restarts_under_schedule_and_batch(rule, restarts):
    """An epoch-stepped StepLR halves the user's LR after epoch 0 (4 iterations of B_G 8 on 32
    samples): "schedule" and "batch" restart at the first iteration of epoch 1, "never" does
    not; B_G stays put, so no batch-rule restart."""
    ds, _ = tiny_data(32)
    hooks = JobHooks(lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                     lr_scheduler_interval="epoch")
    actor = _actor(rule, ds, hooks)
    ref = Reference(seed=7)
    try:
        actor.configure(LEARNERS, 0, 4)
        first = actor.run_interval(_request(0, 0, 4, 4, 0))
        assert first.sma_restarts == [] and first.served is not None
        assert sorted(first.served) == list(range(32))       # the epoch, each sample once
        _replay(ref, ds, first, 0, 4, [USER_LR] * 4)
        second = actor.run_interval(_request(1, 0, 2, 4, 4))
        assert second.sma_restarts == restarts
        _replay(ref, ds, second, 4, 4, [USER_LR / 2] * 2)
        _check_equal(actor, ref)
    finally:
        actor.shutdown()


def test_per_iteration_schedule_and_warmup_never_restart():
    """A per-iteration scheduler (and the warm-up ramp) moves gamma every iteration; SMA only
    updates gamma (section 3.2: "updating gamma directly in each iteration")."""
    ds, _ = tiny_data(64)
    hooks = JobHooks(lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.9),
                     lr_scheduler_interval="iteration")
    actor = _actor("schedule", ds, hooks)
    try:
        actor.configure(LEARNERS, 0, 4)
        req = _request(0, 0, 4, 4, 0)
        from dataclasses import replace
        reply = actor.run_interval(replace(req, warmup_iterations=2))
        assert reply.sma_restarts == []
        assert reply.lrs == pytest.approx([USER_LR * 0.5, USER_LR * 0.9, USER_LR * 0.81,
                                           USER_LR * 0.729])
    finally:
        actor.shutdown()


def test_restart_rule_table():
    """sma_restart_due on every combination of (schedule step, B_G step, warm-up done)."""
    for rule in ("schedule", "batch", "never"):
        for stepwise in (False, True):
            for user_prev in (None, 0.1, 0.2):
                for bg_prev in (None, 1.0, 2.0):
                    for warm in (False, True):
                        got = sma_restart_due(rule, user_lr_prev=user_prev, user_lr=0.1,
                                              stepwise_schedule=stepwise,
                                              batch_factor_prev=bg_prev, batch_factor=1.0,
                                              warmup_done=warm)
                        schedule_step = stepwise and user_prev == 0.2
                        batch_step = warm and bg_prev == 2.0
                        want = {"never": False, "schedule": schedule_step,
                                "batch": schedule_step or batch_step}[rule]
                        assert got == want, (rule, stepwise, user_prev, bg_prev, warm)
    with pytest.raises(ValueError, match="sma_restart must be one of"):
        sma_restart_due("sometimes", user_lr_prev=None, user_lr=0.1, stepwise_schedule=False,
                        batch_factor_prev=None, batch_factor=1.0, warmup_done=True)
    with pytest.raises(ValueError, match="sma_restart"):
        JobConfig(sync="sma", sma_restart="always")
