"""One gradient hook per bucket instead of one per parameter per replica (flat gradient
buckets, as with a process group): after one traced backward per VSW, each VSW holds one
post-accumulate-grad hook per bucket, steady-state steps call only those, every bucket is
still launched during backward (overlap kept), and the steps stay equal (float64) to a plain
step on the union of the micro-batches - also when the order of gradients changes between
steps (the placement is found stale, the step stays exact, the next step traces again).
The two-rank gloo case with different VSW counts and executions per rank is at the end."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine_reference import (OPTIMIZERS, clone, make_data, make_model, max_rel_diff, reference_step,
                              run_gloo_ranks, split)
from jabasray.engine import IIDPWorker

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

CAP = 0.0005  # MiB: splits TinyNet into several buckets


def registered_hooks(w: IIDPWorker) -> list[int]:
    """Post-accumulate-grad hooks registered on each VSW's parameters (main first)."""
    return [sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in m.parameters())
            for m in (v.module for v in w._vsws)]


class HookCalls:
    """Counts calls of every post-accumulate-grad hook registered while installed."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = torch.Tensor.register_post_accumulate_grad_hook

        def register(t, hook):
            def counted(p):
                self.calls += 1
                return hook(p)
            return real(t, counted)
        monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", register)


def launches_during_backward(monkeypatch, w: IIDPWorker) -> list[tuple[int, bool]]:
    """(bucket, launched while a VSW's last backward still ran) of every launch."""
    seen: list[tuple[int, bool]] = []
    real = w._buckets.launch

    def spy(b):
        seen.append((b, any(v.counting for v in w._vsws)))
        real(b)
    monkeypatch.setattr(w._buckets, "launch", spy)
    return seen


def assert_optimizer_state_equal(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer) -> None:
    a, b = opt.state_dict()["state"], ref.state_dict()["state"]
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].keys() == b[k].keys()
        for name in a[k]:
            torch.testing.assert_close(torch.as_tensor(a[k][name]), torch.as_tensor(b[k][name]),
                                       rtol=1e-10, atol=1e-12, msg=f"state {k}.{name}")


@pytest.mark.parametrize("execution, n, ga", [("auto", 3, 1), ("threads", 3, 1), ("one_thread", 2, 2),
                                              ("auto", 1, 0)])
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
def test_one_hook_per_bucket_after_the_traced_step(monkeypatch, execution, n, ga, opt):
    calls = HookCalls(monkeypatch)
    model = make_model(0)
    ref = clone(model)
    ref_opt = OPTIMIZERS[opt](list(ref.parameters()))
    w = IIDPWorker(model, OPTIMIZERS[opt], F.cross_entropy, bucket_cap_mb=CAP, flat_grads=True,
                   vsw_execution=execution)
    launches = launches_during_backward(monkeypatch, w)
    w.configure(n, ga, 3)
    nb, nparams = len(w.bucket_plan), len(list(model.parameters()))
    assert nb >= 3 and nparams > nb
    workers = n * (ga + 1)
    for step in range(4):
        X, y = make_data(step, workers * 3)
        calls.calls = 0
        del launches[:]
        st = w.train_step(split(X, y, [3] * workers))
        ref_loss = reference_step(ref, ref_opt, X, y)
        active = 1 if st.batched else n
        assert st.batched == (execution == "auto")
        assert st.loss == pytest.approx(ref_loss, rel=1e-10)
        assert max_rel_diff(w.model, ref) < 1e-10
        # every bucket launched once, in plan order, all while a backward still ran
        assert launches == [(b, True) for b in range(nb)], step
        backwards = active * (ga + 1)         # backward passes of the active VSWs
        if step == 0:                         # traced: a hook on every parameter of each VSW
            assert calls.calls == nparams * backwards
        else:                                 # one hook per bucket and active VSW
            assert calls.calls == nb * backwards
            assert registered_hooks(w)[:active] == [nb] * active
    assert sum(registered_hooks(w)[active:]) == 0     # idle replicas (batched) hold none
    assert_optimizer_state_equal(w.optimizer, ref_opt)


def test_no_hooks_without_flat_buckets_and_same_result(monkeypatch):
    """Single device, autograd's own gradients: nothing is launched during backward, so no
    hook at all; per-VSW and batched steps still equal the plain step."""
    calls = HookCalls(monkeypatch)
    for execution in ("threads", "auto"):
        model = make_model(0)
        ref = clone(model)
        ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
        w = IIDPWorker(model, OPTIMIZERS["adam"], F.cross_entropy, bucket_cap_mb=CAP, vsw_execution=execution)
        w.configure(3, 1, 2)
        for step in range(2):
            X, y = make_data(step, 12)
            w.train_step(split(X, y, [2] * 6))
            reference_step(ref, ref_opt, X, y)
        assert calls.calls == 0 and registered_hooks(w) == [0, 0, 0]
        assert max_rel_diff(w.model, ref) < 1e-10


class Swapping(nn.Module):
    """Two layers in ONE bucket whose order in the graph flips with ``flip``: the parameter
    autograd finishes last in the bucket changes; ``skip`` leaves ``c`` without gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.flip = False
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.flip else (self.a, self.b)
        h = torch.tanh(second(torch.tanh(first(x))))
        if not self.skip:
            h = h + torch.tanh(self.c(h))
        return self.head(h)


SWAP_PLAN = [["head.weight", "head.bias"], ["a.weight", "a.bias", "b.weight", "b.bias"],
             ["c.weight", "c.bias"]]


@pytest.mark.parametrize("execution", ["auto", "threads"])
def test_changed_gradient_order_stays_exact_and_is_traced_again(monkeypatch, execution):
    # plain SGD: a parameter without gradient gets a zero one in the engine (a complete
    # bucket, as in DDP) and none in the reference: the same update only without momentum
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    model = Swapping()
    ref = clone(model)
    ref_opt = sgd(list(ref.parameters()))
    w = IIDPWorker(model, sgd, F.cross_entropy, bucket_plan=SWAP_PLAN,
                   flat_grads=True, vsw_execution=execution)
    launches = launches_during_backward(monkeypatch, w)
    w.configure(2, 1, 3)
    # (flip, skip) per step and what the main VSW's hooks are after it
    schedule = [((False, False), "bucket"), ((False, False), "bucket"), ((True, False), "trace"),
                ((True, False), "bucket"), ((True, True), "bucket"), ((True, False), "bucket")]
    g = torch.Generator().manual_seed(0)
    for step, ((flip, skip), hooks_after) in enumerate(schedule):
        for m in [ref] + [v.module for v in w._vsws]:
            m.flip, m.skip = flip, skip
        X, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
        del launches[:]
        st = w.train_step(split(X, y, [3] * 4))
        ref_loss = reference_step(ref, ref_opt, X, y)
        assert st.loss == pytest.approx(ref_loss, rel=1e-10), step
        assert max_rel_diff(w.model, ref) < 1e-10, step
        assert w._vsws[0].hooks == hooks_after, step
        during = dict(launches)
        assert sorted(during) == [0, 1, 2]
        if step == 2:        # the hooked parameter of bucket 1 is no longer last: after backward
            assert not during[1]
        if step == 4:        # c has no gradient: bucket 2 completes after backward
            assert not during[2] and w._vsws[0].last[2] is not None
        if step in (0, 1, 3, 5):
            assert all(during.values()), step


# ------------------------------------------------------------------ two gloo ranks
# per rank: (vsw_execution, num_vsw, num_ga); B_L; steps
RANK_LAYOUTS = [(("auto", 3, 0), ("threads", 2, 1)), (("one_thread", 2, 0), ("auto", 1, 2))]
DIST_SCENARIOS = [("sgd_momentum", "sws"), ("adam", "ows")]
B_L, STEPS = 2, 4


def _dist_rank(rank: int) -> dict:
    """One rank's runs of every layout and scenario (weights, optimizer state, losses, hooks)."""
    results = {}
    for li, layout in enumerate(RANK_LAYOUTS):
        execution, n, ga = layout[rank]
        sizes = [lay[1] * (lay[2] + 1) for lay in layout]
        for opt, method in DIST_SCENARIOS:
            w = IIDPWorker(make_model(0), OPTIMIZERS[opt], F.cross_entropy, process_group=dist.group.WORLD,
                           weight_sync=method, bucket_cap_mb=CAP, vsw_execution=execution)
            w.configure(n, ga, B_L)
            during, real = [], w._buckets.launch

            def spy(b, w=w, during=during, real=real):
                during.append(any(v.counting for v in w._vsws))
                real(b)
            w._buckets.launch = spy
            losses, hooks, batched = [], [], []
            for step in range(STEPS):
                X, y = make_data(200 + step, sum(sizes) * B_L)
                offset = sizes[0] * B_L if rank == 1 else 0
                st = w.train_step(split(X[offset:], y[offset:], [B_L] * sizes[rank]))
                losses.append(float(st.loss))
                hooks.append(registered_hooks(w))
                batched.append(st.batched)
            results[(li, opt, method)] = dict(
                model={k: v.clone() for k, v in w.model.state_dict().items()},
                optimizer=w.optimizer.state_dict(), losses=losses, hooks=hooks, batched=batched,
                during=during, buckets=len(w.bucket_plan))
            w.close()
    return results


def test_two_gloo_ranks_with_different_vsw_counts_match_the_plain_step(tmp_path):
    got = run_gloo_ranks(_dist_rank, tmp_path)
    for li, layout in enumerate(RANK_LAYOUTS):
        sizes = [lay[1] * (lay[2] + 1) for lay in layout]
        for opt, method in DIST_SCENARIOS:
            ref = make_model(0)
            ref_opt = OPTIMIZERS[opt](list(ref.parameters()))
            ref_losses = [reference_step(ref, ref_opt, *make_data(200 + s, sum(sizes) * B_L))
                          for s in range(STEPS)]
            for r in range(2):
                res = got[r][(li, opt, method)]
                execution, n, ga = layout[r]
                nb = res["buckets"]
                assert nb >= 3
                model = make_model(1)
                model.load_state_dict(res["model"])
                assert max_rel_diff(model, ref) < 1e-10, (li, opt, method, r)
                assert res["losses"] == pytest.approx(ref_losses, rel=1e-10)
                opt_copy = OPTIMIZERS[opt](list(model.parameters()))
                opt_copy.load_state_dict(res["optimizer"])
                assert_optimizer_state_equal(opt_copy, ref_opt)
                assert res["batched"] == [execution == "auto"] * STEPS
                active = 1 if execution == "auto" else n
                # after the traced first step: one hook per bucket and active VSW
                assert res["hooks"][1:] == [[nb] * active + [0] * (n - active)] * (STEPS - 1)
                assert all(res["during"]) and len(res["during"]) == nb * STEPS
