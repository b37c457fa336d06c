"""``packed()``'s arguments: a class Trainable whose resources admit ``trials_per_device``
trials per device, and one-line ValueErrors before any Ray work (Ray is not started)."""
from __future__ import annotations

import pytest

from jabasray.tuner import packed
from jabasray.tuner.digits import digits_mlp_spec

tune = pytest.importorskip("ray.tune")

SPEC = digits_mlp_spec(steps_per_unit=1)


def _cpu(trainable) -> float:
    pgf = trainable.default_resource_request({})
    return pgf.required_resources.get("CPU", 0.0)


def test_packed_is_a_class_trainable_reserving_its_share_of_a_device():
    t = packed(SPEC, max_units=3, stream_batch=40, members_per_device=4)
    assert isinstance(t, type) and issubclass(t, tune.Trainable)
    assert _cpu(t) == pytest.approx(1 / 4)
    more = packed(SPEC, max_units=3, stream_batch=40, members_per_device=4, trials_per_device=8)
    assert _cpu(more) == pytest.approx(1 / 8)                   # 8 admitted, 4 seated per unit


def test_bad_arguments_are_one_line_value_errors():
    with pytest.raises(ValueError, match="trials_per_device must be an integer >= 4, got 2"):
        packed(SPEC, max_units=3, stream_batch=40, members_per_device=4, trials_per_device=2)
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
        packed(SPEC, max_units=3, stream_batch=40, members_per_device=4, threads=0)
    with pytest.raises(ValueError, match="spec must be a jabasray.tuner.TrainingSpec"):
        packed(object(), max_units=3, stream_batch=40)
    with pytest.raises(ValueError, match="stream_batch must be given"):
        packed(SPEC, max_units=3)
