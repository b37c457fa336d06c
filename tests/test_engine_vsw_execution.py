"""The two VSW execution schemes of IIDPWorker: ``"one_thread"`` (CUDA's default: the
caller issues every VSW onto its stream, GA round by GA round) computes exactly what
``"threads"`` (CPU's default) computes, and both equal one plain step on the union. Run on CPU
here (forced scheme); on a GPU tests/test_cuda.py repeats the equality on streams."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_reference import OPTIMIZERS, clone, make_data, make_model, max_rel_diff, reference_step, split
from jabasray.engine import IIDPWorker

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

CAP = 0.0005


def _worker(execution, opt="adam", method="sws", **kw):
    return IIDPWorker(make_model(0), OPTIMIZERS[opt], F.cross_entropy, weight_sync=method,
                      bucket_cap_mb=CAP, vsw_execution=execution, **kw)


@pytest.mark.parametrize("flat", [False, True], ids=["autograd_grads", "flat_grads"])
@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("method", ["sws", "ows"])
def test_one_thread_equals_threads_and_plain_step(opt, method, flat):
    one, thr = _worker("one_thread", opt, method, flat_grads=flat), _worker("threads", opt, method, flat_grads=flat)
    assert one.vsw_execution == "one_thread" and thr.vsw_execution == "threads"
    ref = clone(make_model(0))
    ref_opt = OPTIMIZERS[opt](list(ref.parameters()))
    step = 0
    for num_vsw, num_ga, B in [(2, 1, 4), (3, 0, 5), (1, 2, 3), (4, 1, 2)]:
        for w in (one, thr):
            w.configure(num_vsw, num_ga, B)
        n = num_vsw * (num_ga + 1)
        for _ in range(2):
            X, y = make_data(step, n * B)
            a = one.train_step(split(X, y, [B] * n))
            b = thr.train_step(split(X, y, [B] * n))
            ref_loss = reference_step(ref, ref_opt, X, y)
            assert a.loss == b.loss == pytest.approx(ref_loss, rel=1e-10)
            for pa, pb in zip(one.model.parameters(), thr.model.parameters()):
                assert torch.equal(pa, pb)
            assert max_rel_diff(one.model, ref) < 1e-10
            for replica in one.replicas()[1:]:
                assert max_rel_diff(replica, one.model) == 0.0
            step += 1
    one.close()
    thr.close()


@pytest.mark.parametrize("method", ["sws", "ows"])
def test_one_thread_ragged_with_empty_micro_batches_and_a_process_group(method):
    """Ragged step where VSW 1 has no sample at all and VSW 0 an empty last micro-batch, with
    flat buckets all-reduced over a gloo group: equals the plain step on the union and the
    threads scheme bit for bit (local gradients too)."""
    ws = {e: _worker(e, "adam", method, process_group=dist.ProcessGroupGloo(dist.HashStore(), 0, 1))
          for e in ("one_thread", "threads")}
    ref = clone(make_model(0))
    ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
    for w in ws.values():
        w.configure(2, 2, 4)
    X, y = make_data(1, 24)
    for w in ws.values():
        w.train_step(split(X, y, [4] * 6))
    reference_step(ref, ref_opt, X, y)
    sizes = [4, 1, 0, 0, 0, 0]
    X, y = make_data(2, sum(sizes))
    st = {e: w.train_step(split(X, y, sizes), ragged=True, keep_local_grad=True) for e, w in ws.items()}
    ref_loss = reference_step(ref, ref_opt, X, y)
    assert st["one_thread"].loss == st["threads"].loss == pytest.approx(ref_loss, rel=1e-10)
    assert torch.equal(st["one_thread"].local_grad, st["threads"].local_grad)
    assert max_rel_diff(ws["one_thread"].model, ref) < 1e-10
    for pa, pb in zip(ws["one_thread"].model.parameters(), ws["threads"].model.parameters()):
        assert torch.equal(pa, pb)
    for w in ws.values():
        w.close()


def test_one_thread_issues_round_by_round_on_the_callers_thread():
    """No dispatcher threads; every forward and backward runs on the caller's thread; the
    forwards of GA round k of all VSWs are issued before their backwards, VSW by VSW."""
    w = _worker("one_thread")
    w.configure(3, 1, 2)
    assert w._pool.size == 0
    log: list[tuple[str, int]] = []
    threads: set[int] = set()
    def forward_hook(v):
        def hook(_m, _i, _o):
            log.append(("F", v))
            threads.add(threading.get_ident())
        return hook

    def backward_hook(v):
        def hook(_m, _gi, _go):
            log.append(("B", v))
        return hook

    for v, replica in enumerate(w.replicas()):
        replica.fc2.register_forward_hook(forward_hook(v))
        replica.fc1.register_full_backward_hook(backward_hook(v))
    X, y = make_data(0, 12)
    w.train_step(split(X, y, [2] * 6))
    round_ = [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert log == round_ * 2
    assert threads == {threading.get_ident()}
    with pytest.raises(ValueError, match=r"^vsw_execution must be one of 'auto', 'threads', 'one_thread'"):
        _worker("streams")
    assert _worker("auto").vsw_execution == "threads"            # CPU default
    w.close()


def test_error_in_one_thread_scheme_propagates_and_worker_stays_usable():
    w = _worker("one_thread")
    w.configure(2, 0, 4)
    X, y = make_data(0, 8)
    bad = [(X[:4], y[:4]), (X[4:], torch.full((4,), 99))]    # class 99 out of range
    with pytest.raises(IndexError):
        w.train_step(bad)
    assert not any(v.in_step or v.counting for v in w._vsws)
    ref = clone(make_model(0))
    w2 = _worker("threads")
    w2.configure(2, 0, 4)
    # the failed step applied no update: both continue identically
    w.model.load_state_dict(ref.state_dict())
    w.sync_replicas()
    a = w.train_step(split(X, y, [4, 4]))
    b = w2.train_step(split(X, y, [4, 4]))
    assert a.loss == b.loss
