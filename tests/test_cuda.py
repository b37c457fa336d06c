"""The CUDA code paths on a real GPU: every test is ``@pytest.mark.cuda`` and is
skipped (reported as skipped) where ``torch.cuda.is_available()`` is False. Tiny models, a few
steps each, no Ray: the whole file runs in seconds on one GPU.

    python -m pytest -q -m cuda tests/test_cuda.py
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from engine_reference import OPTIMIZERS, make_data, make_model, max_rel_diff, reference_step, split
from jabasray.engine import IIDPWorker
from jabasray.engine.stats import read_losses
from jabasray.engine.multiplex import (GRAPH_WARMUP_STEPS, BackgroundRunner, BackgroundTask, MultiplexPolicy,
                                       epoch_order)

pytestmark = pytest.mark.cuda

DEV = "cuda"
CAP = 0.0005          # MiB: several buckets
TOL = 1e-5


@pytest.fixture(autouse=True)
def _exact_fp32():
    """No TF32 (cuDNN convolutions use it by default): the equalities below compare fp32
    results of different batch shapes / kernels at 1e-5."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _nccl_group():
    """A one-rank NCCL process group (no global init, nothing to tear down)."""
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    return dist.ProcessGroupNCCL(dist.HashStore(), 0, 1)


def _to(batches):
    return [(x.to(DEV), y.to(DEV)) for x, y in batches]


def _bg_task(name="bg", steps=20, batch_size=8, n=40, capturable=False, opt="sgd", seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).to(DEV)
    g = torch.Generator().manual_seed(123)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))
    if opt == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=capturable)
    return BackgroundTask(name=name, model=model, dataset=ds, optimizer=optimizer,
                          loss_fn=F.cross_entropy, batch_size=batch_size, steps=steps)


def _plain_loop(task: BackgroundTask, model0: nn.Module, opt_fn, steps: int) -> nn.Module:
    """The background job's documented data order (epoch_order slices), trained eagerly."""
    model = copy.deepcopy(model0)
    opt = opt_fn(model.parameters())
    X, Y = task.dataset.tensors
    n, epoch, cursor = len(Y), 0, 0
    perm = epoch_order(n, task.seed, epoch)
    for _ in range(steps):
        idx = perm[cursor:cursor + task.batch_size]
        cursor += len(idx)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(X[idx].to(DEV)), Y[idx].to(DEV)).backward()
        opt.step()
        if cursor >= n:
            epoch, cursor = epoch + 1, 0
            perm = epoch_order(n, task.seed, epoch)
    return model


# ------------------------------------------------------------------------------- IIDP

@pytest.mark.parametrize("execution", ["auto", "threads"])
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("method", ["sws", "ows"])
@pytest.mark.parametrize("num_vsw,num_ga", [(1, 0), (2, 1), (4, 0)])
def test_iidp_on_streams_equals_plain_step(opt, method, num_vsw, num_ga, execution):
    """VSWs on their own CUDA streams (+ OWS's side stream) == one plain step on the union,
    with the CUDA default scheme (one issuing thread) and with one thread per VSW."""
    b = 4
    ref = make_model(0).to(DEV)
    ref_opt = OPTIMIZERS[opt](list(ref.parameters()))
    w = IIDPWorker(make_model(0), OPTIMIZERS[opt], F.cross_entropy, device=DEV,
                   weight_sync=method, bucket_cap_mb=CAP, vsw_execution=execution)
    assert w.vsw_execution == ("one_thread" if execution == "auto" else execution)
    w.configure(num_vsw, num_ga, b)
    n = num_vsw * (num_ga + 1)
    for step in range(3):
        X, y = make_data(step, n * b)
        X, y = X.to(DEV), y.to(DEV)
        w.train_step(split(X, y, [b] * n))
        reference_step(ref, ref_opt, X, y)
        assert max_rel_diff(w.model, ref) < TOL
    w.close()


@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
def test_segmented_graph_step_with_nccl_equals_eager_step_without_host_sync(opt):
    """A world-size-1 NCCL group: the segmented step (graph segments, bucket all-reduces
    between them) equals the eager step with the communication thread, step by step and
    through a reconfiguration; its steady-state steps never synchronise the host
    (``set_sync_debug_mode("error")`` raises on any synchronising call)."""
    ws = {mode: IIDPWorker(make_model(0, batch_norm=True), OPTIMIZERS[opt], F.cross_entropy, device=DEV,
                           bucket_cap_mb=CAP, process_group=_nccl_group(), segmented=mode)
          for mode in ("auto", "off")}
    plan = [(2, 1, 4)] * 6 + [(3, 0, 5)] * 6
    graphed = []
    for step, cfg in enumerate(plan):
        X, y = make_data(step, cfg[0] * (cfg[1] + 1) * cfg[2])
        mbs = _to(split(X, y, [cfg[2]] * (cfg[0] * (cfg[1] + 1))))
        losses = {}
        for mode, w in ws.items():
            if step == 0 or cfg != plan[step - 1]:
                w.configure(*cfg)
            st = w.train_step(mbs)
            losses[mode] = st.loss
            if mode == "auto":
                graphed.append(st.graphed)
        assert losses["auto"] == pytest.approx(losses["off"], rel=1e-5)
        assert max_rel_diff(ws["auto"].model, ws["off"].model) < TOL, step
    assert graphed == ([False] * 3 + [True] * 3) * 2, graphed
    w = ws["auto"]
    batches = [_to(split(*make_data(100 + step, 15), [5] * 3)) for step in range(3)]
    torch.cuda.synchronize()
    raw = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches:
            st = w.train_step(b)
            assert st.graphed
            raw.append(st.loss_raw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(read_losses(raw)) == 3
    for w in ws.values():
        w.close()


@pytest.mark.parametrize("method", ["sws", "ows"])
def test_iidp_ragged_step_with_nccl_equals_plain_step(method):
    """Ragged last step (an empty VSW, an empty last micro-batch) over a one-rank NCCL group."""
    ref = make_model(0).to(DEV)
    ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
    w = IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy, device=DEV,
                   weight_sync=method, bucket_cap_mb=CAP, process_group=_nccl_group())
    w.configure(2, 2, 4)
    X, y = make_data(1, 24)
    w.train_step(_to(split(X, y, [4] * 6)))
    reference_step(ref, ref_opt, X.to(DEV), y.to(DEV))
    sizes = [4, 1, 0, 0, 0, 0]
    X, y = make_data(2, sum(sizes))
    st = w.train_step(_to(split(X, y, sizes)), ragged=True)
    ref_loss = reference_step(ref, ref_opt, X.to(DEV), y.to(DEV))
    assert st.loss == pytest.approx(ref_loss, rel=1e-5)
    assert max_rel_diff(w.model, ref) < TOL
    w.close()


def test_sws_equals_ows_on_cuda():
    ws = {}
    for method in ("sws", "ows"):
        w = IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy, device=DEV,
                       weight_sync=method, bucket_cap_mb=CAP, process_group=_nccl_group())
        w.configure(2, 1, 4)
        for step in range(3):
            X, y = make_data(step, 16)
            w.train_step(_to(split(X, y, [4] * 4)))
        ws[method] = w
    assert max_rel_diff(ws["ows"].model, ws["sws"].model) < TOL
    for w in ws.values():
        w.close()


@pytest.mark.parametrize("method", ["sws", "ows"])
def test_iidp_with_nccl_guard_and_background_job_equals_plain_step(method, monkeypatch):
    """A background job runs on the device while IIDP steps all-reduce over NCCL with the
    runner's ``foreground_critical`` as ``comm_guard`` (entered on the communication thread,
    never inside backward): every step finishes (no deadlock, bounded wait), equals a plain
    step on the union, and the background job made progress. No thread but the background's
    own waits on a background event on the host (the pause is a device-side wait; counted)."""
    policy = MultiplexPolicy(slowdown_target=None, cuda_graphs=False, max_background_batch=None)
    host_waits: list[str] = []
    real_sync = torch.cuda.Event.synchronize

    def counting_sync(ev):
        if threading.current_thread().name != "jabas-background":
            host_waits.append(threading.current_thread().name)
        return real_sync(ev)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", counting_sync)
    with BackgroundRunner(DEV, policy) as runner:
        task = _bg_task(steps=100_000)
        runner.submit(task)
        ref = make_model(0).to(DEV)
        ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
        w = IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy, device=DEV,
                       weight_sync=method, bucket_cap_mb=CAP, process_group=_nccl_group(),
                       comm_guard=runner.foreground_critical)
        w.configure(2, 1, 4)
        diffs: list[float] = []
        errors: list[BaseException] = []

        def foreground():
            try:
                for step in range(4):
                    X, y = make_data(step, 16)
                    X, y = X.to(DEV), y.to(DEV)
                    w.train_step(split(X, y, [4] * 4))
                    reference_step(ref, ref_opt, X, y)
                    diffs.append(max_rel_diff(w.model, ref))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=foreground, daemon=True)
        t.start()
        t.join(timeout=120)
        assert not t.is_alive(), "IIDP steps next to a background job did not finish (deadlock?)"
        assert not errors, errors
        assert len(diffs) == 4 and max(diffs) < TOL
        assert host_waits == []
        st = runner.cancel("bg")
        assert st.step > 0 and st.error is None
        w.close()


# ------------------------------------------------------------------------------- priorities

def test_stream_priorities_are_actually_set():
    """VSW/comm/update lanes (IIDP, SMA) and the runner's foreground stream are at the greatest
    priority, the background stream at the least, and the two differ."""
    from jabasray.engine.streams import stream_priorities

    fg, bg = stream_priorities(torch.cuda.Stream.priority_range())
    assert fg < bg, f"this GPU reports no usable priority range {torch.cuda.Stream.priority_range()}"
    w = IIDPWorker(make_model(0), OPTIMIZERS["sgd_momentum"], F.cross_entropy, device=DEV,
                   bucket_cap_mb=CAP)
    w.configure(3, 0, 4)
    lanes = w._lanes
    assert [s.priority for s in lanes.vsw] == [fg] * 3
    assert lanes.comm.priority == fg and lanes.update.priority == fg
    w.close()
    with BackgroundRunner(DEV, MultiplexPolicy()) as runner:
        assert runner.bg_stream.priority == bg
        assert runner.foreground_stream.priority == fg
    with BackgroundRunner(DEV, MultiplexPolicy.naive()) as runner:   # priorities off
        assert runner.bg_stream.priority == 0
        assert runner.foreground_stream == torch.cuda.current_stream()


# ------------------------------------------------------------------------------- background job

@pytest.mark.parametrize("opt,graphs,expect_graphed,pieces", [
    ("sgd", False, False, 1),            # eager
    ("sgd", True, True, 1),              # SGD is capturable
    ("adam_capturable", True, True, 1),  # Adam(capturable=True) is capturable
    ("adam", True, False, 1),            # plain Adam: not captured, runs eagerly
    ("sgd", True, True, 4),              # the graph in pieces, launched one at a time
    ("adam_capturable", True, True, 3),
])
def test_background_job_equals_plain_loop_with_and_without_graphs(opt, graphs, expect_graphed, pieces):
    """A background job on the low-priority stream, eager or replaying a CUDA graph, does
    exactly the plain loop's steps: the graph warm-up is the job's own first steps and capture
    adds no training step (weights after N steps == N eager steps). A ragged last batch of an
    epoch runs eagerly next to the graph."""
    steps = GRAPH_WARMUP_STEPS + 8
    task = _bg_task(steps=steps, batch_size=16, n=40, opt="sgd" if opt == "sgd" else "adam",
                    capturable=opt == "adam_capturable")
    model0 = copy.deepcopy(task.model)
    if opt == "sgd":
        opt_fn = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    else:
        opt_fn = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    ref = _plain_loop(task, model0, opt_fn, steps)
    policy = MultiplexPolicy(cuda_graphs=graphs, slowdown_target=None, max_background_batch=None,
                             graph_pieces=pieces)
    with BackgroundRunner(DEV, policy) as runner:
        runner.submit(task)
        st = runner.wait("bg", timeout=120)
    assert st.state == "done" and st.step == steps, st
    assert st.graphed is expect_graphed
    assert max_rel_diff(task.model, ref) < TOL


# ------------------------------------------------------------------------------- profiler

def test_profiler_probes_n_max_up_to_the_memory_limit():
    """With the process's GPU memory capped at 1 GiB (set_per_process_memory_fraction), the
    profiler's n_max probe ends at the out-of-memory limit (well below its bound of
    CUDA_NUM_VSW_BOUND), n_max VSWs really fit, and the probe leaves the device usable."""
    from jabasray.profiler.measure import CUDA_NUM_VSW_BOUND, profile_model

    def model():
        torch.manual_seed(0)
        # 64 MiB of weights: each VSW adds ~128 MiB (weights + gradients), so ~6 fit in 1 GiB
        return nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))

    def data(n):
        g = torch.Generator().manual_seed(n)
        return torch.randn(n, 4096, generator=g), torch.randint(0, 10, (n,), generator=g)

    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    # 1 GiB beyond what earlier tests of this process still hold (the cap counts all of it)
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 2 ** 30) / total)
    try:
        prof = profile_model(model, data, device=DEV, min_local_batch=64, max_local_batch=128,
                             warmup=0, repeats=1, allreduce=False)
        n_max = [b.max_num_vsw for b in prof.batches]
        assert len(n_max) == 2 and all(1 < n < CUDA_NUM_VSW_BOUND for n in n_max), n_max
        w = IIDPWorker(model(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                       F.cross_entropy, device=DEV)
        w.configure(n_max[0], 0, 64)
        x, y = data(64)
        w.train_step([(x, y)] * n_max[0])           # n_max fits
        w.close()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------- SMA

@pytest.mark.parametrize("overlap_sync", [False, True])
def test_sma_on_streams_equals_sma_on_cpu(overlap_sync):
    """Crossbow SMA learners on their own streams (global sync on a side stream, overlapping the
    next iteration with ``overlap_sync``) compute what the CPU path computes."""
    from jabasray.engine.sma import SMAWorker

    out = {}
    for dev in ("cpu", DEV):
        w = SMAWorker(make_model(1), F.cross_entropy, lr=0.05, momentum=0.9, device=dev,
                      overlap_sync=overlap_sync if dev == DEV else False)
        w.configure(num_vsw=3, num_ga=1, local_batch_size=4)
        for step in range(4):
            X, y = make_data(100 + step, 6 * 4)
            w.train_step([(a.to(dev), t.to(dev)) for a, t in split(X, y, [4] * 6)])
        if dev == DEV:
            torch.cuda.synchronize()
        out[dev] = copy.deepcopy(w.model).cpu()
    assert max_rel_diff(out[DEV], out["cpu"]) < 1e-4


def test_sma_training_metrics_on_streams_equal_cpu():
    """Training metrics of SMA learners on their own streams (one (sums, counts) per learner,
    merged after the learners finish) equal the CPU path's, step after step."""
    from jabasray.engine.sma import SMAWorker

    def step(m, batch):
        x, y = batch
        out = m(x)
        return F.cross_entropy(out, y), {"label": y.double().mean(), "acc": (out.argmax(1) == y).double().mean()}

    got = {}
    for dev in ("cpu", DEV):
        w = SMAWorker(make_model(2), F.cross_entropy, lr=0.05, momentum=0.9, device=dev)
        w.step_fn = step
        w.configure(num_vsw=3, num_ga=1, local_batch_size=4)
        sums = []
        for k in range(3):
            X, y = make_data(200 + k, 6 * 4)
            st = w.train_step([(a.to(dev), t.to(dev)) for a, t in split(X, y, [4] * 6)])
            sums.append(({n: float(v) for n, v in st.metric_sums.items()}, dict(st.metric_counts)))
        got[dev] = sums
    for (a, ca), (b, cb) in zip(got["cpu"], got[DEV]):
        assert ca == cb == {"label": 24, "acc": 24}
        assert a["label"] == b["label"] and abs(a["acc"] - b["acc"]) <= 1.0   # argmax ties may flip one


# ------------------------------------------------------------------------------- pack

@pytest.mark.parametrize("execution", ["auto", "vmap"])
def test_packed_members_equal_members_trained_alone(execution):
    """K packed members (folded batched kernels / vmap, fused SGD / Adam / Adagrad updates,
    misaligned batch sizes) on the GPU == each member trained alone on the GPU."""
    from jabasray.engine.packing import pack
    from jabasray.models import MLP

    makers = [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
              lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.Adagrad(p, lr=0.05)]
    models, alone = [], []
    for k in range(4):
        torch.manual_seed(k)
        m = MLP(act=("relu", "tanh")[k % 2]).to(DEV)
        models.append(m)
        alone.append(copy.deepcopy(m))
    opts = [makers[k](m.parameters()) for k, m in enumerate(models)]
    alone_opts = [makers[k](m.parameters()) for k, m in enumerate(alone)]
    sizes = [32, 16, 32, 8]
    p = pack(models, opts, sizes, loss_fn=F.cross_entropy, execution=execution)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        X = torch.randn(32, 64, generator=g).to(DEV)
        y = torch.randint(0, 10, (32,), generator=g).to(DEV)
        p.train_step(X, y)
        for k, m in enumerate(alone):
            alone_opts[k].zero_grad()
            F.cross_entropy(m(X[:sizes[k]]), y[:sizes[k]]).backward()
            alone_opts[k].step()
    for k in range(4):
        mk, _ = p.free(k)
        assert max_rel_diff(mk, alone[k]) < 1e-4
