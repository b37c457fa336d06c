"""The Tune internals jabasray.tuner uses (jabasray/tuner/tune_internals.py), against the
installed Ray, without starting Ray.

The first test is the loud one: on a Ray outside the tested range, or one that lacks an
internal, it fails with one line per problem saying what and where. The others prove the
checker itself: an untested version and a removed internal are each reported in one line, a
missing internal stops ``require`` (one-line TuneInternalsError) before a scheduler is built.
"""
from __future__ import annotations

import pytest

pytest.importorskip("ray.tune")

from jabasray.tuner import tune_internals as ti   # noqa: E402


def test_the_installed_ray_is_tested_and_has_every_tune_internal_used():
    found = ti.problems()
    assert not found, "\n".join(found)


@pytest.mark.parametrize("version, ok", [("2.60.0", True), ("2.60.3", True), ("2.61.0", False),
                                         ("2.59.1", False), ("3.0.0", False), ("nightly", False)])
def test_versions_outside_the_tested_range_are_one_line(version, ok):
    msg = ti.version_problem(version)
    assert (msg is None) == ok
    if not ok:
        assert "\n" not in msg and f"Ray {version} is outside the range" in msg and "2.60" in msg


def test_pyproject_admits_exactly_the_tested_ray_releases():
    """pyproject's ``ray`` requirement is TESTED_RAY: from its oldest minor release up to, not
    including, the minor release after its newest one (a Ray pip would install is one the
    suite passed on)."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    ray_reqs = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "ray"]
    assert len(ray_reqs) == 1
    (lo_major, lo_minor), (hi_major, hi_minor) = ti.TESTED_RAY
    assert ray_reqs[0].specifier == SpecifierSet(f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}")


def test_a_missing_internal_is_named_and_stops_require(monkeypatch):
    from ray.tune.schedulers import hyperband as hb

    monkeypatch.delattr(hb._Bracket, "cleanup_full")
    monkeypatch.setattr(ti, "_checked", False)
    assert ti.missing_internals() == ["_Bracket.cleanup_full('tune_controller',)"]
    msg = ti.problems("2.60.0")
    assert len(msg) == 1 and "lacks Tune internals" in msg[0] and "_Bracket.cleanup_full" in msg[0]
    with pytest.raises(ti.TuneInternalsError, match=r"^Ray \S+ lacks Tune internals jabasray.tuner "
                                                    r"uses: _Bracket.cleanup_full"):
        ti.finishing_hyperband_class()


def test_a_changed_signature_counts_as_missing(monkeypatch):
    from ray.tune.schedulers import hyperband as hb

    def _process_bracket(self, controller, bracket, extra):   # a new argument
        return None
    monkeypatch.setattr(hb.HyperBandScheduler, "_process_bracket", _process_bracket)
    assert ti.missing_internals() == ["HyperBandScheduler._process_bracket('tune_controller', 'bracket')"]


def test_the_scheduler_is_built_from_the_isolated_class():
    from jabasray.tuner.schedulers import hyperband_scheduler

    s = hyperband_scheduler(max_t=9, reduction_factor=3)
    assert type(s).__name__ == "FinishingHyperBand"
    assert type(s).__module__ == "jabasray.tuner.tune_internals"
