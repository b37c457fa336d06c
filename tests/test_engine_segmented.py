"""The segmented step (engine.segmented) against the unsegmented eager step, over gloo.

Each rank runs the same schedule twice from the same initial weights: once with
``segmented="on"`` (CPU: the batched step's segments run eagerly in capture order, each
bucket's all-reduce issued at its boundary on the step's thread) and once with
``segmented="off"`` (the eager step: the communication thread all-reduces the buckets). The
ranks host different layouts, and the layouts and B_L change between phases; a ragged last
step runs eagerly in both. Weights and losses must agree in float64 after every phase, and
the segmented worker must have issued all-reduces while its backward was still running
(bucket boundaries inside backward), for 2 and 3 ranks.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_reference import OPTIMIZERS, make_data, make_model, max_rel_diff, run_gloo_ranks, split
from jabasray.engine.execution import choose_execution

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

# world size -> phases of (per-rank (num_vsw, num_ga), local batch size, steps)
SCHEDULES = {
    2: [(((2, 1), (3, 0)), 4, 2), (((1, 0), (2, 2)), 3, 2)],
    3: [(((2, 0), (1, 1), (3, 0)), 2, 2), (((3, 1), (2, 0), (1, 0)), 5, 1)],
}
# world size -> (optimizer, weight sync, BatchNorm)
SCENARIOS = {2: ("sgd_momentum", "sws", False), 3: ("adam", "ows", True)}


def _steps(world: int):
    """(per-rank layouts, B_L, per-rank micro-batch sizes, ragged) of every step."""
    for layouts, B, steps in SCHEDULES[world]:
        for _ in range(steps):
            yield layouts, B, [[B] * (n * (ga + 1)) for n, ga in layouts], False
    layouts, B, _ = SCHEDULES[world][-1]
    yield layouts, B, [[max(0, B - 1 - r)] + [B] * (n * (ga + 1) - 1)
                       for r, (n, ga) in enumerate(layouts)], True


def _run(rank: int, world: int, opt_name: str, method: str, bn: bool, mode: str) -> dict:
    from jabasray.engine import IIDPWorker
    w = IIDPWorker(make_model(0, batch_norm=bn), OPTIMIZERS[opt_name], F.cross_entropy,
                   process_group=dist.group.WORLD, weight_sync=method, bucket_cap_mb=0.0005,
                   segmented=mode)
    issued_in_backward: list[bool] = []
    real = w._segments._all_reduce

    def spy(b: int) -> None:
        issued_in_backward.append(any(v.counting for v in w._vsws))
        real(b)
    w._segments._all_reduce = spy
    losses, weights, configured = [], [], None
    for step, (layouts, B, sizes, ragged) in enumerate(_steps(world)):
        if configured != (layouts[rank], B):
            if configured is not None:
                weights.append({k: v.clone() for k, v in w.model.state_dict().items()})
            w.configure(*layouts[rank], B)
            configured = (layouts[rank], B)
        X, y = make_data(300 + step, sum(map(sum, sizes)))
        offset = sum(sum(s) for s in sizes[:rank])
        st = w.train_step(split(X[offset:], y[offset:], sizes[rank]), ragged=ragged)
        losses.append(st.loss)
    weights.append({k: v.clone() for k, v in w.model.state_dict().items()})
    nb = len(w.bucket_plan)
    w.close()
    return {"losses": losses, "weights": weights, "in_backward": issued_in_backward, "buckets": nb}


def _body(rank: int) -> dict:
    world = dist.get_world_size()
    o, m, bn = SCENARIOS[world]
    return {mode: _run(rank, world, o, m, bn, mode) for mode in ("on", "off")}


@pytest.mark.parametrize("world", [2, 3])
def test_segmented_step_equals_unsegmented_step_over_gloo(tmp_path, world):
    got = run_gloo_ranks(_body, tmp_path, world=world)
    segmented_steps = sum(1 for *_, ragged in _steps(world) if not ragged)
    o, m, bn = SCENARIOS[world]
    for r in range(world):
        seg, ref = got[r]["on"], got[r]["off"]
        assert seg["buckets"] >= 3, "the test needs several buckets"
        # every bucket of every non-ragged step all-reduced between segments, some of
        # them while backward still ran; the unsegmented worker never took that path
        assert len(seg["in_backward"]) == segmented_steps * seg["buckets"]
        assert any(seg["in_backward"])
        assert ref["in_backward"] == []
        assert seg["losses"] == pytest.approx(ref["losses"], rel=1e-12)
        for a, b in zip(seg["weights"], ref["weights"], strict=True):
            ma, mb = make_model(1, batch_norm=bn), make_model(2, batch_norm=bn)
            ma.load_state_dict(a)
            mb.load_state_dict(b)
            assert max_rel_diff(ma, mb) < 1e-12, (o, m, r)
            for k in a:                       # BatchNorm running statistics too
                torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-15)


def _choice(**kw):
    base = dict(num_vsw=2, ragged=False, keep_local_grad=False, per_sample_loss=True, coupling=(),
                forced=None, graph_mode="auto", segmented="on", device=torch.device("cpu"),
                precision="fp32", process_group=object(), flat_grads=True, hooks_enabled=True,
                sync_timing=False, optimizer=None, graphs_disabled=None)
    base.update(kw)
    return choose_execution(**base)


def test_choose_execution_says_why():
    """One decision per step, with its reasons: segments with a process group where the step
    is batched; the eager step otherwise, naming why not segments and why not batched."""
    assert _choice().execution == "segmented"
    assert not _choice().capturable                        # CPU: eager segments, nothing captured
    cuda = torch.device("cuda")                            # (no device is touched)
    c = _choice(device=cuda)
    assert c.execution == "segmented" and c.capturable
    c = _choice(device=cuda, ragged=True)                  # eager, but the worker captures others
    assert c.execution == "per_vsw" and c.capturable and c.graph_why.startswith("ragged")
    c = _choice(device=cuda, precision="fp16")
    assert c.execution == "batched" and not c.capturable and "GradScaler" in c.graph_why
    c = _choice(device=cuda, process_group=None)
    assert c.execution == "batched" and c.graph_why.startswith("flat_grads=True")
    assert _choice(device=cuda, process_group=None, flat_grads=False).execution == "graphed"
    c = _choice(ragged=True)
    assert (c.execution, c.graph_why, c.batch_why) == (
        "per_vsw", "ragged step (micro-batches of unequal size)", "ragged step (micro-batches of unequal size)")
    c = _choice(keep_local_grad="split")
    assert c.execution == "per_vsw" and c.batch_why == "the similarity groups split the VSWs"
    c = _choice(keep_local_grad=True)
    assert c.execution == "batched" and c.graph_why == "the step keeps its local gradient (similarity)"
    c = _choice(segmented="auto")
    assert c.execution == "batched" and c.graph_why == "device cpu is not CUDA"
    c = _choice(segmented="off")
    assert c.execution == "batched" and c.graph_why == "device cpu is not CUDA"
    c = _choice(segmented="off", graph_mode="off")
    assert (c.execution, c.graph_why, c.batch_why) == ("batched", None, None)
    c = _choice(hooks_enabled=False)
    assert c.execution == "batched" and "hooks" in c.graph_why
    c = _choice(process_group=None)
    assert c.execution == "batched" and c.graph_why == "device cpu is not CUDA"
    c = _choice(process_group=None, per_sample_loss=False)
    assert c.execution == "per_vsw" and c.batch_why.startswith("per_sample_loss=False")


class _FakeGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph`` that records capture begins and ends (the
    ops between them run eagerly, as a real capture would record them)."""

    log: list = []

    def capture_begin(self, pool=None, capture_error_mode=None) -> None:
        _FakeGraph.log.append(("begin", self))

    def capture_end(self) -> None:
        _FakeGraph.log.append(("end", self))


def test_segment_capture_cuts_at_bucket_boundaries_on_cpu(monkeypatch):
    """The CUDA capture of the segmented step, run on CPU with a stand-in graph: the step's
    body runs once (a real capture records it), cut where buckets become ready - every
    bucket in exactly one segment, in plan order, graphs begun and ended in pairs, then the
    update graph - and that body's arithmetic (loss weight n, the sum scaled by 1/global
    workers, the optimizer step) equals the eager batched step in float64."""
    import contextlib

    from jabasray.engine import IIDPWorker, segmented
    from jabasray.engine.graphs import round_parts
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(segmented, "new_stream", lambda device: None)
    _FakeGraph.log = []
    # (an LR exact in float32: the captured optimizer reads it from a float32 device tensor)
    sgd = lambda p: torch.optim.SGD(p, lr=0.125, momentum=0.9, weight_decay=1e-3)  # noqa: E731
    ws = [IIDPWorker(make_model(0, batch_norm=True), sgd, F.cross_entropy,
                     bucket_cap_mb=0.0005, flat_grads=True, cuda_graphs="off") for _ in range(2)]
    for w in ws:
        w.configure(3, 1, 2)
    for step in range(3):                       # eager steps: the hooks' order is traced
        X, y = make_data(step, 12)
        for w in ws:
            w.train_step(split(X, y, [2] * 6))
    X, y = make_data(9, 12)
    mbs = split(X, y, [2] * 6)
    ref = ws[1].train_step(mbs)
    w = ws[0]
    cap = w._segments.capture(round_parts(mbs, 3, 1))
    nb = len(w.bucket_plan)
    assert nb >= 3
    order = [b for seg in cap.segments for b in seg.buckets]
    assert order == list(range(nb))             # each bucket once, in plan order
    # cuts inside backward: more than one segment of buckets (after-backward completion
    # alone would merge them all into one), and the loss's own last segment
    assert 3 <= len(cap.segments) <= nb + 1 and cap.segments[-1].buckets == []
    kinds = [k for k, _ in _FakeGraph.log]
    assert kinds == ["begin", "end"] * (len(cap.segments) + 1)
    assert [g for k, g in _FakeGraph.log if k == "end"][:-1] == [s.graph for s in cap.segments]
    loss = cap.outputs[0].reshape(()) / w.global_num_workers
    assert float(loss) == pytest.approx(float(ref.loss), rel=1e-12)
    assert max_rel_diff(w.model, ws[1].model) < 1e-12
    for w in ws:
        w.close()
