"""Ray Train's ``ScalingConfig`` on JabasTrainer: converted with Ray's meanings (num_workers as
the most GPUs the auto-scaler may use, use_gpu=False as GPUs emulated on CPU, the accelerator
type) or refused in one line; ``ClusterSpec.limited`` checked against brute force. The last test
trains on the converted cluster and makes a GPU actor's step raise: the error names the hook and
shows the user's own frame, not Ray's wrapper."""
from __future__ import annotations

import itertools
import random

import pytest

import actors_helpers
from actors_helpers import model_fn, optimizer_fn, perf_model, step_failing_on_the_actors, tiny_data
from jabasray.actors.driver import DriverOptions
from jabasray.actors.trainer import JabasTrainer
from jabasray.config import JobConfig, RunConfig, Scaling, scaling_from_ray
from jabasray.errors import HookError
from jabasray.types import ClusterSpec, NodeSpec

ray_train = pytest.importorskip("ray.train")
ScalingConfig = ray_train.ScalingConfig


def _fewest_nodes(cluster: ClusterSpec, max_gpus: int) -> int:
    """Brute force: the fewest nodes whose GPUs reach min(max_gpus, all GPUs)."""
    want = min(max_gpus, sum(n.num_gpus for n in cluster.nodes))
    for k in range(1, len(cluster.nodes) + 1):
        if any(sum(n.num_gpus for n in c) >= want for c in itertools.combinations(cluster.nodes, k)):
            return k
    raise AssertionError("unreachable")


def test_limited_takes_the_fewest_nodes_and_exactly_the_gpus_asked_for():
    rng = random.Random(0)
    for case in range(300):
        nodes = [NodeSpec(f"n{i}", "a100", rng.randint(1, 8)) for i in range(rng.randint(1, 5))]
        cluster, total = ClusterSpec(nodes=nodes), sum(n.num_gpus for n in nodes)
        for max_gpus in range(1, total + 3):
            got = cluster.limited(max_gpus)
            assert sum(n.num_gpus for n in got.nodes) == min(max_gpus, total), (case, max_gpus)
            assert len(got.nodes) == _fewest_nodes(cluster, max_gpus), (case, max_gpus)
            by_name = {n.name: n for n in nodes}
            assert all(n.num_gpus <= by_name[n.name].num_gpus and n.gpu_type == "a100" for n in got.nodes)


def test_limited_by_type_and_refusing_an_ambiguous_choice():
    mixed = ClusterSpec(nodes=[NodeSpec("v0", "V100", 4), NodeSpec("p0", "P100", 2), NodeSpec("v1", "V100", 2)])
    assert mixed.limited(5, "v100").nodes == [NodeSpec("v0", "V100", 4), NodeSpec("v1", "V100", 1)]
    assert mixed.limited(8) == mixed                    # every GPU within the bound: all of them
    with pytest.raises(ValueError) as e:
        mixed.limited(3)
    assert str(e.value) == ("num_workers: 3 of the cluster's 8 GPUs of types ['P100', 'V100'] - say "
                            "which: accelerator_type=one of ['P100', 'V100'], or cluster=ClusterSpec(...) "
                            "listing the GPUs to use")
    with pytest.raises(ValueError, match=r"^accelerator_type: no GPU of type 'A100' in the cluster, "
                                         r"which has \['P100', 'V100'\]$"):
        mixed.limited(2, "A100")


def test_ray_scaling_configs_are_converted_or_refused_in_one_line():
    assert scaling_from_ray(ScalingConfig(num_workers=4, use_gpu=True, accelerator_type="A100")) == \
        Scaling(4, True, "A100")
    assert scaling_from_ray(ScalingConfig(num_workers=2, use_gpu=True,
                                          resources_per_worker={"GPU": 1, "accelerator_type:V100": 0.001})) == \
        Scaling(2, True, "V100")
    assert scaling_from_ray(ScalingConfig(num_workers=3)) == Scaling(3, False, None)
    for cfg, words in [
        (ScalingConfig(num_workers=2, use_gpu=True, placement_strategy="SPREAD"), "placement_strategy"),
        (ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 2}),
         "resources_per_worker['GPU']=2"),
    ]:
        with pytest.raises(ValueError) as e:
            scaling_from_ray(cfg)
        assert str(e.value).startswith(f"scaling_config: ScalingConfig sets {words}, which JabasTrainer "
                                       f"does not support") and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^scaling_config must be a ray.train.ScalingConfig, got builtins.dict$"):
        scaling_from_ray({"num_workers": 2})


def test_the_trainer_takes_a_scaling_config_as_ray_train_does():
    ds, _ = tiny_data(600)
    cpu = JabasTrainer(model_fn, ds, scaling_config=ScalingConfig(num_workers=3))
    assert cpu.cluster == ClusterSpec.emulated({"cpu": (1, 3, 1.0)}) and cpu.options.device == "cpu"
    gpu = JabasTrainer(model_fn, ds, scaling_config=ScalingConfig(num_workers=2, use_gpu=True))
    assert (gpu.cluster, gpu.options.device, gpu.scaling) == (None, "cuda", Scaling(2, True, None))
    from jabasray.train import JabasTorchTrainer

    loop = JabasTorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2))   # the loop API too
    assert loop.trainer.cluster == ClusterSpec.emulated({"cpu": (1, 2, 1.0)})
    with pytest.raises(ValueError, match="^scaling_config and cluster both say which GPUs to use"):
        JabasTrainer(model_fn, ds, cluster=ClusterSpec.emulated({"a": (1, 1, 1.0)}),
                     scaling_config=ScalingConfig(num_workers=2))
    with pytest.raises(ValueError, match=r"^scaling_config.use_gpu=True trains on cuda but options.device is 'cpu'"):
        JabasTrainer(model_fn, ds, scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
                     options=DriverOptions(device="cpu"))


@pytest.mark.usefixtures("ray_session")
def test_an_error_in_the_users_step_on_an_actor_names_the_hook_and_its_frame(tmp_path):
    ds, _ = tiny_data(96)
    trainer = JabasTrainer(model_fn, ds, optimizer_fn, step_fn=step_failing_on_the_actors,
                           job_config=JobConfig(epochs=1, initial_global_batch=16, min_global_batch=16,
                                                max_global_batch=16, min_local_batch=8, autoscale=False),
                           run_config=RunConfig(storage_path=str(tmp_path), name="fails"),
                           perf_model=perf_model({"cpu": 1.0}), verbose=0,
                           scaling_config=ScalingConfig(num_workers=1),
                           options=DriverOptions(driver="local", device="cpu"))
    with pytest.raises(HookError) as info:
        trainer.fit()
    e = info.value
    assert str(e) == "step_fn raised ZeroDivisionError: raised in the user's step"
    assert e.__cause__ is None and e.__suppress_context__          # no Ray wrapper printed above it
    assert e.__notes__[0].splitlines()[:2] == [
        "your code, where it failed:",
        f'  File "{actors_helpers.__file__}", line {step_failing_on_the_actors.__code__.co_firstlineno + 6}, '
        f"in step_failing_on_the_actors"]
