"""Shared plain types: Plan / ClusterSpec JSON round-trips, cluster files, pair validation and
ClusterSpec.from_ray (fake ray.nodes() records and one live local Ray)."""
from __future__ import annotations

import json

import pytest

from jabasray.types import ClusterSpec, Plan, WorkerConfig


def test_plan_json_round_trip(tmp_path):
    plan = Plan(global_batch_size=96, local_batch_size=8,
                workers=[WorkerConfig("v100", 2, 1), WorkerConfig("p100", 1, 1)],
                iteration_time=0.125, requested_global_batch_size=100, weight_sync="ows")
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert isinstance(again.workers[0], WorkerConfig) and again.workers[0].num_workers == 4
    assert again.num_workers_per_group == 6 and again.throughput == 96 / 0.125
    assert again.per_type() == {"v100": (2, 1), "p100": (1, 1)}
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path) == plan


def test_cluster_files_and_pairs(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("nodes:\n  - {name: a0, gpu_type: v100, num_gpus: 4, tflops: 14.13}\n"
                 "  - {name: b0, gpu_type: p100, num_gpus: 3}\n")
    cl = ClusterSpec.from_file(y)
    assert cl.gpu_types == ["p100", "v100"] and cl.node("a0").price_weight == 14.13
    with pytest.raises(ValueError, match=r"nodes\[b0\].num_gpus must be even"):
        cl.validated_pairs()
    assert [n.num_gpus for n in cl.validated_pairs(drop_odd_gpu=True).nodes] == [4, 2]
    j = tmp_path / "c.json"
    j.write_text(cl.to_json())
    assert ClusterSpec.from_json(j.read_text()) == cl == ClusterSpec.from_file(j)
    (tmp_path / "bad.yaml").write_text("nodes:\n  - {gpu_type: v100, num_gpus: 2, colour: red}\n")
    with pytest.raises(ValueError, match="unknown field"):
        ClusterSpec.from_file(tmp_path / "bad.yaml")


def fake_nodes():
    return [
        {"NodeID": "aaaaaaaaaaaa", "Alive": True,
         "Resources": {"CPU": 8.0, "GPU": 4.0, "accelerator_type:V100": 1.0}},
        {"NodeID": "bbbbbbbbbbbb", "Alive": True, "Resources": {"CPU": 4.0, "gpu_slow": 2.0, "gpu_fast": 4.0}},
        {"NodeID": "cccccccccccc", "Alive": False, "Resources": {"GPU": 2.0}},
        {"NodeID": "dddddddddddd", "Alive": True, "Resources": {"CPU": 16.0}},
        {"NodeID": "eeeeeeeeeeee", "Alive": True, "Resources": {"GPU": 3.0}},
    ]


def test_from_ray_with_fake_nodes():
    cl = ClusterSpec.from_ray(fake_nodes(), speeds={"slow": 0.5}, memory_gb={"v100": 16.0})
    got = [(n.name, n.gpu_type, n.num_gpus, n.speed) for n in cl.nodes]
    assert got == [("aaaaaaaa-v100", "v100", 4, 1.0), ("bbbbbbbb-slow", "slow", 2, 0.5),
                   ("bbbbbbbb-fast", "fast", 4, 1.0), ("eeeeeeee-gpu", "gpu", 3, 1.0)]
    with pytest.raises(ValueError, match=r"nodes\[eeeeeeee-gpu\].num_gpus must be even"):
        cl.validated_pairs()
    assert len(cl.validated_pairs(drop_odd_gpu=True).nodes) == 4
    with pytest.raises(ValueError, match="no alive node with GPUs"):
        ClusterSpec.from_ray([{"NodeID": "x", "Alive": True, "Resources": {"CPU": 1.0}}])
    assert ClusterSpec.from_json(cl.to_json()) == cl


@pytest.mark.ray
def test_from_ray_live(ray_session):
    from jabasray.actors.placement import ray_cluster_spec
    cl = ray_cluster_spec()
    assert sorted(n.gpu_type for n in cl.nodes) == ["a", "b", "fast", "slow"]
    assert all(n.num_gpus == 8 for n in cl.nodes)
    assert json.loads(cl.to_json())["nodes"][0]["num_gpus"] == 8
