"""The driver's epoch loop without Ray: :class:`JabasDriver` over a scripted pool of actors.

The pool answers every interval from a script (the gradient similarity Phi the actors would
measure), so the adaptive rule, the forecast and the auto-scaler run exactly as in a real job
while nothing trains. What is checked is the driver's own bookkeeping:

- every epoch runs on the allocation decided before it (the event "after epoch k: auto-scaling
  A -> B" names the allocation epoch k + 1 records and runs on), and nothing is planned after
  the final epoch (no forecast, no re-profiling, no auto-scaling event);
- a finished run resumed with more epochs plans its next epoch when it continues;
- the GPU-seconds held over the run split exactly at the epochs' windows (a fixed cluster).
"""
from __future__ import annotations

import ast
import re
import time
from dataclasses import replace

import pytest

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.actors.gpu_actor import IntervalReply
from jabasray.config import JobConfig
from jabasray.types import ClusterSpec, NodeSpec

N = 960
CLUSTER = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2), NodeSpec("n1", "fast", 2), NodeSpec("n2", "fast", 2)])


class ScriptedPool:
    """Stands in for :class:`jabasray.actors.pool.ActorPool`: the placed slots answer every
    interval with the scripted Phi; ``placements`` records the pairs of every placement."""

    def __init__(self, phi: float) -> None:
        self.phi = phi
        self.placement = None
        self._slots: list = []
        self.placements: list[list[str]] = []
        self.trained_on: list[tuple[int, tuple[str, ...]]] = []   # (epoch, pairs) per interval

    @property
    def actors(self) -> list:
        return []

    @property
    def slots(self) -> list:
        return list(self._slots)

    def runs(self, slots) -> bool:
        return self.placement is not None and \
            [(s.pair_key, s.rank) for s in self._slots] == [(s.pair_key, s.rank) for s in slots]

    def place(self, slots, worker_state_ref=None, fresh=False, bucket_plan=None, rank_state_refs=None):
        self.placement, self._slots = object(), list(slots)
        self.placements.append(sorted({s.node for s in slots}))

    def configure(self, configs) -> None:
        pass

    def train(self, req, deadline_s=None):
        run_batch = req.local_batch * sum(req.layout)
        end = min(N, req.cursor + req.num_iterations * run_batch)
        self.trained_on.append((req.epoch, tuple(sorted({s.node for s in self._slots}))))
        replies = [IntervalReply(rank=s.rank, num_iterations=req.num_iterations, samples=0, loss=1.0,
                                 phi=self.phi, lr=0.1, compute_time=0.0, comm_time=0.0, update_time=0.0,
                                 emulation_sleep=0.0, wall_time=0.01, end_cursor=end)
                   for s in self._slots]
        return replies, end

    def evaluate(self, val_ref):
        return {}

    def call_all(self, method, *args, ranks=None, per_rank=None):
        assert method == "state_dict"
        return [{"model": {}, "optimizer": {"state": {}, "param_groups": []}, "config": {}}]

    def shutdown(self) -> None:
        self.placement = None


def _driver(tmp_path, epochs: int, phi: float, replacement_cost_s: float | None = 0.0) -> JabasDriver:
    job = JobConfig(epochs=epochs, initial_global_batch=16, min_global_batch=16, max_global_batch=768,
                    min_local_batch=4, adapt_interval=2, alpha=1.0, gamma=0.9, autoscale=True, seed=0,
                    replacement_cost_s=replacement_cost_s)
    driver = JabasDriver(model_fn, None, optimizer_fn, loss_fn, job, CLUSTER, tmp_path / "run",
                         perf_model=perf_model({"fast": 1.0}), options=DriverOptions(evaluate=False),
                         dataset_size=N)
    driver.pool = ScriptedPool(phi)
    return driver


@pytest.fixture
def no_object_store(monkeypatch):
    """The driver hands worker states to actors through ``ray.put``: identity here (no Ray)."""
    import ray
    monkeypatch.setattr(ray, "put", lambda x: x)


SCALING = re.compile(r"after epoch (\d+): auto-scaling (\{.*\}) -> (\{.*\})")
KEEPING = re.compile(r"after epoch (\d+): keeping (\{.*\}): the next epoch on (\{.*\}) would not repay "
                     r"re-placing the actors \((.*) s\)")


def _decisions(events: list[str]) -> dict[int, tuple[dict, dict]]:
    """``{epoch k: (from, to)}`` of the auto-scaling events (decided after epoch k, 1-based)."""
    out = {}
    for line in events:
        m = SCALING.fullmatch(line)
        if m:
            out[int(m.group(1))] = (ast.literal_eval(m.group(2)), ast.literal_eval(m.group(3)))
    return out


@pytest.mark.usefixtures("no_object_store")
def test_every_epoch_runs_on_the_allocation_decided_before_it_and_nothing_after_the_last(tmp_path):
    driver = _driver(tmp_path, epochs=4, phi=0.0)       # Phi 0: B_G grows every interval
    hist = driver.run()
    decisions = _decisions(hist.events)
    assert decisions, "the scenario must make the auto-scaler change the allocation"
    assert max(decisions) < 4                          # no decision after the final epoch
    for k, rec in enumerate(hist.epochs[1:], start=1):
        expected = decisions[k][1] if k in decisions else hist.epochs[k - 1].allocation
        assert rec.allocation == expected, (k, rec.allocation, decisions)
        if k in decisions:
            assert decisions[k][0] == hist.epochs[k - 1].allocation
    # what ran: every interval of epoch k on the nodes of epoch k's recorded allocation
    for epoch, nodes in driver.pool.trained_on:
        assert list(nodes) == sorted(hist.epochs[epoch].allocation), epoch
    # the final checkpoint keeps the last epoch's allocation and no forecast for an epoch that
    # does not exist
    state = driver.last_checkpoint.load_driver_state()
    assert state.epochs_done == 4 and state.allocation == hist.epochs[-1].allocation
    assert state.forecast == []


@pytest.mark.usefixtures("no_object_store")
def test_a_finished_run_resumed_with_more_epochs_plans_its_next_epoch_first(tmp_path):
    first = _driver(tmp_path, epochs=2, phi=0.0).run()
    more = _driver(tmp_path, epochs=3, phi=0.0)
    hist = more.run()
    assert len(hist.epochs) == 3 and hist.epochs[0] == first.epochs[0]
    # the decision for epoch 3, made on resuming, is recorded beside epoch 2 (the first run,
    # which ended there, decided nothing after its final epoch)
    assert first.epochs[1].decision == {} and hist.epochs[1].decision
    assert replace(hist.epochs[1], decision={}) == first.epochs[1]
    state = more.last_checkpoint.load_driver_state()
    assert state.epochs_done == 3
    # epoch 3 ran with a forecast made from epochs 1-2, on the allocation chosen for it
    assert hist.epochs[2].predicted_trajectory, "epoch 3 must have been planned with a forecast"
    decisions = _decisions(hist.events)
    expected = decisions[2][1] if 2 in decisions else first.epochs[1].allocation
    assert hist.epochs[2].allocation == expected


@pytest.mark.usefixtures("no_object_store")
def test_a_fixed_cluster_is_held_over_the_whole_run_split_at_the_epochs(tmp_path):
    """A fixed spec holds its 6 GPUs from the run's start to its end: the run's figure
    (``metrics.json``'s ``held``) is 6 x the run's duration; before the first epoch, between
    the epochs and after the last, 6 x those spans; inside, the epochs' own figures. A run
    resumed with one more epoch counts from its own start and the one epoch it ran."""
    from jabasray.actors.metrics import MetricsHistory
    gpus, tol = 6, 1e-5   # unix times (~1.8e9 s) carry ~2.4e-7 s of rounding per term
    t0 = time.time()
    hist = _driver(tmp_path, epochs=2, phi=0.0).run()
    t1 = time.time()
    held, (e0, e1) = hist.held, hist.epochs
    assert t0 <= held.start_s < e0.start_s and e1.start_s + e1.time_s <= held.end_s <= t1
    assert held.total == pytest.approx(gpus * (held.end_s - held.start_s), rel=0, abs=tol)
    assert held.before_first_epoch == pytest.approx(gpus * (e0.start_s - held.start_s), rel=0, abs=tol)
    assert held.inside_epochs == e0.held_gpu_seconds + e1.held_gpu_seconds
    assert held.between_epochs == pytest.approx(gpus * (e1.start_s - e0.start_s - e0.time_s), rel=0, abs=tol)
    assert held.after_last_epoch == pytest.approx(gpus * (held.end_s - e1.start_s - e1.time_s), rel=0, abs=tol)
    assert held.total == held.before_first_epoch + held.inside_epochs + held.between_epochs + held.after_last_epoch
    assert (held.epochs_counted, held.launched_gpus_at_end) == ([0, 1], 0)
    assert MetricsHistory.from_json((tmp_path / "run" / "metrics.json").read_text()).held == held
    more = _driver(tmp_path, epochs=3, phi=0.0).run().held
    assert more.start_s >= t1 and more.epochs_counted == [2]
    assert more.total == pytest.approx(gpus * (more.end_s - more.start_s), rel=0, abs=tol)


@pytest.mark.usefixtures("no_object_store")
def test_a_move_the_next_epoch_does_not_repay_is_not_made_and_the_event_says_so(tmp_path):
    """The same scripted job with moves free (the paper's rule) and with a re-placement charge no
    epoch repays: charged, every epoch runs on the first allocation, and after every epoch whose
    free choice differs from it an event names that choice (the choice without the charge does
    not depend on the current allocation, so it is the free run's next allocation)."""
    free = _driver(tmp_path / "free", epochs=4, phi=0.0, replacement_cost_s=0.0).run()
    assert _decisions(free.events), "the scenario must make the auto-scaler change the allocation"
    charged = _driver(tmp_path / "charged", epochs=4, phi=0.0, replacement_cost_s=1e6).run()
    assert _decisions(charged.events) == {}
    first = charged.epochs[0].allocation
    assert first == free.epochs[0].allocation
    assert all(rec.allocation == first for rec in charged.epochs)
    kept = {int(m.group(1)): (ast.literal_eval(m.group(2)), ast.literal_eval(m.group(3)), m.group(4))
            for m in map(KEEPING.fullmatch, charged.events) if m}
    assert kept == {k: (first, free.epochs[k].allocation, "1000000.0")
                    for k in range(1, 4) if free.epochs[k].allocation != first}
    assert kept, "the charge must have kept at least one move"


@pytest.mark.usefixtures("no_object_store")
def test_by_default_a_move_is_charged_what_the_last_placement_took(tmp_path, monkeypatch):
    """``replacement_cost_s=None``: the auto-scaler is charged the seconds the driver's last
    placement of the actors took (here a placement that sleeps 0.2 s)."""
    import time

    import jabasray.actors.driver as drv
    charges = []
    real = drv.next_allocation

    def spy(*args, **kw):
        if kw.get("current") is not None:          # the epoch-end decisions (a move is possible)
            charges.append(kw["switch_cost_s"])
        return real(*args, **kw)
    monkeypatch.setattr(drv, "next_allocation", spy)
    driver = _driver(tmp_path, epochs=3, phi=0.0, replacement_cost_s=None)
    place = driver.pool.place
    took = []

    def slow_place(*args, **kw):
        t = time.perf_counter()
        time.sleep(0.2)
        place(*args, **kw)
        took.append(time.perf_counter() - t)
    driver.pool.place = slow_place
    driver.run()
    assert len(charges) == 2 and took                # decisions after epochs 1 and 2
    assert all(c >= 0.2 for c in charges)
    assert charges[0] == pytest.approx(took[0], abs=0.05)          # the first placement's time
    assert charges[-1] == pytest.approx(took[-1], abs=0.05)        # then the latest placement's


@pytest.mark.usefixtures("no_object_store")
def test_phases_say_what_the_driver_does_before_each_interval_that_waits_for_it(tmp_path):
    """``on_phase``: the model's building, then the placement of the first allocation's actors
    and "training" before the first interval; every later placement (a move) and "training"
    just before the first interval on the new allocation; nothing else between intervals."""
    from jabasray.actors.driver import DriverCallback

    class Seen(DriverCallback):
        def __init__(self) -> None:
            self.log: list = []

        def on_phase(self, driver, phase):
            self.log.append(("phase", phase))

        def on_interval(self, driver, record):
            if not self.log or self.log[-1] != ("interval", record.epoch):
                self.log.append(("interval", record.epoch))

    driver = _driver(tmp_path, epochs=4, phi=0.0)
    seen = Seen()
    driver.callbacks.append(seen)
    hist = driver.run()
    gpus = [sum(rec.allocation.values()) for rec in hist.epochs]
    expected = [("phase", "building the iteration-time model")]
    for epoch, n in enumerate(gpus):
        if epoch == 0 or hist.epochs[epoch].allocation != hist.epochs[epoch - 1].allocation:
            expected += [("phase", f"placing {n} GPU actor{'s' if n != 1 else ''}"), ("phase", "training")]
        expected.append(("interval", epoch))
    assert seen.log == expected
    assert len({tuple(sorted(r.allocation.items())) for r in hist.epochs}) > 1   # a move happened


@pytest.mark.usefixtures("no_object_store")
@pytest.mark.parametrize("charge", [0.0, 0.02])
def test_the_auto_scalers_choice_is_recomputed_from_metrics_json(tmp_path, charge):
    """Every epoch-end decision is in ``metrics.json`` beside the epoch it follows: each
    candidate's predicted epoch time and re-placement charge. Read back, the objective's argmin
    over those numbers (time, then Eq. 8 cost, then fewer GPUs, the charge added to every move)
    is the allocation chosen, the next epoch ran on it, and that epoch's own estimate is the
    chosen candidate's predicted time."""
    import json

    _driver(tmp_path, epochs=4, phi=0.0, replacement_cost_s=charge).run()
    epochs = json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"]

    def gpus(alloc: dict) -> dict:
        return {node: n for node, n in alloc.items() if n}

    assert [bool(e["decision"]) for e in epochs] == [True, True, True, False]
    moved = 0
    for e, after in zip(epochs, epochs[1:]):
        d = e["decision"]
        assert (d["objective"], gpus(d["current"]), d["switch_s"]) == ("time", gpus(e["allocation"]), charge)
        feasible = [c for c in d["candidates"] if c["epoch_time_s"] is not None]
        assert len(d["candidates"]) == 3 ** 3 - 1 and feasible
        for c in d["candidates"]:
            assert c["switch_s"] == (0.0 if gpus(c["allocation"]) == gpus(d["current"]) else charge)

        def weighed(c: dict) -> tuple:
            t = c["epoch_time_s"] + c["switch_s"]
            return t, c["cost"] * t / c["epoch_time_s"], c["num_gpus"]
        best = min(feasible, key=weighed)
        assert gpus(best["allocation"]) == gpus(d["chosen"])
        assert d["predicted_epoch_s"] == best["epoch_time_s"]
        assert gpus(after["allocation"]) == gpus(d["chosen"])
        assert after["predicted_time_s"] == pytest.approx(best["epoch_time_s"], rel=1e-12)
        moved += gpus(d["chosen"]) != gpus(d["current"])
    assert moved, "the scenario must move at least once"
