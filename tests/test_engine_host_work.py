"""The engine's cheaper host paths keep the step exact (engine/vsw_norm.py, engine/batched.py,
engine/iidp.py):

* one VSW runs the STOCK BatchNorm forward (no ghost forward installed) and its step equals a
  plain PyTorch step bit for bit in float64 (losses, weights, optimizer state, running
  statistics), and dispatches no ATen op the plain step does not;
* :class:`RepeatAffine` (every BatchNorm weight and bias repeated by one gather) equals
  ``p.repeat(n)`` per parameter, forward and gradient, bit for bit;
* :func:`join_adjacent` joins micro-batches that lie back to back without a copy (a view of
  their storage, the same rows as ``torch.cat``) and refuses everything else.
"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine_reference import make_data, split
from jabasray.engine import IIDPWorker
from jabasray.engine.batched import join_adjacent, join_batches
from jabasray.engine.vsw_norm import RepeatAffine, VSWNorms, pack_norm_stats

pytestmark = pytest.mark.usefixtures("float64")


class ConvBN(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> Linear -> BatchNorm1d (no affine) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(1, 3, 3, padding=1, bias=False)
        self.n1 = nn.BatchNorm2d(3)
        self.fc1 = nn.Linear(3 * 64, 6)
        self.n2 = nn.BatchNorm1d(6, affine=False)
        self.fc2 = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.n1(self.c(x))).flatten(1)
        return self.fc2(torch.relu(self.n2(self.fc1(x))))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_one_vsw_runs_stock_batchnorm_and_equals_plain_step_bit_for_bit():
    torch.manual_seed(0)
    ref = ConvBN()
    model = ConvBN()
    model.load_state_dict(ref.state_dict())
    opt = _sgd(ref.parameters())
    w = IIDPWorker(model, _sgd, F.cross_entropy, cuda_graphs="off")
    w.configure(1, 0, 6)
    ghosted = []
    for m in (model.n1, model.n2):      # which forward each BatchNorm runs inside the step
        m.register_forward_pre_hook(lambda mod, _: ghosted.append("forward" in mod.__dict__))
    for step in range(4):
        X, y = make_data(step, 6)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ref(X), y)
        loss.backward()
        opt.step()
        st = w.train_step([(X, y)])
        assert st.batched
        assert torch.equal(st.loss_raw, loss.detach())
    assert ghosted == [False] * 8
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k        # weights and running statistics
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(w.optimizer.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])

    # and it dispatches the ops of a plain step that keeps its loss (the optimizer's profiler
    # markers aside)
    X, y = make_data(9, 6)
    plain_ops, engine_ops = _Ops(), _Ops()
    with plain_ops:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ref(X), y)
        loss.backward()
        opt.step()
        loss.detach()
    with engine_ops:
        w.train_step([(X, y)])
    extra = engine_ops.ops - plain_ops.ops
    assert not {k: v for k, v in extra.items() if not k.startswith("_record_function")}
    w.close()


@pytest.mark.parametrize("n", [2, 3, 5])
def test_repeat_affine_equals_repeat_per_parameter(n):
    g = torch.Generator().manual_seed(n)
    params = [torch.randn(c, generator=g, requires_grad=True) for c in (3, 1, 7, 4)]
    total = sum(p.numel() for p in params)
    fwd = torch.cat([torch.arange(o, o + p.numel()).repeat(n)
                     for o, p in zip([0, 3, 4, 11], params)])
    starts = [0, 3 * n, 4 * n, 11 * n]
    bwd = torch.cat([s + v * p.numel() + torch.arange(p.numel())
                     for v in range(n) for s, p in zip(starts, params)])
    assert total == 15
    outs = RepeatAffine.apply(n, fwd, bwd, *params)
    weights = [torch.randn(n * p.numel(), generator=g) for p in params]
    sum((o * wt).sum() for o, wt in zip(outs, weights)).backward()
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    ref = [p.repeat(n) for p in params]
    sum((o * wt).sum() for o, wt in zip(ref, weights)).backward()
    for o, r in zip(outs, ref):
        assert torch.equal(o, r)
    for a, p in zip(got, params):
        assert torch.equal(a, p.grad)


def test_vsw_norms_index_layout_matches_repeat():
    """The indexes VSWNorms builds give every affine parameter of the active layers its
    ``repeat(n)`` (weights of affine layers only; a layer without affine has none)."""
    replicas = [ConvBN() for _ in range(3)]
    norms = pack_norm_stats(replicas)
    assert isinstance(norms, VSWNorms) and len(norms.active) == 2
    m = replicas[0]
    assert norms.params == [m.n1.weight, m.n1.bias]
    rep = norms.repeated()
    assert torch.equal(rep[id(m.n1.weight)], m.n1.weight.repeat(3))
    assert torch.equal(rep[id(m.n1.bias)], m.n1.bias.repeat(3))
    assert pack_norm_stats(replicas[:1]).active == []     # one VSW: the stock forward


def test_join_adjacent_is_a_view_of_back_to_back_micro_batches():
    X, y = make_data(0, 12)
    parts = split(X, y, [4, 4, 4])
    joined = join_adjacent(parts)
    assert joined[0].data_ptr() == X.data_ptr() and torch.equal(joined[0], X)
    assert joined[1].data_ptr() == y.data_ptr() and torch.equal(joined[1], y)
    # dicts and collated per-sample lists keep the same (blocked) order
    names = [f"s{i}" for i in range(12)]
    d = [{"x": a, "names": names[4 * i:4 * i + 4]} for i, (a, _) in enumerate(parts)]
    jd = join_adjacent(d)
    assert torch.equal(jd["x"], X) and jd["names"] == names
    # not back to back: GA order (every other micro-batch), one tensor twice, copies, a
    # non-contiguous leaf - and one such leaf refuses the whole batch (one row order for all)
    six = split(X, y, [2] * 6)
    assert join_adjacent(six[::2]) is None
    assert join_adjacent([parts[0], parts[0]]) is None
    assert join_adjacent([(a.clone(), b) for a, b in parts]) is None
    Xt = X.transpose(2, 3)
    assert join_adjacent([(Xt[:6], y[:6]), (Xt[6:], y[6:])]) is None
    assert join_adjacent([parts[0]]) is parts[0]
    # what the engine falls back to
    assert torch.equal(join_batches(six[::2])[0], torch.stack([p[0] for p in six[::2]], 1).reshape(6, 1, 8, 8))


def test_engine_host_benchmark_runs_and_counts_the_engine_minus_plain(tmp_path, monkeypatch):
    """Smoke run of benchmarks/engine_host.py (one round of one step): its op counts are the
    ones this file's tests establish (no BatchNorm: the engine adds only the input views)."""
    import json
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    for mod in ("engine_host", "engine", "common"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    import engine_host
    out = tmp_path / "host.json"
    engine_host.main(["--counts", "1,3", "--rounds", "1", "--window", "1", "--models", "transformer",
                      "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["num_vsw"] for r in rows] == [1, 3]
    def diff(row):          # (the optimizer's profiler markers aside)
        return {k: v for k, v in row["engine_minus_plain_by_op"].items() if not k.startswith("_record_function")}
    assert diff(rows[0]) == {}
    assert diff(rows[1]) == {"as_strided": 2}
    assert rows[1]["kernel_ops_per_step"]["engine"] == rows[1]["kernel_ops_per_step"]["plain"]
