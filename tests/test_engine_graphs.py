"""Whole-step CUDA graphs (engine.graphs): the decision and fallback logic and the static-buffer
bookkeeping on CPU; graphed == eager and no host synchronisation in steady state on a GPU
(``cuda``-marked: skipped without one).

    python -m pytest -q tests/test_engine_graphs.py            # CPU parts
    python -m pytest -q -m cuda tests/test_engine_graphs.py    # on a GPU
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_reference import make_data, split
from jabasray.config import JobConfig
from jabasray.engine import IIDPWorker
from jabasray.engine.batched import join_batches
from jabasray.engine.graphs import (GraphCache, StaticRounds, batch_signature, graph_key,
                                    graph_optimizer_blocker, lr_tensors_in, make_capturable, round_parts,
                                    step_graph_blocker, worker_graph_blocker)
from jabasray.engine.iidp import read_losses

CUDA = torch.device("cuda")   # constructing a device needs no GPU


def _sgd(p=None, **kw):
    return torch.optim.SGD(p if p is not None else [nn.Parameter(torch.zeros(2))], lr=0.125, **kw)


# ------------------------------------------------------------------------------ decisions
def _reconfigure(worker, what: str, arg) -> bool:
    """Apply one non-step entry of a test plan (``cfg``, ``lr``, ``factor``) to ``worker``;
    False for a step entry."""
    if what == "cfg":
        worker.configure(*arg)
    elif what == "lr":
        worker.set_lr(arg)
    elif what == "factor":
        worker.lr_factor = arg
    else:
        return False
    return True


def test_worker_blocker_names_each_reason_in_order():
    ok = dict(mode="auto", device=CUDA, precision="fp32", process_group=None, flat_grads=False,
              sync_timing=False, optimizer=_sgd(momentum=0.9))
    assert worker_graph_blocker(**ok) is None
    cases = [({"mode": "off"}, "cuda_graphs='off'"),
             ({"device": torch.device("cpu")}, "device cpu is not CUDA"),
             ({"precision": "fp16"}, "precision='fp16'"),
             ({"process_group": object()}, "a process group"),
             ({"flat_grads": True}, "flat_grads=True"),
             ({"sync_timing": True}, "sync_timing"),
             ({"optimizer": torch.optim.RMSprop([nn.Parameter(torch.zeros(2))])}, "optimizer RMSprop")]
    for change, start in cases:
        why = worker_graph_blocker(**{**ok, **change})
        assert why is not None and why.startswith(start), (change, why)
        assert "\n" not in why
    # bf16 autocast is capturable (the forward runs with cache_enabled=False)
    assert worker_graph_blocker(**{**ok, "precision": "bf16"}) is None
    # the first reason wins: off before CPU before fp16
    assert worker_graph_blocker(**{**ok, "mode": "off", "device": torch.device("cpu"),
                                   "precision": "fp16"}) == "cuda_graphs='off'"


def test_optimizer_blocker():
    p = [nn.Parameter(torch.zeros(2))]
    for opt in (torch.optim.SGD(p, lr=0.1), torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
                torch.optim.Adam(p), torch.optim.AdamW(p)):
        assert graph_optimizer_blocker(opt) is None, type(opt).__name__
    assert "Adagrad" in graph_optimizer_blocker(torch.optim.Adagrad(p))

    class MySGD(torch.optim.SGD):      # a subclass may change step(): not known to be capturable
        pass
    assert "MySGD" in graph_optimizer_blocker(MySGD(p, lr=0.1))
    assert "tensor LR" in graph_optimizer_blocker(torch.optim.Adam(p, lr=torch.tensor(0.1), capturable=True))
    assert "differentiable" in graph_optimizer_blocker(torch.optim.SGD(p, lr=0.1, differentiable=True))


def test_step_blocker():
    assert step_graph_blocker(None, False, False) is None
    assert step_graph_blocker("ragged step (x)", True, False).startswith("ragged step")
    assert step_graph_blocker("per_sample_loss=False (y)", False, False) == \
        "per-VSW execution (per_sample_loss=False (y))"
    assert "local gradient" in step_graph_blocker(None, False, "split")


def test_make_capturable_sgd_is_the_same_update_with_a_tensor_lr():
    """SGD switched to fused, stepping with its LR in a tensor (as captured), equals the user's
    foreach SGD stepping with float LRs: float64, momentum + Nesterov + weight decay, an LR
    change after three steps."""
    torch.manual_seed(0)
    w0 = torch.randn(50, dtype=torch.float64)
    a, b = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    kw = dict(lr=0.125, momentum=0.9, nesterov=True, weight_decay=1e-2, foreach=True)
    oa, ob = torch.optim.SGD([a], **kw), torch.optim.SGD([b], **kw)
    make_capturable(ob)
    make_capturable(ob)                      # idempotent
    assert ob.param_groups[0]["fused"] is True and ob.param_groups[0]["foreach"] is False
    lr_t = [torch.tensor(0.125, dtype=torch.float32)]
    for step in range(6):
        if step == 3:
            oa.param_groups[0]["lr"] = 0.0625
            lr_t[0].fill_(0.0625)            # what a replay does when the LR changed
        g = torch.randn(50, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        with lr_tensors_in(ob, lr_t):
            ob.step()
        assert ob.param_groups[0]["lr"] == 0.125        # restored after the block
    torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(ob.state[b]["momentum_buffer"], oa.state[a]["momentum_buffer"],
                               rtol=1e-13, atol=1e-15)


def test_make_capturable_adam_keeps_state():
    p = nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([p], lr=0.125)
    p.grad = torch.ones(4)
    opt.step()
    step = opt.state[p]["step"]
    make_capturable(opt)
    assert opt.param_groups[0]["capturable"] is True
    st = opt.state[p]["step"]
    assert isinstance(st, torch.Tensor) and st.device == p.device and st.dtype == step.dtype
    assert float(st) == 1.0


def test_lr_tensors_in_restores_on_error():
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": 0.5},
                           {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.25}])
    ts = [torch.tensor(1.0), torch.tensor(2.0)]
    with pytest.raises(RuntimeError):
        with lr_tensors_in(opt, ts):
            assert [g["lr"] for g in opt.param_groups] == ts
            raise RuntimeError("boom")
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.25]
    with pytest.raises(ValueError, match="one LR per param group"):
        with lr_tensors_in(opt, ts[:1]):
            pass


# ------------------------------------------------------------------------------ static buffers
def test_batch_signature():
    x = torch.zeros(4, 3)
    y = torch.zeros(4, dtype=torch.long)
    assert batch_signature((x, y)) == batch_signature((x + 1, y + 1))
    assert batch_signature((x, y)) != batch_signature((torch.zeros(4, 5), y))      # shape
    assert batch_signature((x, y)) != batch_signature((x.double(), y))             # dtype
    assert batch_signature({"a": x}) != batch_signature({"b": x})                  # structure
    assert batch_signature([x, y]) != batch_signature((x, y))
    assert batch_signature((x, ["a", "b", "c", "d"])) is None                      # collated strings
    assert batch_signature({"x": x, "n": 3}) is None


def test_round_parts_is_the_iidp_assignment():
    """VSW v takes micro-batches v*(n_GA+1) .. v*(n_GA+1)+n_GA, round j its j-th: every index
    exactly once, in that place."""
    for n, ga in [(1, 0), (3, 0), (2, 2), (5, 1)]:
        G = ga + 1
        r = round_parts(list(range(n * G)), n, ga)
        assert len(r) == G and all(len(row) == n for row in r)
        assert sorted(i for row in r for i in row) == list(range(n * G))
        assert all(r[j][v] == v * G + j for j in range(G) for v in range(n))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_static_rounds_hold_the_joined_batches_in_place(n):
    """The buffers equal ``join_batches`` of every round (nested structures too), are refilled
    in place (same storage) and never alias the caller's tensors."""
    def batches(seed):
        g = torch.Generator().manual_seed(seed)
        return [[{"x": torch.randn(4, 2, generator=g), "t": (torch.randint(0, 9, (4,), generator=g),)}
                 for _ in range(n)] for _ in range(2)]
    first = batches(0)
    st = StaticRounds(first, torch.device("cpu"))
    ptrs = [b["x"].data_ptr() for b in st.buffers]
    for j in range(2):
        torch.testing.assert_close(st.buffers[j], join_batches(first[j]), rtol=0, atol=0)
    second = batches(1)
    st.fill(second)
    assert [b["x"].data_ptr() for b in st.buffers] == ptrs
    for j in range(2):
        torch.testing.assert_close(st.buffers[j], join_batches(second[j]), rtol=0, atol=0)
        assert all(st.buffers[j]["x"].data_ptr() != p["x"].data_ptr() for p in second[j])
    with pytest.raises(ValueError, match="rounds must hold"):
        st.fill(second[:1])


def test_graph_key_tracks_what_a_capture_depends_on():
    p = [nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD(p, lr=0.125, momentum=0.9)
    sig = batch_signature(torch.zeros(4, 2))
    k = graph_key(2, 1, 4, sig, True, opt, None)
    opt.param_groups[0]["lr"] = 0.5                       # the LR is a device tensor: same key
    assert graph_key(2, 1, 4, sig, True, opt, None) == k
    opt.param_groups[0]["momentum"] = 0.5                 # a constant of the captured kernels
    k2 = graph_key(2, 1, 4, sig, True, opt, None)
    assert k2 != k
    others = [graph_key(3, 1, 4, sig, True, opt, None), graph_key(2, 0, 4, sig, True, opt, None),
              graph_key(2, 1, 8, sig, True, opt, None), graph_key(2, 1, 4, sig, False, opt, None),
              graph_key(2, 1, 4, batch_signature(torch.zeros(4, 3)), True, opt, None),
              graph_key(2, 1, 4, sig, True, opt, 1.0)]
    assert len({k2, *others}) == 7
    hash(k2)


def test_memory_headroom():
    """Pool (W) + a later eager step (W) fit iff free + W >= 2W, with a 10 % margin."""
    from jabasray.engine.graphs import memory_headroom_blocker
    G = 2 ** 30
    assert memory_headroom_blocker(free=10 * G, reserved=5 * G, allocated=1 * G) is None
    assert memory_headroom_blocker(free=int(4.5 * G), reserved=5 * G, allocated=1 * G) is None
    assert "not enough free device memory" in memory_headroom_blocker(free=4 * G, reserved=5 * G,
                                                                      allocated=1 * G)
    assert memory_headroom_blocker(free=0, reserved=G, allocated=G) is None     # nothing cached


def test_refused_key_runs_eagerly_until_cleared():
    c = GraphCache(warmup=1)
    assert [c.decide("a"), c.decide("a")] == ["eager", "capture"]
    c.refuse("a")
    assert c.decide("a") == "eager" and c.decide("a") == "eager" and c.disabled is None
    c.clear()
    assert [c.decide("a"), c.decide("a")] == ["eager", "capture"]


def test_graph_cache_warmup_lru_and_thrash():
    dropped = []
    c = GraphCache(warmup=2, max_graphs=2, max_signatures=3, on_drop=lambda: dropped.append(1))
    assert [c.decide("a") for _ in range(3)] == ["eager", "eager", "capture"]
    c.add("a", "graph-a")
    assert c.decide("a") == "replay" and c.get("a") == "graph-a"
    for k in ("b", "c"):
        c.decide(k), c.decide(k)
        assert c.decide(k) == "capture"
        c.add(k, f"graph-{k}")
    assert list(c.graphs) == ["b", "c"] and dropped == [1]     # LRU: "a" went, after a wait
    assert c.captures == 3 and c.replays == 1
    # a 4th capture due with 1 replay for 3 captures (< 4 per capture): keys change too often
    c.decide("d"), c.decide("d")
    assert c.decide("d") == "eager" and c.disabled.startswith("the step's shapes or optimizer")
    assert not c.graphs and c.decide("b") == "eager"
    c.clear()
    assert c.disabled is not None                              # stays disabled
    # enough replays per capture: a new key is captured
    c2 = GraphCache(warmup=1, max_graphs=1, max_signatures=1)
    c2.decide("a")
    assert c2.decide("a") == "capture"
    c2.add("a", "g")
    for _ in range(4):
        assert c2.decide("a") == "replay"
    c2.decide("b")
    assert c2.decide("b") == "capture" and c2.disabled is None
    # keys that never repeat: never captured, bookkeeping bounded
    c3 = GraphCache(warmup=3, max_signatures=2)
    assert all(c3.decide(("shape", i)) == "eager" for i in range(100))
    assert len(c3.eager_steps) == 8 and c3.captures == 0 and c3.disabled is None
    c4 = GraphCache(warmup=1)
    c4.decide("a")
    c4.clear()
    assert c4.decide("a") == "eager"                           # warm-up counted afresh


# ------------------------------------------------------------------------------ worker (CPU)
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 64, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_worker_option_validation_and_cpu_fallback(caplog):
    with pytest.raises(ValueError, match="cuda_graphs must be one of 'auto', 'off', got 'yes'"):
        IIDPWorker(BNNet(), lambda p: _sgd(p), F.cross_entropy, cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        JobConfig(cuda_graphs=True)
    assert JobConfig().cuda_graphs == "auto"
    w = IIDPWorker(BNNet(), lambda p: _sgd(p, momentum=0.9), F.cross_entropy)
    assert w.cuda_graphs == "auto" and w.graph_fallback_reason() == "device cpu is not CUDA"
    off = IIDPWorker(BNNet(), lambda p: _sgd(p), F.cross_entropy, cuda_graphs="off")
    assert off.graph_fallback_reason() == "cuda_graphs='off'"
    w.configure(2, 0, 4)
    with caplog.at_level(logging.INFO, logger="jabasray.engine.iidp"):
        for step in range(3):
            X, y = make_data(step, 8)
            st = w.train_step(split(X, y, [4, 4]))
            assert st.batched and not st.graphed
    lines = [r.getMessage() for r in caplog.records if "no CUDA graph" in r.getMessage()]
    assert lines == ["IIDP: eager step (no CUDA graph: device cpu is not CUDA)"]
    # the CPU worker keeps the user's optimizer as it is
    assert w.optimizer.param_groups[0]["foreach"] is None and not w.optimizer.param_groups[0]["fused"]
    w.close()
    off.close()


class _FakeGraph:
    """A CPU stand-in for a captured graph: capture RUNS the step once (the real capture runs
    nothing, and its first replay runs it), so the first replay is skipped; every later replay
    runs the step again with gradients dropped first (a replay writes them afresh) and the LRs
    read from the captured LR tensors (as the captured kernels do), and copies its loss and
    metric sums into the static outputs. It exercises the worker's graph path - keys, warm-up,
    static inputs, LR tensors, outputs - not CUDA's memory semantics (the cuda tests do)."""

    def __init__(self, fn, optimizer, out) -> None:
        self.fn, self.opt, self.out, self.first = fn, optimizer, out, True
        self.lrs = [g["lr"] for g in optimizer.param_groups]      # the LR tensors

    def replay(self) -> None:
        if self.first:
            self.first = False
            return
        for g in self.opt.param_groups:
            for p in g["params"]:
                p.grad = None
        with lr_tensors_in(self.opt, self.lrs):
            loss, sums, _ = self.fn()
        self.out[0].copy_(loss)
        for k, v in sums.items():
            self.out[1][k].copy_(v)


def _fake_cuda(monkeypatch, worker):
    from jabasray.engine import graphs

    def capture(fn, stream):
        out = fn()
        return _FakeGraph(fn, worker.optimizer, out), out
    monkeypatch.setattr(graphs, "cuda_capture", capture)
    monkeypatch.setattr(graphs, "worker_graph_blocker", lambda *a: None)
    monkeypatch.setattr(graphs, "new_stream", lambda device: None)
    monkeypatch.setattr(graphs, "device_memory_blocker", lambda device: None)
    monkeypatch.setattr(graphs, "release_cached_memory", lambda device: None)


def _metric_step(model, batch):
    x, t = batch
    out = model(x)
    return F.cross_entropy(out, t), {"acc": (out.argmax(1) == t).double().mean()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_path_equals_eager_on_cpu_with_a_stand_in_graph(monkeypatch, precision):
    """The worker's graph path (warm-up, capture, replays through static inputs and LR
    tensors, outputs copied) equals the eager worker step by step (fp32: a float64 model; bf16:
    a float32 model under autocast, captured without the autocast cache; SGD switched to fused,
    BatchNorm per VSW): through an LR change, an lr_factor change, a reconfiguration and a
    ragged (eager) step; training metrics summed alike."""
    ws = {}
    for mode in ("auto", "off"):
        torch.manual_seed(0)
        net = BNNet().double() if precision == "fp32" else BNNet()
        ws[mode] = IIDPWorker(net, lambda p: _sgd(p, momentum=0.9, weight_decay=1e-2),
                              None, step_fn=_metric_step, cuda_graphs=mode, precision=precision)
    _fake_cuda(monkeypatch, ws["auto"])
    plan = ([("cfg", (2, 1, 3))] + [("step", None)] * 5 + [("lr", 0.0625), ("step", None),
            ("factor", 0.5), ("step", None), ("cfg", (3, 0, 3))] + [("step", None)] * 4
            + [("ragged", [3, 2, 1]), ("step", None)])
    out = {m: [] for m in ws}
    graphed, step = [], 0
    for what, arg in plan:
        for mode, w in ws.items():
            if not _reconfigure(w, what, arg):
                sizes = arg or [3] * w.num_workers
                X, y = make_data(step, sum(sizes))
                X = X.double() if precision == "fp32" else X
                st = w.train_step(split(X, y, sizes), ragged=what == "ragged")
                out[mode].append((st.loss, float(st.metric_sums["acc"]), st.metric_counts["acc"]))
                if mode == "auto":
                    graphed.append(st.graphed)
        step += what in ("step", "ragged")
    assert graphed == [False] * 3 + [True] * 4 + [False] * 3 + [True] + [False, True]
    # float64: fused and foreach SGD round alike; float32 (bf16 autocast): to float32 rounding
    rtol, atol = (1e-12, 1e-14) if precision == "fp32" else (1e-5, 1e-6)
    for (la, ma, ca), (lb, mb, cb) in zip(out["auto"], out["off"]):
        assert la == pytest.approx(lb, rel=rtol * 100) and ma == pytest.approx(mb, rel=rtol) and ca == cb
    a, b = ws["auto"], ws["off"]
    assert a.optimizer.param_groups[0]["fused"] is True
    for ra, rb in zip(a.replicas(), b.replicas()):
        for (k, ta), (_, tb) in zip(ra.state_dict().items(), rb.state_dict().items()):
            torch.testing.assert_close(ta, tb, rtol=rtol, atol=atol, msg=k)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(a.optimizer.state[pa]["momentum_buffer"],
                                   b.optimizer.state[pb]["momentum_buffer"], rtol=rtol, atol=atol)
    for w in ws.values():
        w.close()


def test_failed_capture_falls_back_for_good_with_one_line(monkeypatch, caplog):
    torch.manual_seed(0)
    w = IIDPWorker(BNNet(), lambda p: _sgd(p, momentum=0.9), F.cross_entropy)
    _fake_cuda(monkeypatch, w)
    from jabasray.engine import graphs

    def broken(fn, stream):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(graphs, "cuda_capture", broken)
    w.configure(2, 0, 4)
    with caplog.at_level(logging.INFO, logger="jabasray.engine.iidp"):
        for step in range(6):
            X, y = make_data(step, 8)
            st = w.train_step(split(X, y, [4, 4]))
            assert not st.graphed and st.batched
    lines = [r.getMessage() for r in caplog.records if "no CUDA graph" in r.getMessage()]
    assert lines == ["IIDP: eager step (no CUDA graph: capture failed (RuntimeError: "
                     "operation not permitted when stream is capturing))"]
    w.close()


# ------------------------------------------------------------------------------ GPU
class MLPBN(nn.Module):
    """Linear-BatchNorm1d-ReLU-Linear (BatchNorm per VSW in the batched pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


GPU_OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.125, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=0.0625, weight_decay=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.0625, weight_decay=1e-2),
}
# SGD in float64: the same arithmetic (fused vs foreach kernels round alike). Adam/AdamW in
# float32 (their common dtype): with capturable=True they compute the bias corrections on the
# device from float32 step counters, the eager reference in Python floats: relative
# differences ~1e-7 per step.
GPU_TOL = {"sgd": 1e-10, "adam": 1e-4, "adamw": 1e-4}
GPU_DTYPE = {"sgd": torch.float64, "adam": torch.float32, "adamw": torch.float32}


def _gpu_batches(step: int, k: int, b: int, sizes=None):
    g = torch.Generator().manual_seed(100 + step)
    sizes = sizes or [b] * k
    X = torch.randn(sum(sizes), 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (sum(sizes),), generator=g)
    return split(X.cuda(), y.cuda(), sizes)


@pytest.mark.cuda
@pytest.mark.parametrize("opt", sorted(GPU_OPTIMIZERS))
def test_cuda_graphed_equals_eager(opt):
    """A worker replaying captured steps equals an eager worker step by step: the
    losses of every step, weights, optimizer state, every VSW's BatchNorm statistics - through
    an LR change (set_lr) and an lr_factor change between replays, a reconfiguration to another
    n_vsw (new capture), a ragged step (eager, per VSW) between replays."""
    ws = {}
    for mode in ("auto", "off"):
        torch.manual_seed(0)
        ws[mode] = IIDPWorker(MLPBN().to(GPU_DTYPE[opt]).cuda(), GPU_OPTIMIZERS[opt], F.cross_entropy,
                              device="cuda", cuda_graphs=mode)
    plan = ([("cfg", (2, 1, 4))] + [("step", None)] * 6 + [("lr", 0.03125)] + [("step", None)] * 2
            + [("factor", 2.0)] + [("step", None)] * 2 + [("cfg", (3, 0, 4))] + [("step", None)] * 5
            + [("ragged", [4, 3, 2])] + [("step", None)] * 2)
    # (the ragged step's last VSW holds 2 samples: BatchNorm in training mode refuses one, in a
    # plain loop as in the engine)
    losses = {m: [] for m in ws}
    graphed = []
    step = 0
    for what, arg in plan:
        for mode, w in ws.items():
            if not _reconfigure(w, what, arg):
                k = w.num_workers
                mbs = [(x.to(GPU_DTYPE[opt]), t)
                       for x, t in _gpu_batches(step, k, 4, arg if what == "ragged" else None)]
                st = w.train_step(mbs, ragged=what == "ragged")
                losses[mode].append(st.loss_raw)
                if mode == "auto":
                    graphed.append(st.graphed)
                else:
                    assert not st.graphed
        step += what in ("step", "ragged")
    # warm-up 3 eager steps per configuration, then replays; the ragged step eager
    assert graphed == [False] * 3 + [True] * 7 + [False] * 3 + [True] * 2 + [False] + [True] * 2
    tol = GPU_TOL[opt]
    la, lb = read_losses(losses["auto"]), read_losses(losses["off"])
    assert la == pytest.approx(lb, rel=tol)
    a, b = ws["auto"], ws["off"]
    for ra, rb in zip(a.replicas(), b.replicas()):
        for (k, ta), (_, tb) in zip(ra.state_dict().items(), rb.state_dict().items()):
            torch.testing.assert_close(ta, tb, rtol=tol, atol=tol, msg=k)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sb[i]:
            torch.testing.assert_close(torch.as_tensor(sa[i][k]).cpu().double(),
                                       torch.as_tensor(sb[i][k]).cpu().double(), rtol=tol, atol=tol,
                                       msg=f"{i}.{k}")
    for w in ws.values():
        w.close()


@pytest.mark.cuda
def test_cuda_graphed_steady_state_does_not_synchronise():
    """Replays (including an LR change between them) never synchronise with the host."""
    torch.manual_seed(0)
    w = IIDPWorker(MLPBN().cuda(), GPU_OPTIMIZERS["sgd"], F.cross_entropy, device="cuda")
    w.configure(4, 1, 8)
    k = w.num_workers
    data = [[(x.float(), y) for x, y in _gpu_batches(s, k, 8)] for s in range(9)]
    for mbs in data[:4]:                       # warm-up and capture
        w.train_step(mbs)
    torch.cuda.synchronize()
    raw = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, mbs in enumerate(data[4:]):
            if i == 2:
                w.set_lr(0.0625)
            st = w.train_step(mbs)
            assert st.graphed
            raw.append(st.loss_raw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    losses = read_losses(raw)
    assert len(losses) == 5 and all(l == l and l > 0 for l in losses)
    w.close()
