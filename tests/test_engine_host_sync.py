"""No host synchronisation in a steady-state IIDP step.

On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` makes every synchronising call raise
(cuda-marked test). On CPU nothing synchronises, so the CPU test checks the cause instead:
every way Python code reads a tensor's VALUE on the host - ``item``, ``tolist``, ``numpy``,
``__float__``, ``__int__``, ``__index__``, ``__bool__`` (``if t:``), ``__format__`` - is a
device-to-host copy and a sync on a GPU, and is counted while steady-state steps run (the
engine's code, the user's step, the optimizer, ``torch.nn`` modules called from Python).
Kernels themselves never read values on the host, so no count means no sync from Python.
The first step (warm-up, lazy optimizer state) is not counted; reading ``StepStats.loss``
is the caller's single read and happens after the counted window.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_reference import OPTIMIZERS, make_data, split
from jabasray.engine import IIDPWorker
from jabasray.engine.iidp import read_losses

READS = ("item", "tolist", "numpy", "__float__", "__int__", "__index__", "__bool__", "__format__")


@contextlib.contextmanager
def count_host_reads(monkeypatch):
    calls: list[str] = []
    for name in READS:
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            calls.append((_name, self))
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, spy)
    try:
        yield calls
    finally:
        monkeypatch.undo()


class Net(nn.Module):
    def __init__(self, momentum) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4, momentum=momentum)
        self.fc = nn.Linear(4 * 64, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_counter_sees_a_read(monkeypatch):
    """The counter is live: a step_fn that reads its loss is caught."""
    def reading_step(model, batch):
        x, t = batch
        loss = F.cross_entropy(model(x), t)
        float(loss)
        return loss
    w = IIDPWorker(Net(0.1), OPTIMIZERS["sgd_momentum"], None, step_fn=reading_step)
    w.configure(2, 0, 3)
    X, y = make_data(0, 6)
    with count_host_reads(monkeypatch) as calls:
        w.train_step(split(X, y, [3, 3]))
    assert [c for c, _ in calls] == ["__float__"]


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("n, ga", [(1, 0), (3, 1)])
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
def test_steady_state_step_reads_nothing_on_the_host(monkeypatch, n, ga, opt, momentum):
    """Batched steps (SWS and OWS alike; BatchNorm with momentum and with the cumulative
    average) make no host read; the losses of the interval are read once at the end.

    Adam (not ``capturable``) keeps its step count ``state["step"]`` as a HOST tensor and
    reads it every step (PyTorch's design: on CUDA that counter stays in host memory, so the
    read is no device sync); reads of exactly those tensors are not counted."""
    opts = {"sgd_momentum": OPTIMIZERS["sgd_momentum"],
            "adam": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True)}
    for method in ("sws", "ows"):
        w = IIDPWorker(Net(momentum), opts[opt], F.cross_entropy, weight_sync=method, bucket_cap_mb=0.001)
        w.configure(n, ga, 2)
        k = n * (ga + 1)
        X, y = make_data(0, 2 * k)
        w.train_step(split(X, y, [2] * k))                    # warm-up
        raw = []
        with count_host_reads(monkeypatch) as calls:
            for step in range(3):
                X, y = make_data(step + 1, 2 * k)
                st = w.train_step(split(X, y, [2] * k))
                assert st.batched
                raw.append(st.loss_raw)
        host_counters = {id(st["step"]) for st in w.optimizer.state.values() if "step" in st}
        device_reads = [c for c, t in calls if id(t) not in host_counters]
        assert device_reads == [], (method, device_reads)
        if opt == "adam":
            assert calls, "Adam's host step reads are seen (the counter works here too)"
        assert all(isinstance(r, torch.Tensor) for r in raw)
        losses = read_losses(raw)
        assert losses == [float(r) for r in raw] and all(l > 0 for l in losses)


@pytest.mark.cuda
@pytest.mark.parametrize("n, ga", [(1, 0), (4, 1)])
def test_cuda_steady_state_step_does_not_synchronise(n, ga):
    dev = "cuda"
    # the eager path (graphed steps: test_engine_graphs.py; a capture synchronises once)
    w = IIDPWorker(Net(None), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), F.cross_entropy,
                   device=dev, cuda_graphs="off")
    w.configure(n, ga, 8)
    k = n * (ga + 1)
    batches = []
    for step in range(4):
        X, y = make_data(step, 8 * k)
        batches.append(split(X.to(dev), y.to(dev), [8] * k))
    w.train_step(batches[0])
    torch.cuda.synchronize()
    raw = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches[1:]:
            st = w.train_step(b)
            assert st.batched
            raw.append(st.loss_raw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(read_losses(raw)) == 3
