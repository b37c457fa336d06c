"""IIDPWorker on one process: equivalence with a plain step on the union of all micro-batches,
SWS == OWS, local gradients, ragged steps, reconfiguration, checkpoints, BatchNorm, errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_reference import OPTIMIZERS, clone, make_data, make_model, max_rel_diff, reference_step, split
from jabasray.engine import IIDPWorker

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

CAP = 0.0005  # MiB: splits TinyNet into several buckets


def _worker(model, opt="sgd_momentum", method="auto", **kw):
    return IIDPWorker(model, OPTIMIZERS[opt], F.cross_entropy, weight_sync=method, bucket_cap_mb=CAP, **kw)


@pytest.mark.parametrize("flat", [False, True], ids=["autograd_grads", "flat_grads"])
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("method", ["sws", "ows"])
def test_iidp_equals_plain_step_on_union_across_configure(opt, method, flat):
    """Several steps per layout, layouts switched by configure (optimizer state must survive)."""
    model = make_model(0)
    ref = clone(model)
    ref_opt = OPTIMIZERS[opt](list(ref.parameters()))
    w = _worker(model, opt, method, flat_grads=flat)
    assert len(w.bucket_plan) >= 3
    step = 0
    for num_vsw, num_ga, B in [(2, 1, 4), (3, 0, 5), (1, 2, 3), (4, 1, 2)]:
        w.configure(num_vsw, num_ga, B)
        for _ in range(2):
            n = num_vsw * (num_ga + 1)
            X, y = make_data(step, n * B)
            st = w.train_step(split(X, y, [B] * n))
            ref_loss = reference_step(ref, ref_opt, X, y)
            assert st.loss == pytest.approx(ref_loss, rel=1e-10)
            assert st.num_workers == st.global_num_workers == n
            assert st.num_samples == n * B and st.weight_sync == method
            assert max_rel_diff(w.model, ref) < 1e-10
            for replica in w.replicas()[1:]:          # one-way weight copy reached every VSW
                assert max_rel_diff(replica, w.model) == 0.0
            step += 1


def test_sws_and_ows_give_identical_weights():
    a, b = _worker(make_model(0), "adam", "sws"), _worker(make_model(0), "adam", "ows")
    for w in (a, b):
        w.configure(2, 1, 4)
    for step in range(4):
        X, y = make_data(step, 16)
        a.train_step(split(X, y, [4] * 4))
        b.train_step(split(X, y, [4] * 4))
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert a.optimizer.state_dict()["state"].keys() == b.optimizer.state_dict()["state"].keys()


def test_auto_weight_sync_follows_r_buffer_rule():
    model = make_model(0)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # one bucket of the whole model, cap just above / below 2x its size
    w_small_ratio = IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy,
                               bucket_cap_mb=total * 2.5 / 2 ** 20)
    w_large_ratio = IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy,
                               bucket_cap_mb=total * 1.5 / 2 ** 20)
    assert len(w_small_ratio.bucket_plan) == len(w_large_ratio.bucket_plan) == 1
    assert w_small_ratio.weight_sync_method == "ows"    # ratio 0.4 <= 0.5
    assert w_large_ratio.weight_sync_method == "sws"    # ratio 0.67 > 0.5


@pytest.mark.parametrize("flat", [False, True])
def test_local_grad_is_sum_of_micro_batch_gradients_before_allreduce(flat):
    model = make_model(0)
    ref = clone(model)
    w = _worker(model, flat_grads=flat)
    w.configure(2, 1, 3)
    X, y = make_data(7, 12)
    mbs = split(X, y, [3] * 4)
    expected = None
    for xb, yb in mbs:
        ref.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        g = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        expected = g if expected is None else expected + g
    st = w.train_step(mbs, keep_local_grad=True)
    assert st.local_grad.shape == expected.shape
    torch.testing.assert_close(st.local_grad, expected)
    assert w.train_step(mbs).local_grad is None


@pytest.mark.parametrize("flat", [False, True])
def test_split_local_grad_is_each_vsw_halfs_gradient_sum(flat):
    """One GPU forming both similarity groups: row h of local_grad is the sum of the mean-loss
    gradients of the micro-batches of VSW half h (VSW v holds micro-batches v*G .. v*G+G-1),
    and Phi of the two rows equals the float64 reference cosine of the two groups."""
    from jabasray.adaptive import cosine_similarity, group_similarity

    model = make_model(0)
    ref = clone(model)
    w = _worker(model, flat_grads=flat)
    w.configure(4, 1, 3)                     # 4 VSWs x 2 GA micro-batches: 8 decoupled workers
    X, y = make_data(11, 24)
    mbs = split(X, y, [3] * 8)
    per_mb = []
    for xb, yb in mbs:
        ref.zero_grad()
        F.cross_entropy(ref(xb), yb).backward()
        per_mb.append(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).double())
    g0, g1 = sum(per_mb[:4]), sum(per_mb[4:])
    st = w.train_step(mbs, keep_local_grad="split")
    assert st.local_grad.shape == (2, g0.numel())
    torch.testing.assert_close(st.local_grad[0], g0)
    torch.testing.assert_close(st.local_grad[1], g1)
    expected = float(g0.dot(g1) / (g0.norm() * g1.norm()))
    assert cosine_similarity(st.local_grad[0], st.local_grad[1]) == pytest.approx(expected, rel=1e-12)
    assert group_similarity([g.numpy() for g in per_mb[:4]], [g.numpy() for g in per_mb[4:]]) == \
        pytest.approx(expected, rel=1e-12)
    w.configure(3, 0, 3)
    with pytest.raises(ValueError, match="even num_vsw"):
        w.train_step(split(X[:9], y[:9], [3] * 3), keep_local_grad="split")


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("method", ["sws", "ows"])
def test_ragged_step_equals_plain_step_on_union(method, flat):
    model = make_model(0)
    ref = clone(model)
    ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
    w = _worker(model, "adam", method, flat_grads=flat)
    w.configure(2, 2, 4)
    X, y = make_data(1, 24)
    w.train_step(split(X, y, [4] * 6))
    reference_step(ref, ref_opt, X, y)
    sizes = [4, 1, 0, 3, 2, 0]               # VSW 0: 4,1,0 ; VSW 1: 3,2,0 (last micro-batch empty)
    X, y = make_data(2, sum(sizes))
    expected = 0
    for xb, yb in split(X, y, sizes):         # local_grad in ragged mode: sum of n_i/B_L * g_i
        if len(yb):
            probe = clone(ref)
            F.cross_entropy(probe(xb), yb).backward()
            expected = expected + len(yb) / 4 * torch.cat([p.grad.reshape(-1) for p in probe.parameters()])
    st = w.train_step(split(X, y, sizes), ragged=True, keep_local_grad=True)
    torch.testing.assert_close(st.local_grad, expected)
    assert st.loss == pytest.approx(reference_step(ref, ref_opt, X, y), rel=1e-10)
    assert st.num_samples == sum(sizes)
    assert max_rel_diff(w.model, ref) < 1e-10


def test_custom_bucket_plan_one_parameter_per_bucket():
    model = make_model(0)
    ref = clone(model)
    ref_opt = OPTIMIZERS["sgd_momentum"](list(ref.parameters()))
    plan = [[n] for n, _ in reversed(list(model.named_parameters()))]
    w = IIDPWorker(model, OPTIMIZERS["sgd_momentum"], F.cross_entropy, bucket_plan=plan, weight_sync="ows")
    assert w.bucket_plan == plan
    w.configure(3, 1, 2)
    for step in range(2):
        X, y = make_data(step, 12)
        w.train_step(split(X, y, [2] * 6))
        reference_step(ref, ref_opt, X, y)
    assert max_rel_diff(w.model, ref) < 1e-10


def test_allreduce_of_first_bucket_is_launched_during_backward(monkeypatch):
    """Overlap: bucket 0 (last layers) is launched while the main VSW's backward still runs
    (flat gradient buckets, as with a process group; a single device with autograd's own
    gradients has nothing to launch and runs without hooks, checked at the end)."""
    plain = _worker(make_model(0), method="ows")
    plain.configure(2, 0, 2)
    X, y = make_data(0, 4)
    plain.train_step(split(X, y, [2, 2]))
    assert plain._vsws[0].handles == []
    w = _worker(make_model(0), method="ows", flat_grads=True)
    w.configure(1, 0, 4)
    during_backward = []
    orig = w._buckets.launch

    def spy(b):
        during_backward.append((b, w._vsws[0].counting))
        orig(b)
    monkeypatch.setattr(w._buckets, "launch", spy)
    X, y = make_data(0, 4)
    w.train_step([(X, y)])
    assert [b for b, _ in during_backward] == list(range(len(w.bucket_plan)))
    assert during_backward[0][1] is True


class _PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.used = nn.Linear(64, 10)
        self.unused = nn.Linear(3, 3)        # never gets a gradient
        self.frozen = nn.Linear(64, 10)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.used(x.flatten(1)) + self.frozen(x.flatten(1))


@pytest.mark.parametrize("flat", [False, True])
def test_unused_and_frozen_parameters(flat):
    model = _PartlyUsed()
    ref = clone(model)
    opt_fn = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    w = IIDPWorker(model, opt_fn, F.cross_entropy, bucket_cap_mb=0.0001, weight_sync="ows", flat_grads=flat)
    names = {n for b in w.bucket_plan for n in b}
    assert "frozen.weight" not in names and "unused.weight" in names
    w.configure(2, 0, 4)
    ref_opt = opt_fn([p for p in ref.parameters() if p.requires_grad])
    X, y = make_data(0, 8)
    w.train_step(split(X, y, [4, 4]))
    reference_step(ref, ref_opt, X, y)
    assert max_rel_diff(w.model, ref) < 1e-10
    assert torch.equal(w.model.unused.weight.grad, torch.zeros(3, 3))   # complete bucket: zeros


def test_configure_adds_replicas_with_current_weights_and_removes_them():
    w = _worker(make_model(0), "adam")
    w.configure(1, 0, 4)
    X, y = make_data(0, 4)
    w.train_step([(X, y)])
    w.configure(3, 0, 4)
    assert len(w.replicas()) == 3 and w.num_vsw == 3 and w.num_workers == 3
    for r in w.replicas()[1:]:
        assert max_rel_diff(r, w.model) == 0.0
    state_before = {k: v["exp_avg"].clone() for k, v in w.optimizer.state.items()}
    w.configure(1, 2, 4)
    assert len(w.replicas()) == 1 and w.num_workers == 3 and w.local_batch_size == 4
    for p, s in w.optimizer.state.items():
        assert torch.equal(s["exp_avg"], state_before[p])


def test_state_dict_round_trip_continues_identically():
    data = [make_data(s, 12) for s in range(5)]
    a = _worker(make_model(0), "adam", "ows")
    a.configure(2, 2, 2)
    for X, y in data[:2]:
        a.train_step(split(X, y, [2] * 6))
    sd = a.state_dict()
    assert sd["config"] == {"num_vsw": 2, "num_ga": 2, "local_batch_size": 2}
    b = _worker(make_model(9), "adam", "ows")      # different init, unconfigured
    b.load_state_dict(sd)
    assert (b.num_vsw, b.num_ga, b.local_batch_size) == (2, 2, 2)
    for X, y in data[2:]:
        sa = a.train_step(split(X, y, [2] * 6))
        sb = b.train_step(split(X, y, [2] * 6))
        assert sa.loss == sb.loss
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    for r in b.replicas():
        assert max_rel_diff(r, a.model) == 0.0


@pytest.mark.parametrize("flat", [False, True])
def test_batchnorm_each_vsw_normalises_own_micro_batch_and_main_stats_are_saved(flat):
    model = make_model(0, batch_norm=True)
    ref = clone(model)                              # reference: BN per micro-batch, loss averaged
    ref_opt = OPTIMIZERS["sgd_momentum"](list(ref.parameters()))
    main_ref = clone(model)                         # running stats of VSW 0's micro-batches only
    w = _worker(model, flat_grads=flat)
    w.configure(2, 1, 4)
    for step in range(2):
        X, y = make_data(step, 16)
        mbs = split(X, y, [4] * 4)
        w.train_step(mbs)
        main_ref.load_state_dict({**main_ref.state_dict(),
                                  **{k: v for k, v in ref.state_dict().items() if "bn." not in k}})
        with torch.no_grad():
            for xb, _ in mbs[:2]:                   # VSW 0 = micro-batches 0 and 1
                main_ref(xb)
        ref_opt.zero_grad()
        loss = sum(F.cross_entropy(ref(xb), yb) for xb, yb in mbs) / 4
        loss.backward()
        ref_opt.step()
    assert max_rel_diff(w.model, ref) < 1e-10
    sd = w.state_dict()["model"]
    torch.testing.assert_close(sd["bn.running_mean"], main_ref.bn.running_mean)
    torch.testing.assert_close(sd["bn.running_var"], main_ref.bn.running_var)
    assert sd["bn.num_batches_tracked"] == 4
    other = w.replicas()[1].bn.running_mean
    assert not torch.allclose(other, sd["bn.running_mean"])


@pytest.mark.parametrize("method", ["sws", "ows"])
def test_set_lr_between_steps_matches_reference_and_timings_add_up(method):
    model = make_model(0)
    ref = clone(model)
    ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
    w = _worker(model, "adam", method)
    w.configure(2, 0, 3)
    for step, lr in enumerate([0.02, 0.005, 0.01]):
        w.set_lr(lr)
        assert w.get_lr() == lr and all(g["lr"] == lr for g in w.optimizer.param_groups)
        for g in ref_opt.param_groups:
            g["lr"] = lr
        X, y = make_data(step, 6)
        st = w.train_step(split(X, y, [3, 3]))
        reference_step(ref, ref_opt, X, y)
        assert st.update_time == st.optimizer_time + st.copy_time
        assert min(st.compute_time, st.comm_time, st.optimizer_time, st.copy_time) >= 0
    assert max_rel_diff(w.model, ref) < 1e-10
    with pytest.raises(ValueError, match="lr"):
        w.set_lr(-1.0)


# ---------------------------------------------------------------- bad input
def test_bad_configure_values_name_the_field():
    w = _worker(make_model(0))
    for kwargs, field in [(dict(num_vsw=0, num_ga=0, local_batch_size=4), "num_vsw"),
                          (dict(num_vsw=1, num_ga=-1, local_batch_size=4), "num_ga"),
                          (dict(num_vsw=1, num_ga=0, local_batch_size=0), "local_batch_size"),
                          (dict(num_vsw=1.5, num_ga=0, local_batch_size=4), "num_vsw")]:
        with pytest.raises(ValueError, match=field):
            w.configure(**kwargs)


def test_bad_micro_batches_name_the_field():
    w = _worker(make_model(0))
    X, y = make_data(0, 12)
    with pytest.raises(ValueError, match="configure"):
        w.train_step([(X[:4], y[:4])])
    w.configure(2, 0, 4)
    with pytest.raises(ValueError, match=r"micro_batches must hold num_vsw\*\(num_ga\+1\) = 2\*\(0\+1\) = 2"):
        w.train_step(split(X, y, [4, 4, 4]))
    with pytest.raises(ValueError, match=r"micro_batches\[1\] must hold local_batch_size = 4 samples, got 3"):
        w.train_step(split(X, y, [4, 3]))
    with pytest.raises(ValueError, match=r"micro_batches\[0\] must hold between 0 and local_batch_size"):
        w.train_step(split(X, y, [5, 4]), ragged=True)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="weight_sync must be one of 'auto', 'sws', 'ows', got 'fast'"):
        _worker(make_model(0), method="fast")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy, bucket_cap_mb=0)
    model = make_model(0)
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match="bucket_plan misses"):
        IIDPWorker(model, OPTIMIZERS["adam"], F.cross_entropy, bucket_plan=[names[1:]])
    with pytest.raises(ValueError, match="bucket_plan repeats"):
        IIDPWorker(model, OPTIMIZERS["adam"], F.cross_entropy, bucket_plan=[names, names[:1]])
    with pytest.raises(ValueError, match="optimizer_fn"):
        IIDPWorker(make_model(0), lambda p: torch.optim.SGD(list(p)[:1], lr=0.1), F.cross_entropy)
    with pytest.raises(ValueError, match="flat_grads"):
        IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy, flat_grads="yes")


def test_vsws_run_on_persistent_threads_and_main_vsw_inline():
    """CPU twin of the streams: VSW 0 on the caller's thread, VSWs 1.. on pool threads that
    persist across steps (no thread per step); a single VSW runs inline (per-VSW execution
    forced: the default runs the VSWs batched)."""
    import threading

    w = _worker(make_model(0), vsw_execution="threads")
    w.configure(3, 1, 2)
    seen: list[dict[int, set[int]]] = []

    def tracker(v):
        def hook(_m, _inp):
            seen[-1].setdefault(v, set()).add(threading.get_ident())
        return hook
    handles = [r.register_forward_pre_hook(tracker(v)) for v, r in enumerate(w.replicas())]
    for step in range(3):
        seen.append({})
        X, y = make_data(step, 12)
        w.train_step(split(X, y, [2] * 6))
    for h in handles:
        h.remove()
    main_thread = threading.get_ident()
    for s in seen:
        assert all(len(ids) == 1 for ids in s.values())        # GA steps of a VSW: same thread
        assert s[0] == {main_thread}
        assert len({next(iter(ids)) for ids in s.values()}) == 3
    assert seen[0] == seen[1] == seen[2]                        # the same threads every step
    w.configure(1, 0, 2)
    X, y = make_data(5, 2)
    seen.append({})
    handle = w.model.register_forward_pre_hook(tracker(0))
    w.train_step([(X, y)])
    handle.remove()
    assert seen[-1] == {0: {main_thread}}


def test_error_in_a_vsw_propagates_and_worker_stays_usable():
    model = make_model(0)
    ref = clone(model)
    ref_opt = OPTIMIZERS["sgd_momentum"](list(ref.parameters()))
    w = _worker(model)
    w.configure(2, 0, 4)
    X, y = make_data(0, 8)
    bad = [(X[:4], y[:4]), (X[4:], torch.full((4,), 99))]   # class 99 does not exist
    with pytest.raises(IndexError):
        w.train_step(bad)
    assert max_rel_diff(w.model, ref) == 0.0                 # no update happened
    w.train_step(split(X, y, [4, 4]))
    reference_step(ref, ref_opt, X, y)
    assert max_rel_diff(w.model, ref) < 1e-10


def test_thread_pool_runs_all_and_reraises_first_error():
    from jabasray.engine.streams import VSWThreadPool

    pool = VSWThreadPool(2)
    assert pool.run([lambda: 1, lambda: 2, lambda: 3]) == [1, 2, 3]
    ran = []

    def boom(msg):
        def f():
            ran.append(msg)
            raise RuntimeError(msg)
        return f
    with pytest.raises(RuntimeError, match="first"):
        pool.run([lambda: ran.append("main"), boom("first"), boom("second")])
    assert sorted(ran) == ["first", "main", "second"]
    with pytest.raises(ValueError, match="fns"):
        pool.run([lambda: 0] * 4)
    pool.resize(0)
    assert pool.size == 0 and pool.run([lambda: 7]) == [7]


class _RecordingGuard:
    """Fake ``comm_guard``: logs enter/exit and whether a guard is active right now."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.active = False

    def __call__(self, op: str):
        import contextlib

        @contextlib.contextmanager
        def cm():
            assert not self.active, "guard entered twice"
            self.log.append(("enter", op))
            self.active = True
            try:
                yield
            finally:
                self.active = False
                self.log.append(("exit", op))
        return cm()


def _one_rank_group():
    """A real gloo process group of world size 1 (no global init, nothing to tear down)."""
    import torch.distributed as dist
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)


@pytest.mark.parametrize("method", ["sws", "ows"])
def test_comm_guard_spans_all_allreduces_of_a_step_once(method, monkeypatch):
    """With a process group, the guard is entered once per step (op "allreduce") before the
    first all-reduce is issued and left after the last one was waited; every all-reduce of
    train_step (buckets + loss) is issued and waited inside it; the weights equal an unguarded
    worker's bit for bit (and a plain step on the union)."""
    import torch.distributed as dist

    events: list[tuple[str, bool]] = []
    guard = _RecordingGuard()
    real_all_reduce = dist.all_reduce

    class _Work:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append(("wait", guard.active))
            return self.work.wait()

    def spy(tensor, *a, **kw):
        events.append(("issue", guard.active))
        out = real_all_reduce(tensor, *a, **kw)
        return _Work(out) if kw.get("async_op") else out

    plain = _worker(make_model(0), method=method, process_group=_one_rank_group())
    guarded = _worker(make_model(0), method=method, process_group=_one_rank_group(), comm_guard=guard)
    ref = make_model(0)
    ref_opt = OPTIMIZERS["sgd_momentum"](list(ref.parameters()))
    for w in (plain, guarded):
        w.configure(2, 1, 3)
    monkeypatch.setattr(dist, "all_reduce", spy)
    for step in range(3):
        X, y = make_data(step, 12)
        a = plain.train_step(split(X, y, [3] * 4))
        events.clear()
        before = len(guard.log)
        b = guarded.train_step(split(X, y, [3] * 4))
        reference_step(ref, ref_opt, X, y)
        assert guard.log[before:] == [("enter", "allreduce"), ("exit", "allreduce")]
        issued = [e for e in events if e[0] == "issue"]
        assert len(issued) == len(guarded.bucket_plan) + 1           # buckets + loss
        assert events and all(active for _, active in events)        # all inside the guard
        assert events[-1][0] == "wait" and not guard.active          # left after the last wait
        assert a.loss == b.loss
        for pa, pb in zip(plain.model.parameters(), guarded.model.parameters()):
            assert torch.equal(pa, pb)
        assert max_rel_diff(guarded.model, ref) < 1e-10
    assert len(guard.log) == 6


def test_comm_guard_unused_without_process_group_and_left_on_error(monkeypatch):
    """No process group: no communication, so the guard is never entered and the step is
    unchanged. A step that fails after the first launch still leaves the guard."""
    guard = _RecordingGuard()
    plain, guarded = _worker(make_model(0)), _worker(make_model(0), comm_guard=guard)
    assert plain.comm_guard is None
    for w in (plain, guarded):
        w.configure(2, 0, 4)
    X, y = make_data(0, 8)
    plain.train_step(split(X, y, [4, 4]))
    guarded.train_step(split(X, y, [4, 4]))
    assert guard.log == []
    for pa, pb in zip(plain.model.parameters(), guarded.model.parameters()):
        assert torch.equal(pa, pb)

    w = _worker(make_model(0), process_group=_one_rank_group(), comm_guard=guard)
    w.configure(1, 0, 4)

    def boom(divisor):
        raise RuntimeError("update failed")
    monkeypatch.setattr(w, "_update", boom)
    with pytest.raises(RuntimeError, match="update failed"):
        w.train_step([(X[:4], y[:4])])
    assert guard.log == [("enter", "allreduce"), ("exit", "allreduce")] and not guard.active
    with pytest.raises(ValueError, match=r"^comm_guard must be None or a callable"):
        _worker(make_model(0), comm_guard=5)


@pytest.mark.parametrize("execution", ["auto", "threads"])
def test_step_metrics_are_sample_weighted_sums_of_each_forward(execution):
    """step_fn returning (loss, {name: mean}): the step reports, per metric, the float64 sum of
    mean x samples over every forward and the samples behind it; their ratio is the metric's
    mean over the union of the micro-batches (ragged sizes included), and the update equals
    the plain step."""
    model = make_model(0)
    ref = clone(model)

    def step(m, batch):
        x, y = batch
        out = m(x)
        loss = F.cross_entropy(out, y)
        return loss, {"acc": (out.argmax(1) == y).double().mean(), "ones": 1.0}

    w = IIDPWorker(model, OPTIMIZERS["sgd_momentum"], F.cross_entropy, bucket_cap_mb=CAP,
                   step_fn=step, vsw_execution=execution)
    w.configure(2, 1, 4)
    sizes = [4, 1, 3, 2]
    X, y = make_data(5, sum(sizes))
    st = w.train_step(split(X, y, sizes), ragged=True)
    with torch.no_grad():
        want = (ref(X).argmax(1) == y).double().sum()
    assert st.metric_counts == {"acc": 10, "ones": 10}
    assert float(st.metric_sums["acc"]) == pytest.approx(float(want), abs=1e-9)
    assert float(st.metric_sums["ones"]) == 10.0
    st = w.train_step(split(*make_data(6, 16), [4] * 4))        # batched where exact
    assert st.metric_counts == {"acc": 16, "ones": 16} and float(st.metric_sums["ones"]) == 16.0
    bad = IIDPWorker(make_model(0), OPTIMIZERS["sgd_momentum"], F.cross_entropy, step_fn=lambda m, b: (
        F.cross_entropy(m(b[0]), b[1]), {"acc": "high"}))
    bad.configure(1, 0, 4)
    with pytest.raises(ValueError, match=r"^step_fn must return \(loss, dict\[str, number\]\)"):
        bad.train_step(split(*make_data(7, 4), [4]))
