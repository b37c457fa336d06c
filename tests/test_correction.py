"""Online correction of the iteration-time model (planners.correction) and the emulation host
term of PerfModel: exact bookkeeping on hand-made numbers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from jabasray.planners import PerfModel, solve_for_batch
from jabasray.planners.correction import CorrectedModel, OnlineCorrection
from jabasray.profiles import synthetic_profile


def base_model(**kw) -> PerfModel:
    p = synthetic_profile("fast", min_local_batch=8, num_batches=4)
    return PerfModel({"fast": p, "slow": p.scaled(0.5, "slow")}, **kw)


def test_factor_converges_to_the_measured_ratio():
    """Measured time is always 1.6 x the uncorrected model: with w = 0.5 the log error halves at
    every interval, so after k intervals the factor is 1.6 ** (1 - 0.5 ** k)."""
    c = OnlineCorrection(smoothing=0.5, threshold=2.0)
    m = CorrectedModel(base_model().for_allocation(4, False), c)
    t_base = m.model.iteration_time("fast", 16, 2, 1)
    for k in range(1, 8):
        c.observe(["fast", "fast"], m.iteration_time("fast", 16, 2, 1), 1.6 * t_base)
        assert c.factor("fast") == pytest.approx(1.6 ** (1 - 0.5 ** k))
    assert c.factor("slow") == 1.0                       # not in the allocation: untouched
    assert not c.needs_reprofile()
    ga = np.arange(4)
    assert np.allclose(m.iteration_times("fast", 16, 2, ga),
                       c.factor("fast") * m.model.iteration_times("fast", 16, 2, ga))


def test_reprofile_beyond_the_threshold_and_reset():
    c = OnlineCorrection(smoothing=1.0, threshold=2.0)
    c.observe(["slow"], 0.010, 0.025)                   # 2.5x slower than predicted
    assert c.factor("slow") == pytest.approx(2.5) and c.needs_reprofile()
    c.reset()
    assert c.factor("slow") == 1.0 and not c.needs_reprofile()
    c.observe(["fast"], 0.010, 0.0045)                  # 2.2x faster: off the other way
    assert c.needs_reprofile()
    with pytest.raises(ValueError, match="reprofile_threshold"):
        OnlineCorrection(threshold=1.0)


def test_corrected_model_changes_the_plan_like_a_slower_profile():
    """A factor of 2 on every type = a profile whose times are all doubled: same plan shape,
    twice the predicted time (the solver sees the corrected model through for_allocation)."""
    c = OnlineCorrection(smoothing=1.0)
    c.observe(["fast", "slow"], 1.0, 2.0)
    corrected = CorrectedModel(base_model(), c).for_allocation(4, False)
    plain = base_model().for_allocation(4, False)
    a = solve_for_batch(128, ["fast", "slow"], corrected, 8)
    b = solve_for_batch(128, ["fast", "slow"], plain, 8)
    assert a.iteration_time == pytest.approx(2 * b.iteration_time)
    assert (a.local_batch_size, a.workers) == (b.local_batch_size, b.workers)


def test_emulation_host_share_slows_compute_only():
    """4 emulated GPUs on a host that runs 2 at once: t_vsw, t_update and the overhead double,
    the all-reduce does not."""
    shared = base_model(host_devices=2).for_allocation(4, False)
    alone = base_model().for_allocation(4, False)
    a, b = shared.breakdown("fast", 16, 2, 1), alone.breakdown("fast", 16, 2, 1)
    assert shared.host_share == 2.0
    assert a.t_vsw == pytest.approx(2 * b.t_vsw) and a.t_update == pytest.approx(2 * b.t_update)
    assert a.t_comm == pytest.approx(b.t_comm)
    two = base_model(host_devices=2).for_allocation(2, False)
    assert two.host_share == 1.0 and two.iteration_time("fast", 16, 2, 1) == \
        pytest.approx(base_model().for_allocation(2, False).iteration_time("fast", 16, 2, 1))
    assert math.isclose(base_model(host_devices=3).for_allocation(6, True).host_share, 2.0)
