"""Pack size from memory (``jabasray.tuner.pack_size``): the formula against a direct count,
the probe configurations of a Tune space, the choice on CPU and on a GPU (the GPU's task
replaced by a recorder here; the real measurement is cuda-marked), and ``packed()`` with no
``members_per_device``."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from jabasray.tuner import packed
from jabasray.tuner.digits import TABLE3_PARAM_VALUES, digits_mlp_spec
from jabasray.tuner.pack_size import (CPU_MEMBERS, MAX_MEMBERS, MEMORY_FRACTION, choose_members_per_device,
                                      measure_member_bytes, members_that_fit, probe_configs)

tune = pytest.importorskip("ray.tune")

SPEC = digits_mlp_spec(steps_per_unit=1)


def test_members_that_fit_is_the_largest_count_whose_sum_fits_the_budget():
    """Against a direct count: the largest k with k * m <= fraction * total, at least 1, at
    most the cap -- for every (m, total) of a small grid."""
    for m in (1, 3, 7, 100, 999, 5000):
        for total in (10, 1000, 4096, 10_000):
            k = 0
            while (k + 1) * m <= 0.8 * total:
                k += 1
            assert members_that_fit(m, total, 0.8, cap=MAX_MEMBERS) == min(MAX_MEMBERS, max(1, k)), (m, total)
    assert members_that_fit(1, 1e9, cap=5) == 5
    assert members_that_fit(2e9, 1e9) == 1                     # one member always runs (alone)


@pytest.mark.parametrize("field,args,allowed", [
    ("member_bytes", (0, 10), "a number in (0.0, inf], got 0"),
    ("total_bytes", (1, -1), "a number in (0.0, inf], got -1"),
    ("fraction", (1, 10, 1.5), "a number in (0.0, 1.0], got 1.5"),
    ("cap", (1, 10, 0.5, 0), "an integer >= 1, got 0")])
def test_bad_values_are_one_line_errors_naming_the_field(field, args, allowed):
    with pytest.raises(ValueError) as e:
        members_that_fit(*args)
    msg = str(e.value)
    assert msg == f"{field} must be {allowed}"


SPACE = {"batch_size": tune.choice([16, 64, 32]), "lr": tune.loguniform(1e-4, 1e-1),
         "optimizer": tune.choice(["sgd", "adam"]), "activation": tune.choice(["relu", "tanh", "elu"]),
         "hidden": tune.randint(8, 33), "depth": tune.grid_search([1, 3, 2]), "const": 5}


def test_probe_configs_take_every_key_at_its_largest_and_each_category_once():
    base = {"batch_size": 64, "lr": 0.1, "optimizer": "sgd", "activation": "relu", "hidden": 32,
            "depth": 3, "const": 5}
    assert probe_configs(SPACE) == [base, {**base, "optimizer": "adam"}, {**base, "activation": "tanh"},
                                    {**base, "activation": "elu"}]


class Recorder:
    """Stands in for the Ray task on one GPU: records what it was asked, returns a fixed peak
    and an 80 GiB device."""

    def __init__(self, peak: int) -> None:
        self.peak, self.calls = peak, []

    def __call__(self, spec_blob, probes):
        self.calls.append(probes)
        return self.peak, 80 * 2 ** 30, "Test GPU"


def test_cpu_keeps_the_default_and_measures_nothing():
    rec = Recorder(1)
    assert choose_members_per_device(SPEC, SPACE, gpu=False, measure=rec) == CPU_MEMBERS
    assert rec.calls == []


def test_gpu_pack_size_from_the_measured_worst_probe():
    rec = Recorder(peak=3 * 2 ** 30)
    k = choose_members_per_device(SPEC, SPACE, gpu=True, measure=rec)
    assert rec.calls == [probe_configs(SPACE)]                       # every probe measured, once
    assert k == math.floor(MEMORY_FRACTION * 80 / 3) == 21


def test_gpu_pack_size_from_memory_fn_measures_no_member():
    """With ``TrainingSpec.memory_fn`` the task only reads the device's memory (no probes); the
    worst probe by memory_fn decides."""
    spec = replace(SPEC, memory_fn=lambda c: c["batch_size"] * c["hidden"] * (3 if c["optimizer"] == "adam" else 2) * 2 ** 20)
    rec = Recorder(peak=0)
    k = choose_members_per_device(spec, SPACE, gpu=True, measure=rec)
    assert rec.calls == [[]]
    worst = 64 * 32 * 3 * 2 ** 20                                   # the adam probe
    assert k == members_that_fit(worst, 80 * 2 ** 30) == 10


def test_gpu_without_a_param_space_needs_members_per_device():
    with pytest.raises(ValueError, match="^members_per_device must be given when param_space is not"):
        choose_members_per_device(SPEC, None, gpu=True, measure=Recorder(1))


def test_packed_without_members_per_device_packs_8_per_cpu_and_checks_given_values():
    def cpu(t) -> float:
        return t.default_resource_request({}).required_resources.get("CPU", 0.0)

    space = {"batch_size": tune.choice([16, 32])}
    assert cpu(packed(SPEC, max_units=3, param_space=space, pack=True)) == pytest.approx(1 / CPU_MEMBERS)
    assert cpu(packed(SPEC, max_units=3, param_space=space, trials_per_device=12, pack=True)) == pytest.approx(1 / 12)
    with pytest.raises(ValueError, match="^members_per_device must be an integer >= 1, got 0$"):
        packed(SPEC, max_units=3, param_space=space, members_per_device=0, pack=True)
    with pytest.raises(ValueError, match=r"^trials_per_device must be >= members_per_device \(8, chosen from memory\), got 4$"):
        packed(SPEC, max_units=3, param_space=space, trials_per_device=4, pack=True)


@pytest.mark.cuda
def test_a_members_peak_on_a_gpu_grows_with_its_batch():
    spec = digits_mlp_spec(steps_per_unit=1, device="cuda")
    base = probe_configs({k: tune.choice(v) for k, v in TABLE3_PARAM_VALUES.items()})[0]
    small = measure_member_bytes(spec, {**base, "batch_size": 8}, "cuda:0")
    large = measure_member_bytes(spec, {**base, "batch_size": 4096}, "cuda:0")
    assert 0 < small < large


@pytest.mark.cuda
@pytest.mark.ray
def test_gpu_coordinators_start_before_the_first_trial(ray_session):
    """packed() on a GPU starts the coordinator of every free GPU (named by Ray's assignment,
    as a trial's is) before Tune starts any trial."""
    from jabasray.tuner import coordinator_stats

    ray = ray_session
    spec = digits_mlp_spec(steps_per_unit=1, device="cuda")
    try:
        packed(spec, max_units=2, param_space={"batch_size": tune.choice([16, 32])}, members_per_device=2,
               pack=True)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "jabasray"]
        gpus = int(ray.cluster_resources().get("GPU", 0))
        assert sum("/gpu" in n for n in names) == gpus >= 1
    finally:
        coordinator_stats(release=True)
