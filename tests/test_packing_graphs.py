"""The packed step as ONE CUDA graph between restacks (``jabasray.engine.packing.graphed``).

On the CPU a stand-in capture backend (:class:`_FakeGraph`) exercises the graph path's
bookkeeping: which steps capture, which replay, which invalidate (restack, input shape, a
hyper-parameter change that is not a column refill) and which merely refill device columns
(an LR schedule, a momentum value); replays advance the host bookkeeping like eager steps, so
the graphed pack equals the eager pack and every member equals the same configuration trained
alone with ``torch.optim`` (float64). The fallback reasons are logged once each. The
``cuda``-marked tests run the real capture (skipped without a GPU)::

    python -m pytest -q -m cuda tests/test_packing_graphs.py    # on a GPU
"""
from __future__ import annotations

import contextlib
import copy
import logging
import warnings

import pytest
import torch
from torch import nn

from jabasray.engine import graphs, streams
from jabasray.engine.packing import graphed, pack
from jabasray.models import MLP
from packing_helpers import solo_step

SGD, Adam, Adagrad = torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad
NO_GRAPH = "no CUDA graph"


class _FakeGraph:
    """A CPU stand-in for a captured graph: capture RUNS the body once (a real capture runs
    nothing and its first replay runs the step), so the first replay is skipped; later
    replays run the body again (on the static inputs, reading the same column tensors) and
    copy its losses into the static output."""

    def __init__(self, fn, out) -> None:
        self.fn, self.out, self.first = fn, out, True

    def replay(self) -> None:
        if self.first:
            self.first = False
            return
        self.out.copy_(self.fn())


def _fake_cuda(monkeypatch, capture=None):
    def fake_capture(fn, stream):
        out = fn()
        return _FakeGraph(fn, out), out
    monkeypatch.setattr(graphs, "cuda_capture", capture or fake_capture)
    monkeypatch.setattr(graphs, "device_memory_blocker", lambda device: None)
    monkeypatch.setattr(graphs, "release_cached_memory", lambda device: None)
    monkeypatch.setattr(graphed, "pack_device_blocker",
                        lambda mode, device: "cuda_graphs='off'" if mode == "off" else None)
    monkeypatch.setattr(graphed, "side_stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(streams, "new_stream", lambda device, role="foreground": None)


# (architecture, optimizer class, hyper-parameters, batch size) of the members; two groups
MEMBERS = [((16,), Adam, dict(lr=1e-2), 16),
           ((16,), SGD, dict(lr=0.1, momentum=0.9), 8),
           ((8,), SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), 12),
           ((8,), Adagrad, dict(lr=0.1), 4)]
JOINER = ((16,), SGD, dict(lr=0.1, momentum=0.5, dampening=0.1), 10)


class _Trio:
    """The same members three times: a graphed pack, an eager pack, each trained alone."""

    def __init__(self, specs, modes=("auto", "off")) -> None:
        self.packs = {}
        self.live: list[int] = list(range(len(specs)))   # member ids (the same in every pack)
        built = [self._build(s) for s in specs]
        for mode in modes:
            ms = [copy.deepcopy(m) for m, _, _ in built]
            opts = [cls(m.parameters(), **hp) for m, (_, cls, hp, _) in zip(ms, specs)]
            self.packs[mode] = pack(ms, opts, [s[3] for s in specs], cuda_graphs=mode)
        self.solo = {i: (m, o, s[3]) for i, ((m, o, _), s) in enumerate(zip(built, specs))}

    @staticmethod
    def _build(spec):
        arch, cls, hp, _ = spec
        m = MLP(hidden=arch)
        return m, cls(m.parameters(), **hp), None

    def opts(self, mid):
        """The optimizers of member ``mid`` (every pack's and the solo one)."""
        return [p.optimizer(mid) for p in self.packs.values()] + [self.solo[mid][1]]

    def step(self, x, y):
        out = {mode: p.train_step_tensor(x, y) for mode, p in self.packs.items()}
        return out, solo_step(*zip(*(self.solo[mid] for mid in self.live)), x, y)

    def restack(self, free, spec):
        m, o, _ = self._build(spec)
        ids = set()
        for p in self.packs.values():
            mm = copy.deepcopy(m)
            ids.add(tuple(p.update([free], [(mm, spec[1](mm.parameters(), **spec[2]), spec[3])])))
        (new,), = ids
        self.solo.pop(free)
        self.solo[new] = (m, o, spec[3])
        self.live = sorted(set(self.live) - {free}) + [new]


@pytest.mark.usefixtures("float64")
def test_graphed_pack_equals_eager_pack_and_solo_training(monkeypatch, caplog):
    """Captures, replays and invalidations step by step; every step's losses, the weights and
    the optimizer states equal the eager pack and each member trained alone."""
    _fake_cuda(monkeypatch)
    torch.manual_seed(0)
    trio = _Trio(MEMBERS)
    auto = trio.packs["auto"]
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in trio.opts(0)]
    g = torch.Generator().manual_seed(1)
    graphed_steps, col_ids = [], None
    with caplog.at_level(logging.INFO, logger="jabasray.engine.packing.graphed"):
        for s in range(23):
            rows = 20 if s in (14, 15, 16, 17) else 16          # a changed input shape
            if s == 6:                                          # an LR schedule: a refill
                col_ids = [id(t) for t in auto._groups[0].runs[0].cols.values()]
                with warnings.catch_warnings():                 # a pack's optimizers never run
                    warnings.simplefilter("ignore", UserWarning)   # .step(): torch warns on order
                    for sc in sched:
                        sc.step()
            if s == 7:                                          # a momentum VALUE: a refill
                for o in trio.opts(2):
                    o.param_groups[0]["momentum"] = 0.8
            if s == 8:                                          # a restack: free 1, load one
                trio.restack(1, JOINER)
            if s == 19:                                         # weight decay switched on: a new
                for o in trio.opts(0):                          # code path (a new column)
                    o.param_groups[0]["weight_decay"] = 1e-2
            x, y = torch.rand(rows, 64, generator=g), torch.randint(0, 10, (rows,), generator=g)
            out, ref = trio.step(x, y)
            graphed_steps.append(auto.last_step_graphed)
            if s == 6:                                          # refilled in place, still replayed
                assert [id(t) for t in auto._groups[0].runs[0].cols.values()] == col_ids
                assert float(auto._groups[0].runs[0].cols["lr"][0]) == 5e-3
            torch.testing.assert_close(out["auto"], out["off"], rtol=0, atol=0)
            torch.testing.assert_close(out["auto"], ref)
    T, E = True, False
    assert graphed_steps == ([E] + [E] * 3 + [T] * 4          # build 1: checked step, warm-up, replays
                             + [E] + [E] * 3 + [T] * 2        # restack: checks, warm-up, capture
                             + [E] * 3 + [T]                  # 20 rows: warm-up, capture
                             + [T]                            # 16 rows again: warmed up, re-captured
                             + [E] * 3 + [T])                 # weight decay on: warm-up, capture
    assert auto._graphs.cache.captures == 5
    captured = [r.getMessage() for r in caplog.records if "captured as a CUDA graph" in r.getMessage()]
    assert captured == [f"pack: packed step captured as a CUDA graph (4 members, batch ({rows}, 64))"
                        for rows in (16, 16, 20, 16, 16)]
    assert [r.getMessage() for r in caplog.records if NO_GRAPH in r.getMessage()] == [
        "pack: eager packed step (no CUDA graph: cuda_graphs='off')"]          # the eager pack's
    # final weights and optimizer states: graphed pack == eager pack == solo
    for mid in trio.live:
        ref_m, ref_o, _ = trio.solo[mid]
        for p in trio.packs.values():
            for a, b in zip(p.model(mid).parameters(), ref_m.parameters()):
                torch.testing.assert_close(a, b)
    for p in trio.packs.values():
        for mid, (m, o) in zip(sorted(trio.live), p.free_all()):
            sa, sb = o.state_dict()["state"], trio.solo[mid][1].state_dict()["state"]
            assert sa.keys() == sb.keys()
            for i in sa:
                for key in sb[i]:
                    torch.testing.assert_close(torch.as_tensor(sa[i][key]).double(),
                                               torch.as_tensor(sb[i][key]).double(), msg=key)


def test_cpu_runs_eagerly_with_the_reason_logged_once(caplog):
    torch.manual_seed(0)
    models = [MLP(hidden=(8,)) for _ in range(2)]
    p = pack(models, [SGD(m.parameters(), lr=0.1) for m in models], [8, 4])
    assert p.cuda_graphs == "auto" and p.graph_fallback_reason() == "device cpu is not CUDA"
    with caplog.at_level(logging.INFO, logger="jabasray.engine.packing.graphed"):
        for _ in range(6):
            p.train_step_tensor(torch.rand(8, 64), torch.randint(0, 10, (8,)))
            assert not p.last_step_graphed
    lines = [r.getMessage() for r in caplog.records if NO_GRAPH in r.getMessage()]
    assert lines == ["pack: eager packed step (no CUDA graph: device cpu is not CUDA)"]
    m = MLP(hidden=(8,))
    off = pack([m], [SGD(m.parameters(), lr=0.1)], [8], cuda_graphs="off")
    assert off.graph_fallback_reason() == "cuda_graphs='off'"
    with pytest.raises(ValueError, match="cuda_graphs must be one of 'auto', 'off', got 'on'"):
        pack([m], [SGD(m.parameters(), lr=0.1)], [8], cuda_graphs="on")


class BNNet(nn.Module):
    """A member with buffers (BatchNorm running statistics): runs unbatched."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 10))

    def forward(self, x):
        return self.net(x)


def _broken_capture(fn, stream):
    raise RuntimeError("operation not permitted when stream is capturing\nmore detail")


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("case", ["unbatched", "own_optimizer_step", "capture_error"])
def test_fallbacks_run_eagerly_with_one_line_and_stay_exact(monkeypatch, caplog, case):
    _fake_cuda(monkeypatch, capture=_broken_capture if case == "capture_error" else None)
    torch.manual_seed(0)
    models = [MLP(hidden=(8,)), BNNet() if case == "unbatched" else MLP(hidden=(8,))]
    second = torch.optim.RMSprop if case == "own_optimizer_step" else SGD
    opts = [SGD(models[0].parameters(), lr=0.1, momentum=0.9), second(models[1].parameters(), lr=0.01)]
    refs = [copy.deepcopy(m) for m in models]
    ref_opts = [type(o)(r.parameters(), lr=o.param_groups[0]["lr"], **(
        {"momentum": 0.9} if i == 0 else {})) for i, (o, r) in enumerate(zip(opts, refs))]
    p = pack(models, opts, [8, 6])
    g = torch.Generator().manual_seed(2)
    with caplog.at_level(logging.INFO, logger="jabasray.engine.packing.graphed"):
        for _ in range(8):
            x, y = torch.rand(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
            losses = p.train_step_tensor(x, y)
            assert not p.last_step_graphed
            torch.testing.assert_close(losses, solo_step(refs, ref_opts, p.batch_sizes, x, y))
    want = {"unbatched": "member 1 runs unbatched (buffers or dropout) with its own optimizer.step()",
            "own_optimizer_step": "members [1] step through their own optimizer.step() (an optimizer "
                                  "or state the fused update does not cover)",
            "capture_error": "capture failed (RuntimeError: operation not permitted when stream is "
                             "capturing)"}[case]
    lines = [r.getMessage() for r in caplog.records if NO_GRAPH in r.getMessage()]
    assert lines == [f"pack: eager packed step (no CUDA graph: {want})"]
    assert p.graph_fallback_reason() == want
    for m, r in zip(models, refs):
        for a, b in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(a, b)


def test_graph_key_tells_refills_from_new_code_paths():
    """:func:`pack_graph_key` stays for an LR/momentum value change (the columns are refilled
    in place) and changes for a restack, another input shape or dtype, weight decay or
    Nesterov switched on."""
    torch.manual_seed(0)
    models = [MLP(hidden=(8,)) for _ in range(2)]
    opts = [SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    p = pack(models, opts, [8, 4], cuda_graphs="off")
    x, y = torch.rand(8, 64), torch.randint(0, 10, (8,))
    p.train_step_tensor(x, y)

    def key(inputs=x, targets=y):
        p._refill_columns()
        return graphed.pack_graph_key(p._graphs.build, inputs, targets, p._groups)
    k0 = key()
    opts[0].param_groups[0]["lr"] = 0.05
    opts[1].param_groups[0]["momentum"] = 0.5
    assert key() == k0
    cols = p._groups[0].runs[0].cols
    torch.testing.assert_close(cols["lr"], torch.tensor([[0.05], [0.1]]), rtol=0, atol=0)
    torch.testing.assert_close(cols["momentum"], torch.tensor([[0.9], [0.5]]), rtol=0, atol=0)
    assert key(inputs=torch.rand(9, 64)) != k0
    assert key(inputs=x.double()) != k0
    assert key(targets=y.int()) != k0
    opts[1].param_groups[0]["weight_decay"] = 1e-3
    k1 = key()
    assert k1 != k0
    opts[1].param_groups[0]["weight_decay"] = 0
    assert key() not in (k0, k1)                  # the columns were rebuilt: a new generation
    opts[0].param_groups[0]["nesterov"] = True
    k2 = key()
    opts[0].param_groups[0]["nesterov"] = False
    assert k2 != key()
    b = p._graphs.build
    p.sync()                                      # a restack
    assert p._graphs.build > b and key() != k2


# ------------------------------------------------------------------------------ GPU
def _gpu_trio(specs):
    dev = torch.device("cuda")
    trio = _Trio.__new__(_Trio)
    trio.packs, trio.live = {}, list(range(len(specs)))
    torch.manual_seed(0)
    built = [MLP(hidden=s[0]).to(dev) for s in specs]
    for mode in ("auto", "off"):
        ms = [copy.deepcopy(m) for m in built]
        trio.packs[mode] = pack(ms, [s[1](m.parameters(), **s[2]) for m, s in zip(ms, specs)],
                                [s[3] for s in specs], cuda_graphs=mode)
    trio.solo = {i: (m, s[1](m.parameters(), **s[2]), s[3]) for i, (m, s) in enumerate(zip(built, specs))}
    return trio


@pytest.mark.cuda
def test_cuda_graphed_pack_equals_eager_and_solo():
    """The real capture: graphed == eager packed step (float32) and every member == its
    configuration trained alone, through an LR schedule, a restack and mixed batch sizes."""
    dev = torch.device("cuda")
    trio = _gpu_trio(MEMBERS)
    auto = trio.packs["auto"]
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in trio.opts(0)]
    g = torch.Generator(device=dev).manual_seed(1)
    graphed_steps = []
    for s in range(16):
        if s == 6:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                for sc in sched:
                    sc.step()
        if s == 8:
            spec = JOINER
            m = MLP(hidden=spec[0]).to(dev)
            for p in trio.packs.values():
                mm = copy.deepcopy(m)
                (new,) = p.update([1], [(mm, spec[1](mm.parameters(), **spec[2]), spec[3])])
            trio.solo.pop(1)
            trio.solo[new] = (m, spec[1](m.parameters(), **spec[2]), spec[3])
            trio.live = sorted(set(trio.live) - {1}) + [new]
        x = torch.rand(16, 64, device=dev, generator=g)
        y = torch.randint(0, 10, (16,), device=dev, generator=g)
        out, ref = trio.step(x, y)
        graphed_steps.append(auto.last_step_graphed)
        torch.testing.assert_close(out["auto"], out["off"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["auto"], ref, rtol=1e-4, atol=1e-5)
    assert graphed_steps == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 4
    assert auto.graph_fallback_reason() is None
    for mid in trio.live:
        for a, b in zip(auto.model(mid).parameters(), trio.solo[mid][0].parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_cuda_graphed_pack_steady_state_does_not_synchronise():
    """``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising call."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    models = [MLP(hidden=(16,)).to(dev) for _ in range(3)]
    opts = [Adam(models[0].parameters(), lr=1e-2), SGD(models[1].parameters(), lr=0.1, momentum=0.9),
            Adagrad(models[2].parameters(), lr=0.1)]
    p = pack(models, opts, [16, 8, 12])
    x, y = torch.rand(16, 64, device=dev), torch.randint(0, 10, (16,), device=dev)
    for _ in range(6):                       # checked step, warm-up, capture + first replay
        p.train_step_tensor(x, y)
    assert p.last_step_graphed
    total = torch.zeros(3, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(4):
            if step == 2:                    # an LR change: a column refill (pinned, non-blocking)
                opts[0].param_groups[0]["lr"] = 5e-3
            total += p.train_step_tensor(x, y)
            assert p.last_step_graphed
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(total).all()


@pytest.mark.usefixtures("float64")
def test_momentum_switched_on_mid_pack_recaptures_and_stays_exact(monkeypatch):
    """A plain-SGD run whose member 0 switches momentum on: the update's code path changes
    (a momentum buffer is created, the run steps row by row), so the graph is re-captured
    after a new warm-up; the replayed row-by-row update keeps every member exact."""
    _fake_cuda(monkeypatch)
    torch.manual_seed(0)
    spec = [((8,), SGD, dict(lr=0.1), 8), ((8,), SGD, dict(lr=0.05, weight_decay=1e-3), 6)]
    trio = _Trio(spec)
    g = torch.Generator().manual_seed(3)
    graphed_steps = []
    for s in range(12):
        if s == 6:
            for o in trio.opts(0):
                o.param_groups[0]["momentum"] = 0.9
        x, y = torch.rand(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
        out, ref = trio.step(x, y)
        graphed_steps.append(trio.packs["auto"].last_step_graphed)
        torch.testing.assert_close(out["auto"], out["off"], rtol=0, atol=0)
        torch.testing.assert_close(out["auto"], ref)
    assert graphed_steps == [False] * 4 + [True] * 2 + [False] * 4 + [True] * 2
    for p in trio.packs.values():
        (_, o0), _ = p.free_all()
        ref_state = trio.solo[0][1].state_dict()["state"]
        for i, st in o0.state_dict()["state"].items():
            torch.testing.assert_close(st["momentum_buffer"], ref_state[i]["momentum_buffer"])
