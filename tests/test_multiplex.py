"""Background learners (DeepPool section 5) on CPU: the pure controller and pacer, then the
runner's gates, bookkeeping, checkpoints and error containment. No assertion on wall-clock time:
controller tests feed fabricated step times; runner tests count steps."""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from jabasray.engine.multiplex import (BackgroundRunner, BackgroundTask, LaunchPacer,
                                       MultiplexPolicy, SlowdownController, epoch_order)


def tiny_task(name="bg", steps=None, epochs=None, batch_size=8, n=40, seed=0, ckpt=None,
              every=50, dataset=None, model_seed=0):
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(123)
    ds = dataset if dataset is not None else TensorDataset(
        torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return BackgroundTask(name=name, model=model, dataset=ds, optimizer=opt,
                          loss_fn=nn.functional.cross_entropy, batch_size=batch_size,
                          steps=steps, epochs=epochs, checkpoint_path=ckpt, checkpoint_every=every,
                          seed=seed)


def reference_train(task: BackgroundTask, steps: int, batch_size: int) -> nn.Module:
    """Plain loop over the documented data order (epoch_order slices)."""
    model = copy.deepcopy(task.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    X, Y = task.dataset.tensors
    n, epoch, cursor = len(Y), 0, 0
    perm = epoch_order(n, task.seed, epoch)
    for _ in range(steps):
        idx = perm[cursor:cursor + batch_size]
        cursor += len(idx)
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[idx]), Y[idx]).backward()
        opt.step()
        if cursor >= n:
            epoch, cursor = epoch + 1, 0
            perm = epoch_order(n, task.seed, epoch)
    return model


def same_params(a: nn.Module, b: nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


# ---------------------------------------------------------------- pure parts

def test_controller_multiplicative_increase_then_decrease():
    c = SlowdownController(target=0.18, increase=2.0, decrease=0.5, min_delay=0.01,
                           max_delay=0.05, ema=1.0)
    assert c.observe(1.0, colocated=True) == 0.0          # no isolated baseline yet
    assert c.observe(1.0, colocated=False) == 0.0         # baseline 1.0
    delays = [c.observe(1.5, colocated=True) for _ in range(4)]   # 50% slowdown > 18%
    assert delays == [0.02, 0.04, 0.05, 0.05]             # 0.01*2, *2, capped at max_delay
    assert c.slowdown == pytest.approx(0.5)
    delays = [c.observe(1.1, colocated=True) for _ in range(4)]   # 10% <= 18%
    assert delays == pytest.approx([0.025, 0.0125, 0.0, 0.0])     # halves, snaps to 0 < 0.01


def test_controller_ema_of_step_times():
    c = SlowdownController(target=0.5, ema=0.5)
    c.observe(2.0, colocated=False)
    c.observe(4.0, colocated=False)
    assert c.isolated == pytest.approx(3.0)
    c.observe(3.0, colocated=True)
    c.observe(5.0, colocated=True)
    assert c.colocated == pytest.approx(4.0)
    assert c.slowdown == pytest.approx(4.0 / 3.0 - 1)


class FakeEvent:
    def __init__(self, log):
        self.done, self.log = False, log

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(self)
        self.done = True


def test_launch_pacer_bounds_outstanding_launches():
    synced = []
    pacer = LaunchPacer(limit=2)
    events = [FakeEvent(synced) for _ in range(5)]
    for ev in events:
        pacer.acquire()
        assert len(pacer.outstanding) < 2
        pacer.launched(ev)
    assert pacer.max_seen == 2
    assert synced == events[:3]                  # each launch beyond 2 waited on the oldest
    events[3].done = True                        # completed on its own: reaped without waiting
    pacer.acquire()
    assert synced == events[:3] and list(pacer.outstanding) == [events[4]]
    pacer.drain()
    assert not pacer.outstanding and synced[-1] is events[4]


def test_launch_pacer_off_never_waits():
    synced = []
    pacer = LaunchPacer(limit=None)
    for _ in range(10):
        pacer.acquire()
        pacer.launched(FakeEvent(synced))
    assert synced == [] and pacer.max_seen == 10


# ---------------------------------------------------------------- runner (CPU thread)

def test_background_job_trains_exactly_like_a_plain_loop():
    task = tiny_task(steps=7, batch_size=16, n=40)           # 3 steps per epoch, ragged last
    ref = reference_train(task, 7, 16)
    with BackgroundRunner("cpu", MultiplexPolicy(max_background_batch=None)) as runner:
        runner.submit(task)
        st = runner.wait("bg", timeout=60)
    assert st.state == "done" and st.step == 7 and st.total_steps == 7
    assert st.samples == 16 + 16 + 8 + 16 + 16 + 8 + 16 and st.epoch == 2
    assert st.last_loss is not None
    same_params(task.model, ref)


def test_epochs_and_batch_cap_bookkeeping():
    task = tiny_task(epochs=2, batch_size=64, n=40)          # capped to 16 -> 3 steps / epoch
    with BackgroundRunner("cpu", MultiplexPolicy(max_background_batch=16)) as runner:
        runner.submit(task)
        st = runner.wait("bg", timeout=60)
    assert (st.state, st.step, st.total_steps, st.samples, st.epoch) == ("done", 6, 6, 80, 2)


def test_foreground_critical_pauses_the_background():
    task = tiny_task(steps=100000, batch_size=4)
    with BackgroundRunner("cpu", MultiplexPolicy(slowdown_target=None)) as runner:
        runner.submit(task)
        while runner.status("bg").step < 3:
            time.sleep(0.01)
        with runner.foreground_critical("allreduce"):
            before = runner.status("bg").step
            time.sleep(0.2)
            assert runner.status("bg").step == before          # nothing ran meanwhile
        while runner.status("bg").step < before + 3:            # and it resumes afterwards
            time.sleep(0.01)
        runner.pause()
        frozen = runner.status("bg").step
        time.sleep(0.1)
        assert runner.status("bg").step == frozen
        runner.resume()
        runner.pause("bg")
        frozen = runner.status("bg").step
        time.sleep(0.1)
        st = runner.status("bg")
        assert st.step == frozen and st.state == "paused"
        runner.resume("bg")
        st = runner.cancel("bg")
        assert st.state == "cancelled"


def test_sensitive_op_learning_and_pause():
    with BackgroundRunner("cpu", MultiplexPolicy(op_slowdown_threshold=1.5)) as runner:
        assert "allreduce" in runner.sensitive_ops
        runner._learn_op("conv", 1.0, colocated=False)
        runner._learn_op("conv", 1.4, colocated=True)
        assert "conv" not in runner.sensitive_ops            # 1.4x <= 1.5x
        runner._learn_op("conv", 3.0, colocated=True)       # ema 0.3: 1.4*0.7+3*0.3 = 1.88
        assert "conv" in runner.sensitive_ops
        task = tiny_task(steps=100000, batch_size=4)
        runner.submit(task)
        while runner.status("bg").step < 2:
            time.sleep(0.01)
        with runner.foreground_op("conv"):                  # now paused during "conv"
            before = runner.status("bg").step
            time.sleep(0.15)
            assert runner.status("bg").step == before
        runner.cancel("bg")


def test_foreground_step_probes_isolated_time_and_feeds_controller():
    policy = MultiplexPolicy(probe_interval=3, slowdown_target=0.18)
    with BackgroundRunner("cpu", policy) as runner:
        runner.submit(tiny_task(steps=100000, batch_size=4))
        while runner.status("bg").step < 1:
            time.sleep(0.01)
        seen = []
        orig = runner.controller.observe
        runner.controller.observe = lambda s, colocated: seen.append(colocated) or orig(s, colocated)
        for _ in range(7):
            with runner.foreground_step():
                pass
        # first step probes (no baseline yet), then every 3rd step
        assert seen == [False, True, True, False, True, True, False]
        runner.cancel("bg")


def test_runner_applies_the_controller_delay_before_launches(monkeypatch):
    import jabasray.engine.multiplex as mux

    slept = []
    real_sleep = time.sleep
    monkeypatch.setattr(mux.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    controller = SlowdownController(target=0.1)
    controller.delay = 0.013                       # as if the foreground had slowed down
    with BackgroundRunner("cpu", MultiplexPolicy(slowdown_target=0.1), controller) as runner:
        runner.submit(tiny_task(steps=3, batch_size=4))
        st = runner.wait("bg", timeout=60)
    assert st.state == "done"
    assert slept.count(0.013) == 3                 # one throttle delay before each launch


def test_failing_job_is_contained_and_reported():
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            raise RuntimeError("disk on fire")

    bad = tiny_task(name="bad", steps=5, dataset=Broken())
    good = tiny_task(name="good", steps=4)
    with BackgroundRunner("cpu") as runner:
        runner.submit(bad)
        runner.submit(good)
        st_bad = runner.wait("bad", timeout=60)
        st_good = runner.wait("good", timeout=60)
        with runner.foreground_critical("allreduce"):       # foreground still works
            pass
    assert st_bad.state == "failed" and "RuntimeError: disk on fire" in st_bad.error
    assert st_good.state == "done" and st_good.step == 4


def test_checkpoint_and_resume_elsewhere_equals_uninterrupted(tmp_path):
    ckpt = str(tmp_path / "job.pt")
    first = tiny_task(steps=4, batch_size=16, n=40, ckpt=ckpt, every=2)
    full = tiny_task(steps=9, batch_size=16, n=40)
    ref = reference_train(full, 9, 16)
    with BackgroundRunner("cpu", MultiplexPolicy(max_background_batch=None)) as a:
        a.submit(first)
        assert a.wait("bg", timeout=60).state == "done"
    moved = tiny_task(steps=9, batch_size=16, n=40, ckpt=ckpt, model_seed=5)   # other init
    with BackgroundRunner("cpu", MultiplexPolicy(max_background_batch=None)) as b:
        b.submit(moved)
        assert b.status("bg").step >= 4                      # resumed, not restarted
        st = b.wait("bg", timeout=60)
        assert st.step == 9 and st.samples == 3 * (16 + 16 + 8) and st.epoch == 3
        path = b.checkpoint("bg", str(tmp_path / "again.pt"))
    same_params(moved.model, ref)
    state = torch.load(path, weights_only=True)
    assert state["step"] == 9


class _Marker:
    """Unpickling this would create a file: what a crafted checkpoint could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_background_checkpoint_is_refused_and_never_runs(tmp_path):
    ckpt, marker = tmp_path / "job.pt", tmp_path / "pwned"
    torch.save({"model": _Marker(str(marker))}, ckpt)
    with BackgroundRunner("cpu", MultiplexPolicy(max_background_batch=None)) as r:
        with pytest.raises(ValueError, match=r"^checkpoint_path .*job\.pt of background job 'bg' "
                                             r"is not a plain tensor file"):
            r.submit(tiny_task(steps=2, ckpt=str(ckpt)))
    assert not marker.exists()


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="steps and epochs"):
        tiny_task(steps=3, epochs=1)
    with pytest.raises(ValueError, match="batch_size"):
        tiny_task(steps=3, batch_size=0)
    with pytest.raises(ValueError, match="max_outstanding"):
        MultiplexPolicy(max_outstanding=0)
    with pytest.raises(ValueError, match="slowdown_target"):
        MultiplexPolicy(slowdown_target=-0.1)
    with BackgroundRunner("cpu") as runner:
        with pytest.raises(ValueError, match="job"):
            runner.status("nope")
        with pytest.raises(ValueError, match="checkpoint_path"):
            runner.submit(tiny_task(steps=1))
            runner.wait("bg", timeout=60)
            runner.checkpoint("bg")


class _CountingEvent:
    """A background launch's completion event that counts host waits (``synchronize``)."""

    def __init__(self, host_waits: list) -> None:
        self.host_waits = host_waits

    def synchronize(self) -> None:
        self.host_waits.append(self)


class _CountingStream:
    def __init__(self) -> None:
        self.waited: list = []

    def wait_event(self, ev) -> None:
        self.waited.append(ev)


def test_pausing_never_waits_on_background_events_on_the_foreground_thread(monkeypatch):
    """CUDA semantics of a pause with in-flight background launches (events stubbed on CPU):
    the foreground's stream waits for each job's newest launch on the device; the
    foreground's thread waits on no background event (host waits counted: zero)."""
    host_waits: list = []
    with BackgroundRunner("cpu", MultiplexPolicy(slowdown_target=None)) as runner:
        for name in ("a", "b"):
            runner.submit(tiny_task(name=name, steps=1, batch_size=4))
            runner.wait(name, timeout=30)
        events = {name: _CountingEvent(host_waits) for name in ("a", "b")}
        for name, ev in events.items():
            runner._jobs[name].last_event = ev       # as after a CUDA launch
        stream = _CountingStream()
        monkeypatch.setattr(runner, "is_cuda", True)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
        with runner.foreground_critical("allreduce"):
            assert runner._paused == 1
        with runner.foreground_op("allreduce"):
            pass
        assert host_waits == []
        assert stream.waited == [events["a"], events["b"]] * 2
        monkeypatch.setattr(runner, "is_cuda", False)


class _PieceGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph`` recording captures and replays."""

    log: list = []

    def capture_begin(self, pool=None, capture_error_mode=None) -> None:
        _PieceGraph.log.append(("begin", self))

    def capture_end(self) -> None:
        _PieceGraph.log.append(("end", self))

    def replay(self) -> None:
        _PieceGraph.log.append(("replay", self))


def test_background_step_in_pieces_is_paced_between_pieces(monkeypatch):
    """A background step captured in pieces (CUDA semantics with a stand-in graph on CPU):
    forward, the backward cut every ceil(P / (pieces - 2)) parameter gradients, optimizer;
    replayed in capture order with the runner's pacing/pause gate before every piece but the
    first."""
    import contextlib

    from jabasray.engine import multiplex
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _PieceGraph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    _PieceGraph.log = []
    task = tiny_task(steps=1, batch_size=4)
    x, y = task.dataset.tensors[0][:4], task.dataset.tensors[1][:4]
    params = [p for p in task.model.parameters() if p.requires_grad]
    assert len(params) == 4
    step = multiplex._GraphedStep.capture(task, x, y, None, pieces=4)
    assert step is not None and len(step.graphs) == 4          # forward, 2 x backward, optimizer
    assert [k for k, _ in _PieceGraph.log] == ["begin", "end"] * 4
    _PieceGraph.log = []
    step.replay(x, y, lambda: _PieceGraph.log.append(("between", None)))
    assert _PieceGraph.log == [("replay", step.graphs[0]), ("between", None), ("replay", step.graphs[1]),
                               ("between", None), ("replay", step.graphs[2]), ("between", None),
                               ("replay", step.graphs[3])]
    with pytest.raises(ValueError, match="graph_pieces"):
        MultiplexPolicy(graph_pieces=0)
