"""IIDP's communication critical section (``comm_guard``) is never entered, and no collective is
issued, from within a backward pass (deadlock risk on CUDA, where the hook runs on the
device's single autograd thread, which a paused background job's ``backward()`` also needs)."""
from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_reference import OPTIMIZERS, make_data, make_model, max_rel_diff, reference_step, split
from jabasray.engine import IIDPWorker

CAP = 0.0005  # MiB: several buckets


def _in_backward() -> bool:
    """True on a thread that is executing a backward pass right now."""
    return torch._C._current_graph_task_id() != -1


class _BackgroundLikeGuard:
    """A ``comm_guard`` that behaves like DeepPool's pause of a background job whose step needs
    the autograd engine: entering it waits (bounded, 5 s) until no VSW of ``worker`` is in its
    forward/backward any more. Entered from an autograd hook (the old design) it would wait for
    the very backward it blocks: the wait times out and ``timed_out`` records it."""

    def __init__(self) -> None:
        self.worker: IIDPWorker | None = None
        self.held = False
        self.entered_in_backward: list[bool] = []
        self.timed_out = 0

    def __call__(self, op: str):
        @contextlib.contextmanager
        def cm():
            self.entered_in_backward.append(_in_backward())
            end = time.monotonic() + 5.0
            while any(v.in_step for v in self.worker._vsws):
                if time.monotonic() > end:
                    self.timed_out += 1
                    break
                time.sleep(0.001)
            self.held = True
            try:
                yield
            finally:
                self.held = False
        return cm()


def _group():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)


@pytest.mark.parametrize("execution", ["threads", "one_thread"])
@pytest.mark.parametrize("method", ["sws", "ows"])
def test_guard_and_collectives_never_run_inside_backward(method, execution, monkeypatch):
    """Every all-reduce is issued outside any backward pass and inside the guard; the guard is
    entered outside backward, is not held while any VSW's backward hook runs, and a guard that
    waits for the VSWs to finish never times out. Weights equal an unguarded worker's bit for
    bit and a plain step on the union (1e-5)."""
    guard = _BackgroundLikeGuard()
    guarded = IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy, weight_sync=method,
                         bucket_cap_mb=CAP, process_group=_group(), comm_guard=guard,
                         vsw_execution=execution)
    guard.worker = guarded
    plain = IIDPWorker(make_model(0), OPTIMIZERS["adam"], F.cross_entropy, weight_sync=method,
                       bucket_cap_mb=CAP, process_group=_group(), vsw_execution=execution)
    ref = make_model(0)
    ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
    for w in (guarded, plain):
        w.configure(2, 1, 3)
    held_in_hook: list[bool] = []
    lock = threading.Lock()
    for replica in guarded.replicas():
        for p in replica.parameters():
            def hook(_p, lock=lock):
                with lock:
                    held_in_hook.append(guard.held)
            p.register_post_accumulate_grad_hook(hook)

    issued: list[tuple[bool, bool]] = []
    real = dist.all_reduce

    def spy(tensor, *a, **kw):
        issued.append((_in_backward(), guard.held))
        return real(tensor, *a, **kw)

    for step in range(3):
        X, y = make_data(step, 12)
        a = plain.train_step(split(X, y, [3] * 4))
        issued.clear()
        monkeypatch.setattr(dist, "all_reduce", spy)
        b = guarded.train_step(split(X, y, [3] * 4))
        monkeypatch.setattr(dist, "all_reduce", real)
        reference_step(ref, ref_opt, X, y)
        assert len(issued) == len(guarded.bucket_plan) + 1            # buckets + loss
        assert all(not in_bw and held for in_bw, held in issued)
        assert a.loss == b.loss
        for pa, pb in zip(plain.model.parameters(), guarded.model.parameters()):
            assert torch.equal(pa, pb)
        assert max_rel_diff(guarded.model, ref) < 1e-5
    assert guard.entered_in_backward == [False] * 3
    assert guard.timed_out == 0
    assert held_in_hook and not any(held_in_hook)
    assert not guard.held
    guarded.close()
    plain.close()


def test_failed_step_leaves_guard_after_pending_launches(monkeypatch):
    """A VSW that fails after buckets were handed to the communication thread: the step
    raises, the thread's pending launch finishes first, and the guard is left (never held
    after the step returned)."""
    log: list[str] = []

    @contextlib.contextmanager
    def guard(op):
        log.append("enter")
        try:
            yield
        finally:
            log.append("exit")

    w = IIDPWorker(make_model(0), OPTIMIZERS["sgd_momentum"], F.cross_entropy, bucket_cap_mb=CAP,
                   process_group=_group(), comm_guard=guard)
    w.configure(1, 0, 4)

    def boom(divisor):
        raise RuntimeError("update failed")
    monkeypatch.setattr(w, "_update", boom)
    X, y = make_data(0, 4)
    with pytest.raises(RuntimeError, match="update failed"):
        w.train_step([(X, y)])
    assert log == ["enter", "exit"]
    monkeypatch.undo()
    w.train_step([(X, y)])                  # usable again, one more enter/exit
    assert log == ["enter", "exit"] * 2
    w.close()
