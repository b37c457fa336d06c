"""Batched VSW execution (engine/batched.py, engine/vsw_norm.py) equals per-VSW execution.

Reference: the same worker forced to per-VSW execution (``vsw_execution="threads"``), which
tests/test_engine_iidp.py and test_engine_vsw_execution.py prove equal to a plain step on the
union of the micro-batches (BatchNorm per micro-batch). Compared in float64 after several
steps: every step's loss, the local gradient sum before aggregation, the weights, the
optimizer state, EVERY VSW's BatchNorm running statistics and eval-mode outputs. Without
BatchNorm the batched worker is also checked against the plain step on the union directly.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_reference import OPTIMIZERS, clone, make_data, make_model, max_rel_diff, reference_step, split
from jabasray.engine import IIDPWorker
from jabasray.engine.batched import batch_fallback_reason, join_batches
from jabasray.engine.vsw_norm import coupling_modules

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

CAP = 0.0005          # MiB: several buckets
STEPS = 3


class NormMLP(nn.Module):
    """Linear -> BatchNorm1d (configurable) -> ReLU -> Linear on 8x8 inputs."""

    def __init__(self, **bn) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 16, bias=False)    # (see Conv3BN)
        self.bn = nn.BatchNorm1d(16, **bn)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x.flatten(1)))))


class Conv3BN(nn.Module):
    """Conv -> BatchNorm2d (configurable) -> Conv -> BatchNorm2d -> Linear (two BN layers).

    The convolutions have no bias, as in ResNets: a bias before BatchNorm has an analytically
    zero gradient, so its computed gradient is pure rounding noise, which Adam normalises into
    lr-sized steps (g / (sqrt(v) + eps)) - noise that differs between any two summation orders
    and says nothing about the engine."""

    def __init__(self, norm=nn.BatchNorm2d, **bn) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(1, 3, 3, padding=1, bias=False), norm(3, **bn)
        self.c2, self.n2 = nn.Conv2d(3, 4, 3, padding=1, bias=False), norm(4, **bn)
        self.fc = nn.Linear(4 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.n1(self.c1(x)))
        x = F.max_pool2d(torch.relu(self.n2(self.c2(x))), 2)
        return self.fc(x.flatten(1))


class SharedBN(nn.Module):
    """One BatchNorm2d called twice per forward and one never called: every VSW's
    ``num_batches_tracked`` must count calls, as the stock forward does (the batched step
    counts the batch for all layers at once and corrects for these two)."""

    def __init__(self, **bn) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 3, 3, padding=1, bias=False)
        self.c2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.shared = nn.BatchNorm2d(3, **bn)
        self.unused = nn.BatchNorm2d(3, **bn)
        self.fc = nn.Linear(3 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.shared(self.c1(x)))
        x = F.max_pool2d(torch.relu(self.shared(self.c2(x))), 2)
        return self.fc(x.flatten(1))


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {
        "plain": lambda: make_model(0),
        "bn2d": lambda: Conv3BN(),
        "tinynet_bn": lambda: make_model(0, batch_norm=True),
        "bn2d_noaffine_cma": lambda: Conv3BN(affine=False, momentum=None),
        "bn2d_no_running_stats": lambda: Conv3BN(track_running_stats=False),
        "bn1d": lambda: NormMLP(),
        "shared_bn": lambda: SharedBN(),
        "shared_bn_cma": lambda: SharedBN(momentum=None),
        "bn1d_noaffine_cma": lambda: NormMLP(affine=False, momentum=None),
        "syncbn": lambda: Conv3BN(norm=nn.SyncBatchNorm),
        "instnorm_stats": lambda: Conv3BN(norm=nn.InstanceNorm2d, affine=True, track_running_stats=True),
    }[kind]()


def _worker(kind: str, opt: str, execution: str = "auto", **kw) -> IIDPWorker:
    return IIDPWorker(_build(kind), OPTIMIZERS[opt], F.cross_entropy, weight_sync=kw.pop("method", "sws"),
                      bucket_cap_mb=CAP, vsw_execution=execution, **kw)


def _norm_buffers(w: IIDPWorker) -> list[dict[str, torch.Tensor]]:
    """Every VSW's buffers (BatchNorm statistics), cloned."""
    return [{k: v.clone() for k, v in r.named_buffers()} for r in w.replicas()]


def _run_pair(kind, opt, layouts, method="sws", eval_steps=True):
    """Train a batched and a per-VSW worker side by side; compare after every step."""
    bat = _worker(kind, opt, method=method)
    ref = _worker(kind, opt, "threads", method=method)
    step = 0
    for n, ga, B in layouts:
        for w in (bat, ref):
            w.configure(n, ga, B)
        assert bat.batch_fallback_reason() is None
        for _ in range(STEPS):
            X, y = make_data(step, n * (ga + 1) * B)
            mbs = split(X, y, [B] * (n * (ga + 1)))
            a = bat.train_step(mbs, keep_local_grad=True)
            b = ref.train_step(mbs, keep_local_grad=True)
            assert a.batched and not b.batched
            assert a.loss == pytest.approx(b.loss, rel=1e-10, abs=1e-12)
            torch.testing.assert_close(a.local_grad, b.local_grad)
            assert max_rel_diff(bat.model, ref.model) < 1e-10
            for ra, rb in zip(_norm_buffers(bat), _norm_buffers(ref)):
                assert ra.keys() == rb.keys()
                for k in ra:
                    torch.testing.assert_close(ra[k], rb[k], msg=k)
            step += 1
    sa, sb = bat.optimizer.state_dict()["state"], ref.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            torch.testing.assert_close(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k]))
    for ra, rb in zip(bat.replicas(), ref.replicas()):   # every VSW's weights and statistics
        assert max_rel_diff(ra, rb) < 1e-10
        if eval_steps:
            X, _ = make_data(99, 6)
            ra.eval(), rb.eval()
            with torch.no_grad():
                torch.testing.assert_close(ra(X), rb(X))
            ra.train(), rb.train()
    return bat, ref


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("ga", [0, 2])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
def test_batched_equals_per_vsw_with_batchnorm(n, ga, B, opt):
    _run_pair("bn2d", opt, [(n, ga, B)])


def test_batched_equals_per_vsw_tinynet_bn_sgd():
    """The shared TinyNet (conv bias before BatchNorm) with SGD + momentum (see Conv3BN)."""
    _run_pair("tinynet_bn", "sgd_momentum", [(3, 1, 4), (2, 0, 1)])


@pytest.mark.parametrize("kind", ["bn2d_noaffine_cma", "bn2d_no_running_stats", "bn1d", "bn1d_noaffine_cma"])
@pytest.mark.parametrize("method", ["sws", "ows"])
def test_batched_equals_per_vsw_for_batchnorm_variants_across_configure(kind, method):
    """BatchNorm1d/2d, without affine, momentum=None (each VSW's own cumulative count), without
    running statistics; layouts switched by configure (the packed statistics follow)."""
    _run_pair(kind, "adam" if method == "ows" else "sgd_momentum", [(2, 1, 3), (3, 0, 4), (5, 2, 3), (1, 1, 3)],
              method=method)


@pytest.mark.parametrize("kind", ["shared_bn", "shared_bn_cma"])
def test_batched_counts_a_shared_and_an_unused_batchnorm_like_per_vsw(kind):
    bat, _ = _run_pair(kind, "sgd_momentum", [(2, 0, 3), (3, 1, 2), (1, 0, 4)])
    steps = 3 * (1 + 2 + 1)           # GA rounds: 3 steps of 1, 3 of 2, 3 of 1
    for r in bat.replicas():
        assert int(r.shared.num_batches_tracked) == 2 * steps
        assert int(r.unused.num_batches_tracked) == 0


def test_batched_without_batchnorm_equals_plain_step_on_union():
    w = _worker("plain", "adam")
    ref = make_model(0)
    ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
    step = 0
    for n, ga, B in [(3, 1, 4), (5, 0, 3), (2, 2, 1)]:
        w.configure(n, ga, B)
        for _ in range(2):
            X, y = make_data(step, n * (ga + 1) * B)
            st = w.train_step(split(X, y, [B] * (n * (ga + 1))))
            assert st.batched
            assert st.loss == pytest.approx(reference_step(ref, ref_opt, X, y), rel=1e-10)
            assert max_rel_diff(w.model, ref) < 1e-10
            step += 1
    for r in w.replicas()[1:]:          # the deferred weight copy reaches every replica
        assert max_rel_diff(r, w.model) == 0.0


def test_ragged_step_after_batched_steps_runs_per_vsw_with_current_weights(caplog):
    """A ragged step cannot be batched: it runs per VSW (one log line), on replicas that first
    get the weights the batched steps deferred, and equals the per-VSW worker."""
    bat, ref = _worker("tinynet_bn", "sgd_momentum"), _worker("tinynet_bn", "sgd_momentum", "threads")
    for w in (bat, ref):
        w.configure(3, 1, 4)
    sizes = [[4] * 6, [4] * 6, [4, 3, 0, 2, 4, 1], [4] * 6, [2, 1, 4, 4, 3, 3]]
    with caplog.at_level(logging.INFO, logger="jabasray.engine.iidp"):
        for step, sz in enumerate(sizes):
            ragged = sz != [4] * 6
            X, y = make_data(step, sum(sz))
            a = bat.train_step(split(X, y, sz), ragged=ragged)
            b = ref.train_step(split(X, y, sz), ragged=ragged)
            assert a.batched == (not ragged)
            assert a.loss == pytest.approx(b.loss, rel=1e-10)
            assert max_rel_diff(bat.model, ref.model) < 1e-10
            for ra, rb in zip(_norm_buffers(bat), _norm_buffers(ref)):
                for k in ra:
                    torch.testing.assert_close(ra[k], rb[k])
    lines = [r.getMessage() for r in caplog.records if "per-VSW execution" in r.getMessage()]
    lines.remove("IIDP: per-VSW execution (vsw_execution='threads' forces per-VSW execution)")  # ref
    assert lines == ["IIDP: per-VSW execution (ragged step (micro-batches of unequal size))"]


@pytest.mark.parametrize("kind", ["syncbn", "instnorm_stats"])
def test_batch_coupled_modules_fall_back_and_equal_per_vsw(kind, caplog):
    assert coupling_modules(_build(kind)), kind
    w = _worker(kind, "sgd_momentum")
    ref = _worker(kind, "sgd_momentum", "one_thread")
    for x in (w, ref):
        x.configure(2, 1, 3)
    reason = w.batch_fallback_reason()
    assert reason.startswith("batch-coupled modules n1 (")
    with caplog.at_level(logging.INFO, logger="jabasray.engine.iidp"):
        for step in range(2):
            X, y = make_data(step, 12)
            a, b = w.train_step(split(X, y, [3] * 4)), ref.train_step(split(X, y, [3] * 4))
            assert not a.batched and a.loss == pytest.approx(b.loss, rel=1e-10)
            assert max_rel_diff(w.model, ref.model) < 1e-10
    assert sum(reason in r.getMessage() for r in caplog.records) == 1


def test_loss_that_is_not_a_per_sample_mean_runs_per_vsw():
    """A summed loss: batching would weight it differently; ``per_sample_loss=False`` keeps
    per-VSW execution, which equals the per-VSW reference."""
    def sum_step(model, batch):
        x, t = batch
        return F.cross_entropy(model(x), t, reduction="sum")
    w = IIDPWorker(make_model(0), OPTIMIZERS["adam"], None, step_fn=sum_step, per_sample_loss=False,
                   bucket_cap_mb=CAP)
    ref = IIDPWorker(make_model(0), OPTIMIZERS["adam"], None, step_fn=sum_step, bucket_cap_mb=CAP,
                     vsw_execution="threads")
    for x in (w, ref):
        x.configure(3, 0, 4)
    assert "per_sample_loss=False" in w.batch_fallback_reason()
    X, y = make_data(0, 12)
    a, b = w.train_step(split(X, y, [4] * 3)), ref.train_step(split(X, y, [4] * 3))
    assert not a.batched and a.loss == pytest.approx(b.loss, rel=1e-10)
    assert max_rel_diff(w.model, ref.model) < 1e-10
    with pytest.raises(ValueError, match="per_sample_loss must be True or False"):
        IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy, per_sample_loss="yes")


def test_dict_batches_and_unjoinable_leaves():
    """Dict micro-batches join leaf by leaf (and batched equals per-VSW); a 0-d tensor leaf
    cannot be joined: that step runs per VSW and still equals the reference."""
    def dict_step(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"]) * batch.get("w", 1.0)
    kw = dict(step_fn=dict_step, bucket_cap_mb=CAP)
    w = IIDPWorker(make_model(0), OPTIMIZERS["sgd_momentum"], None, **kw)
    ref = IIDPWorker(make_model(0), OPTIMIZERS["sgd_momentum"], None, vsw_execution="threads", **kw)
    for x in (w, ref):
        x.configure(2, 1, 3)
    X, y = make_data(0, 12)
    mbs = [{"x": a, "y": b} for a, b in split(X, y, [3] * 4)]
    a, b = w.train_step(mbs), ref.train_step(mbs)
    assert a.batched and a.loss == pytest.approx(b.loss, rel=1e-10)
    mbs = [{"x": a, "y": b, "w": torch.tensor(1.0)} for a, b in split(X, y, [3] * 4)]
    a, b = w.train_step(mbs), ref.train_step(mbs)
    assert not a.batched and a.loss == pytest.approx(b.loss, rel=1e-10)
    assert max_rel_diff(w.model, ref.model) < 1e-10


def test_join_batches_interleaves_every_leaf_alike():
    """Row b*n + v of the joined batch is row b of micro-batch v, for every leaf (so inputs and
    targets stay paired); one part is returned as it is."""
    X = torch.arange(24.).reshape(12, 2)
    parts = list(X.split([4, 4, 4]))
    j = join_batches(parts)
    assert torch.equal(j, torch.stack(parts, 1).reshape(12, 2))
    assert all(torch.equal(j[b * 3 + v], parts[v][b]) for b in range(4) for v in range(3))
    assert join_batches(parts[:1]) is parts[0]
    joined = join_batches([(X[:2], ["a", "b"]), (X[2:4], ["c", "d"])])
    assert joined[1] == ["a", "c", "b", "d"] and torch.equal(joined[0], X[[0, 2, 1, 3]])
    with pytest.raises(ValueError, match="unequal size"):
        join_batches([X[:2], X[2:5]])


def test_fallback_reasons_in_order():
    assert batch_fallback_reason(4, False, True, [], "threads") == \
        "vsw_execution='threads' forces per-VSW execution"
    assert batch_fallback_reason(1, True, True, [], None).startswith("ragged step")
    assert batch_fallback_reason(1, False, False, ["bn (SyncBatchNorm)"], None) is None
    assert batch_fallback_reason(2, False, False, [], None).startswith("per_sample_loss=False")
    assert batch_fallback_reason(2, False, True, ["a (X)"] * 4, None) == \
        "batch-coupled modules a (X), a (X), a (X) ..."
    assert batch_fallback_reason(2, False, True, [], None) is None


def test_state_dict_of_batched_worker_is_compact_and_round_trips():
    """BatchNorm statistics are views of packed [n, C] tensors: the checkpoint holds only the
    main VSW's rows, and a restored worker continues identically."""
    a = _worker("tinynet_bn", "adam")
    a.configure(3, 0, 2)
    X, y = make_data(0, 6)
    a.train_step(split(X, y, [2] * 3))
    sd = a.state_dict()
    assert sd["model"]["bn.running_mean"].untyped_storage().nbytes() == 4 * 8    # C=4, float64
    torch.testing.assert_close(sd["model"]["bn.running_mean"], a.replicas()[0].bn.running_mean)
    b = _worker("tinynet_bn", "adam")
    b.load_state_dict(sd)
    for r in b.replicas():          # new replicas start from the main VSW (its statistics)
        torch.testing.assert_close(r.bn.running_var, sd["model"]["bn.running_var"])


@pytest.mark.cuda
@pytest.mark.parametrize("n, ga", [(1, 0), (4, 1)])
def test_cuda_batched_equals_per_vsw_on_streams(n, ga):
    """On a GPU (float64): batched == per-VSW on the VSWs' streams (``one_thread``), with
    BatchNorm (momentum and cumulative average), weights and every VSW's statistics."""
    ws = {}
    for ex in ("auto", "one_thread"):
        torch.manual_seed(0)
        ws[ex] = IIDPWorker(Conv3BN(momentum=None).cuda(), OPTIMIZERS["sgd_momentum"], F.cross_entropy,
                            device="cuda", bucket_cap_mb=CAP, vsw_execution=ex)
        ws[ex].configure(n, ga, 4)
    for step in range(3):
        X, y = make_data(step, n * (ga + 1) * 4)
        mbs = split(X.cuda(), y.cuda(), [4] * (n * (ga + 1)))
        a, b = ws["auto"].train_step(mbs), ws["one_thread"].train_step(mbs)
        assert a.batched and not b.batched and a.loss == pytest.approx(b.loss, rel=1e-10)
    for ra, rb in zip(ws["auto"].replicas(), ws["one_thread"].replicas()):
        assert max_rel_diff(ra, rb) < 1e-10
        for (k, ba), (_, bb) in zip(ra.named_buffers(), rb.named_buffers()):
            torch.testing.assert_close(ba, bb, msg=k)


def test_batched_rank_all_reduces_sums_like_a_per_vsw_rank(monkeypatch, tmp_path):
    """With a process group another rank may run per VSW in the same step (e.g. a solo GPU
    forming both similarity groups), so every rank must all-reduce the SUM of its decoupled
    workers' gradients and losses (the average comes after): a batched rank's buckets at the
    all-reduce hold exactly its local gradient sum, and the step equals the per-VSW one."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        seen = []
        real = dist.all_reduce

        def spy(t, *a, **kw):
            seen.append(t.detach().clone())
            return real(t, *a, **kw)
        ws = {ex: _worker("bn2d", "adam", ex, process_group=dist.group.WORLD) for ex in ("auto", "threads")}
        for w in ws.values():
            w.configure(2, 1, 3)
        X, y = make_data(0, 12)
        monkeypatch.setattr(dist, "all_reduce", spy)
        a = ws["auto"].train_step(split(X, y, [3] * 4), keep_local_grad=True)
        monkeypatch.setattr(dist, "all_reduce", real)
        b = ws["threads"].train_step(split(X, y, [3] * 4), keep_local_grad=True)
        assert a.batched and not b.batched
        buckets = torch.cat(seen[:len(ws["auto"].bucket_plan)])
        assert buckets.sum() == pytest.approx(float(a.local_grad.sum()), rel=1e-10)
        torch.testing.assert_close(a.local_grad, b.local_grad)
        assert a.loss == pytest.approx(b.loss, rel=1e-10)
        assert max_rel_diff(ws["auto"].model, ws["threads"].model) < 1e-10
    finally:
        dist.destroy_process_group()
