"""The packed step is free of host syncs in steady state: no hyper-parameter column is built
from Python lists per step (they live on the device, rebuilt only when a member's
``param_groups`` change), Adam's/Adagrad's step-dependent factors are computed on the device,
and no tensor is read back to the host -- while every member still trains exactly as a plain
per-model loop with its own ``torch.optim`` optimizer (float64)."""
from __future__ import annotations

import copy

import pytest
import torch

from jabasray.engine.packing import pack
from jabasray.models import MLP
from packing_helpers import solo_step

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

SGD, Adam, Adagrad = torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad

#: per-member (optimizer class, hyper-parameters); one pack each
PACKS = {
    "sgd": [(SGD, dict(lr=0.1)), (SGD, dict(lr=0.05, weight_decay=0.01))],
    "momentum": [(SGD, dict(lr=0.1, momentum=0.9)), (SGD, dict(lr=0.05, momentum=0.5, dampening=0.1))],
    "nesterov": [(SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
                 (SGD, dict(lr=0.02, momentum=0.8, nesterov=True))],
    "sgd_mixed": [(SGD, dict(lr=0.1)), (SGD, dict(lr=0.05, momentum=0.9)),
                  (SGD, dict(lr=0.02, momentum=0.8, nesterov=True))],
    "adam": [(Adam, dict(lr=1e-2)), (Adam, dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2))],
    "adagrad": [(Adagrad, dict(lr=0.1)), (Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=1e-3))],
    "mixed_kinds": [(Adam, dict(lr=1e-2)), (SGD, dict(lr=0.1, momentum=0.9)), (Adagrad, dict(lr=0.1))],
}


def _members(spec):
    torch.manual_seed(0)
    models = [MLP(hidden=(16,)) for _ in spec]
    opts = [cls(m.parameters(), **hp) for m, (cls, hp) in zip(models, spec)]
    refs = [copy.deepcopy(m) for m in models]
    ref_opts = [cls(r.parameters(), **hp) for r, (cls, hp) in zip(refs, spec)]
    return models, opts, refs, ref_opts


class HostTraffic:
    """Within ``with``: counts what would cost a host sync or a host -> device copy on a GPU
    (tensors built from Python data, tensors read back to Python)."""

    FACTORIES = ("tensor", "as_tensor")
    READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")

    def __enter__(self):
        self.calls: list[str] = []
        self.saved = [(torch, n, getattr(torch, n)) for n in self.FACTORIES] + \
                     [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in self.READS]
        for owner, name, fn in self.saved:
            setattr(owner, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)

    def _wrap(self, name, fn):
        def wrapped(*a, **k):
            self.calls.append(name)
            return fn(*a, **k)
        return wrapped


@pytest.mark.parametrize("name", sorted(PACKS))
def test_steady_state_packed_step_is_sync_free_and_exact(name):
    spec = PACKS[name]
    models, opts, refs, ref_opts = _members(spec)
    p = pack(models, opts, [16, 8, 12][:len(spec)])
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(7)]

    def ref_step(x, y):
        return solo_step(refs, ref_opts, p.batch_sizes, x, y)

    for step, (x, y) in enumerate(batches):
        if step == 5:                                  # an LR change: columns rebuilt once
            for o in (opts[0], ref_opts[0]):
                o.param_groups[0]["lr"] *= 0.5
        with HostTraffic() as traffic:
            losses = p.train_step_tensor(x, y)
        if step == 5:
            assert traffic.calls and set(traffic.calls) <= {"tensor"}    # the changed run's columns
        elif step >= 2:                                # after the first steps (build, checks)
            assert traffic.calls == [], f"step {step}: host traffic {traffic.calls}"
        torch.testing.assert_close(losses, ref_step(x, y))
    for m, r in zip(models, refs):
        for a, b in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(a, b)
    for (m, o), ro in zip(p.free_all(), ref_opts):
        sa, sb = o.state_dict()["state"], ro.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            for key in sb[i]:
                torch.testing.assert_close(torch.as_tensor(sa[i][key]).double(),
                                           torch.as_tensor(sb[i][key]).double(), msg=key)


@pytest.mark.cuda
def test_packed_step_has_no_host_sync_on_cuda():
    """``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising call. The eager
    packed step (``cuda_graphs="off"``; the graphed one: tests/test_packing_graphs.py, whose
    capture synchronises once)."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    models = [MLP(hidden=(16,)).to(dev) for _ in range(3)]
    opts = [Adam(models[0].parameters(), lr=1e-2), SGD(models[1].parameters(), lr=0.1, momentum=0.9),
            Adagrad(models[2].parameters(), lr=0.1)]
    p = pack(models, opts, [16, 8, 12], cuda_graphs="off")
    x, y = torch.rand(16, 64, device=dev), torch.randint(0, 10, (16,), device=dev)
    for _ in range(3):
        p.train_step_tensor(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            p.train_step_tensor(x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
