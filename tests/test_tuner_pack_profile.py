"""The measurement behind ``packed(pack="auto")``: one cost per term of the cost model, from
the spec's own training at the given configurations, cached per host and per sweep."""
from __future__ import annotations

import json

import pytest

from jabasray.tuner import pack_profile
from jabasray.tuner.digits import digits_mlp_spec

CONFIGS = [{"batch_size": 20, "optimizer": "adam", "lr": 0.01, "activation": "relu"},
           {"batch_size": 40, "optimizer": "sgd", "lr": 0.05, "activation": "tanh"}]


def test_costs_are_measured_once_per_key_and_read_back_from_the_cache(tmp_path, monkeypatch):
    starts = []                   # child processes run (their imports are what a trial start costs)

    def fake_child(code):
        starts.append(code)
        return {pack_profile.RELAY_IMPORTS: 1.5, pack_profile.ALONE_IMPORTS: 3.0}[code]

    measured = []
    real_units = pack_profile._measure_units

    def counting_units(*args):
        measured.append(args[1])
        return real_units(*args)

    monkeypatch.setattr(pack_profile, "_child_cpu_s", fake_child)
    monkeypatch.setattr(pack_profile, "_measure_units", counting_units)
    # as in a process without Ray (in the whole suite an earlier module's Ray may still run here)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    spec = digits_mlp_spec(steps_per_unit=2)
    c = pack_profile.measure_pack_costs(spec, CONFIGS, 40, cache_dir=str(tmp_path), steps=2)
    # one packed unit per pack size 1..2; the start of a trial alone adds the data's build
    assert len(c.unit_packed_s) == 2 and all(t > 0 for t in c.unit_packed_s)
    assert c.unit_alone_s > 0 and c.load_s > 0 and c.relay_s == 0.0       # no Ray: no relay call
    assert c.start_relay_s == 1.5 and c.start_alone_s > 3.0 and c.start_coordinator_s == c.start_alone_s
    assert sorted(starts) == sorted([pack_profile.RELAY_IMPORTS, pack_profile.ALONE_IMPORTS])
    # the same sweep again: read from the cache, nothing re-measured
    again = pack_profile.measure_pack_costs(spec, CONFIGS, 40, cache_dir=str(tmp_path), steps=2)
    assert again == c and len(measured) == 1 and len(starts) == 2
    # other configurations are another sweep: measured, the host's process starts still cached
    pack_profile.measure_pack_costs(spec, CONFIGS[:1], 40, cache_dir=str(tmp_path), steps=2)
    assert len(measured) == 2 and len(starts) == 2
    files = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert files == ["packcost", "packcost", "trialstart"]
    assert all(json.loads(p.read_text()) for p in tmp_path.iterdir())          # plain JSON


def test_a_child_process_start_is_its_cpu_time():
    assert pack_profile._child_cpu_s("sum(range(10 ** 6))") > 0.0


def test_no_configuration_to_measure_is_a_value_error():
    with pytest.raises(ValueError, match="configs must hold at least one configuration"):
        pack_profile.measure_pack_costs(digits_mlp_spec(), [], 40, cache_dir=None)


def test_a_cpu_unit_is_timed_in_thread_cpu_seconds_a_gpu_unit_in_wall_time():
    """One torch thread on a CPU: a run costs its thread's CPU seconds (a busy machine's other
    processes, here a sleep, do not count); on a GPU, or with several threads, wall time."""
    import time

    def nap():
        time.sleep(0.2)
    assert pack_profile._time(nap, pack_profile._unit_clock("cpu", 1)) < 0.1
    assert pack_profile._time(nap, pack_profile._unit_clock("cuda:0", 1)) >= 0.2
    assert pack_profile._time(nap, pack_profile._unit_clock("cpu", 2)) >= 0.2


def test_alone_and_packed_units_are_timed_in_alternating_rounds(monkeypatch):
    """Every round times each variant (each configuration alone, packs of 1..K) once, so a
    change in the machine's load during the measurement shifts all of them alike."""
    from jabasray.tuner.pack_runner import PackRunner
    from jabasray.tuner.trainable import PlainMember

    calls = []
    plain_unit, pack_unit = PlainMember.unit, PackRunner.unit

    def alone(self):
        calls.append(("alone", self.b, self.spec.steps_per_unit))
        return plain_unit(self)

    def packed(self, keys):
        calls.append(("pack", len(keys), self.spec.steps_per_unit))
        return pack_unit(self, keys)
    monkeypatch.setattr(PlainMember, "unit", alone)
    monkeypatch.setattr(PackRunner, "unit", packed)
    out = pack_profile._measure_units(digits_mlp_spec(steps_per_unit=8), CONFIGS, 40, 1, 2, repeats=3)
    # each variant at units of 2 and 4 steps
    variants = {(kind, x, n) for kind, xs in (("alone", (20, 40)), ("pack", (1, 2))) for x in xs for n in (2, 4)}
    assert set(calls[:8]) == variants                               # the warm-up
    rounds = [calls[8 + 8 * r: 16 + 8 * r] for r in range(3)]
    assert len(calls) == 32 and all(set(r) == variants for r in rounds)
    assert len(out["unit_packed_s"]) == 2 and out["unit_alone_s"] > 0


def test_what_a_unit_pays_once_is_not_scaled_with_its_steps(monkeypatch):
    """A unit of N steps timed from units of n and 2n steps: a fixed cost of every unit (here
    30 ms of CPU added to each unit alone) counts once, as in the real unit, not N / n times."""
    import time

    from jabasray.tuner.trainable import PlainMember

    def burn(seconds):
        t0 = time.thread_time()
        while time.thread_time() - t0 < seconds:
            pass
    spec = digits_mlp_spec(steps_per_unit=400)
    base = pack_profile._measure_units(spec, CONFIGS[:1], 40, 1, 2, repeats=3)["unit_alone_s"]
    plain_unit = PlainMember.unit

    def slow_unit(self):
        burn(0.03)
        return plain_unit(self)
    monkeypatch.setattr(PlainMember, "unit", slow_unit)
    fixed = pack_profile._measure_units(spec, CONFIGS[:1], 40, 1, 2, repeats=3)["unit_alone_s"]
    # once: about base + 0.03; scaled with the steps it would be base + 6 s (30 ms x 400 / 2)
    assert fixed - base < 1.0


def test_a_new_measurement_revision_measures_again(tmp_path, monkeypatch):
    """Costs cached by an older measurement are not read back once the measurement changes."""
    measured = []
    monkeypatch.setattr(pack_profile, "_child_cpu_s", lambda code: 1.0)
    monkeypatch.setattr(pack_profile, "_measure_units", lambda *a: measured.append(1) or {
        "data_s": 0.0, "load_s": 0.0, "unit_alone_s": 1.0, "unit_packed_s": [1.0]})
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    spec = digits_mlp_spec(steps_per_unit=2)
    pack_profile.measure_pack_costs(spec, CONFIGS[:1], 40, cache_dir=str(tmp_path))
    pack_profile.measure_pack_costs(spec, CONFIGS[:1], 40, cache_dir=str(tmp_path))
    assert len(measured) == 1
    monkeypatch.setattr(pack_profile, "REVISION", pack_profile.REVISION + 1)
    pack_profile.measure_pack_costs(spec, CONFIGS[:1], 40, cache_dir=str(tmp_path))
    assert len(measured) == 2


def test_a_packed_unit_is_taken_at_configurations_of_the_mean_cost_alone():
    # the first configuration costs 1 alone, the second 3 (mean 2): a pack of the first alone
    # (2 s) is a pack of one mean configuration at 4 s; the pack of both is already at the mean
    assert pack_profile.typical_packed([2.0, 3.0], [1.0, 3.0]) == [4.0, 3.0]
    assert pack_profile.typical_packed([2.0, 3.0], [2.0, 2.0]) == [2.0, 3.0]
