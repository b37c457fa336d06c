"""Stream priorities (DeepPool section 5): the pure choice from CUDA's priority range.
The created streams' ``.priority`` is checked on a GPU in tests/test_cuda.py."""
from __future__ import annotations

import pytest
import torch

from jabasray.engine.streams import Lanes, stream_priorities, stream_priority


@pytest.mark.parametrize("rng,expected", [
    ((0, -5), (-5, 0)),      # cudaDeviceGetStreamPriorityRange on recent GPUs: (least, greatest)
    ((0, -3), (-3, 0)),      # torch caps greatest at -(max_compile_time_stream_priorities - 1)
    ((0, -1), (-1, 0)),
    ((-5, 0), (-5, 0)),      # either order of the pair
    ((0, 0), (0, 0)),        # a device without priorities: all default
])
def test_foreground_gets_the_greatest_priority_background_the_least(rng, expected):
    fg, bg = stream_priorities(rng)
    assert (fg, bg) == expected
    assert fg <= bg                      # CUDA: a lower number is a higher priority


def test_bad_priority_range_and_role_name_the_field():
    with pytest.raises(ValueError, match=r"^priority_range must be a pair of ints"):
        stream_priorities(None)
    with pytest.raises(ValueError, match=r"^priority_range must be a pair of ints"):
        stream_priorities((0, "x"))
    with pytest.raises(ValueError, match=r"^role must be one of"):
        stream_priority("urgent")
    with pytest.raises(ValueError, match=r"^role must be one of"):
        Lanes(torch.device("cpu"), role="urgent")
    assert stream_priority("default") == 0


def test_cpu_lanes_have_no_streams():
    lanes = Lanes(torch.device("cpu"))
    lanes.resize(3)
    assert lanes.vsw == [None] * 3 and lanes.comm is None and lanes.update is None
