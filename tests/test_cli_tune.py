"""``jabasray tune``: bad values are one line and exit code 2, before Ray starts."""
from __future__ import annotations

import sys

import pytest

from jabasray import cli


@pytest.mark.parametrize("extra,message", [
    (["--scheduler", "bogus"], "scheduler must be one of 'asha', 'hyperband', got 'bogus'"),
    (["--members-per-device", "0"], "members_per_device must be an integer >= 1, got 0"),
    (["--eta", "1"], "eta must be an integer >= 2, got 1"),
    (["--R", "0"], "R must be an integer >= 1, got 0"),
    (["--scheduler", "hyperband", "--R", "10"], "R must be a power of eta (Tune's HyperBandScheduler "
                                                "rounds log_eta R, so its brackets are the ones listed "
                                                "only then), got R=10, eta=3"),
])
def test_tune_bad_values_one_line(capsys, extra, message):
    ray_loaded = "ray" in sys.modules
    assert cli.main(["tune", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"jabasray tune: error: {message}"
    assert ("ray" in sys.modules) == ray_loaded          # rejected before Ray was imported
