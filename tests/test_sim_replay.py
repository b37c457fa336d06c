"""``jabasray simulate --replay``: the simulator, given a recorded run's inputs, decides exactly as
the run's driver did.

The driver runs a real epoch loop (:class:`JabasDriver`: adaptive rule, forecast, auto-scaler,
re-placement charge) over a scripted pool of actors that answers every interval with a scripted
similarity (no Ray, nothing trains), on a heterogeneous cluster where the auto-scaler moves. The
run folder it writes (``model.json``, ``metrics.json``) is replayed by :func:`jabasray.sim.replay.
replay`: every epoch's allocation, every interval's requested B_G, B_G*, B_L and per-unit
(n_vsw, n_GA) must be the driver's, every interval's simulated time must be the driver's own
prediction for it, and every auto-scaling decision the same candidates with the same
predicted epoch times.
"""
from __future__ import annotations

import json
import sys

import pytest

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model
from test_driver_epochs import ScriptedPool, no_object_store  # noqa: F401 - the fixture
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.config import JobConfig
from jabasray.sim.replay import RecordedRun, replay
from jabasray.types import ClusterSpec, NodeSpec

N = 960
CLUSTER = ClusterSpec(nodes=[NodeSpec("f0", "fast", 2, tflops=2.0), NodeSpec("s0", "slow", 2, tflops=1.0),
                             NodeSpec("s1", "slow", 1, tflops=1.0)])


class VaryingPool(ScriptedPool):
    """The scripted pool with a similarity that changes every interval (B_G grows, stalls,
    shrinks), so that the adaptive rule, the forecast and the plans all move."""

    PHIS = (0.0, 0.2, 0.95, 0.0, 0.5, 0.0, 0.97, 0.1)

    def __init__(self) -> None:
        super().__init__(0.0)
        self.calls = 0

    def train(self, req, deadline_s=None):
        self.phi = self.PHIS[self.calls % len(self.PHIS)]
        self.calls += 1
        return super().train(req, deadline_s)


def _run(tmp_path, replacement_cost_s):
    job = JobConfig(epochs=5, initial_global_batch=16, min_global_batch=16, max_global_batch=512,
                    min_local_batch=4, adapt_interval=2, alpha=0.5, gamma=0.9, autoscale=True, seed=0,
                    replacement_cost_s=replacement_cost_s)
    driver = JabasDriver(model_fn, None, optimizer_fn, loss_fn, job, CLUSTER, tmp_path / "run",
                         perf_model=perf_model({"fast": 1.0, "slow": 0.5}),
                         options=DriverOptions(evaluate=False), dataset_size=N)
    driver.pool = VaryingPool()
    return driver.run()


@pytest.mark.usefixtures("no_object_store")
@pytest.mark.parametrize("charge", [0.0, None])   # None: charged what the placement took
def test_a_replayed_run_makes_the_drivers_choices(tmp_path, charge):
    hist = _run(tmp_path, charge)
    assert len({tuple(sorted(e.allocation.items())) for e in hist.epochs}) > 1, \
        "the scenario must make the auto-scaler move"
    report = replay(tmp_path / "run")
    assert report.same_decisions, "\n".join(report.lines())
    sim = report.simulated.history
    # interval by interval: the same plan, and the simulated time is the driver's prediction
    assert len(sim.intervals) == len(hist.intervals)
    for real, simulated in zip(hist.intervals, sim.intervals):
        assert (simulated.epoch, simulated.interval, simulated.cursor) == (real.epoch, real.interval, real.cursor)
        assert simulated.plan == real.plan
        assert simulated.time_s == pytest.approx(real.predicted_time_s, rel=1e-12)
    # epoch by epoch: the same forecast, the same auto-scaling decision
    for real, simulated in zip(hist.epochs, sim.epochs):
        assert simulated.predicted_trajectory == pytest.approx(real.predicted_trajectory, rel=1e-12)
        assert simulated.predicted_time_s == pytest.approx(real.predicted_time_s, rel=1e-12)
        if real.decision:
            assert simulated.decision["chosen"] == real.decision["chosen"]
            assert [c["epoch_time_s"] for c in simulated.decision["candidates"]] == \
                pytest.approx([c["epoch_time_s"] for c in real.decision["candidates"]], rel=1e-12)
            assert simulated.decision["switch_s"] == real.decision["switch_s"]


@pytest.mark.usefixtures("no_object_store")
def test_model_json_names_the_model_of_each_epoch_and_the_replay_uses_no_ray_or_torch(tmp_path):
    _run(tmp_path, 0.0)
    data = json.loads((tmp_path / "run" / "model.json").read_text())
    assert data["dataset_size"] == N and data["initial"] is not None
    assert [s["epochs_done"] for s in data["snapshots"]] == [0]   # a given model never changes
    import subprocess
    code = ("import sys; from jabasray.sim.replay import replay; r = replay(sys.argv[1]); "
            "assert r.same_decisions; print('torch' in sys.modules, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_a_folder_without_model_json_is_refused_in_one_line(tmp_path):
    (tmp_path / "old").mkdir()
    with pytest.raises(ValueError, match=r"no model\.json") as e:
        RecordedRun(tmp_path / "old")
    assert "\n" not in str(e.value)
