"""A real GPU cluster as Ray describes it (fake ``ray.nodes()`` records, no Ray started): GPU
types from node labels and ``accelerator_type`` resources, every node's actors pinned to it,
one GPU per actor, and what is left when a node dies."""
from __future__ import annotations

import pytest

from jabasray.actors.placement import (NODE_ID_LABEL, actor_name, drop_dead_nodes, pair_request,
                                       slots_for)
from jabasray.types import ACCELERATOR_LABEL, ClusterSpec, NodeSpec

A100_NODE = "a" * 56
V100_NODE = "b" * 56
L4_NODE = "c" * 56


def gpu_node(node_id: str, gpus: int, accelerator: str | None = None, label: str | None = None,
             alive: bool = True) -> dict:
    """A ``ray.nodes()`` record of a GPU node as Ray 2.60 reports it: ``accelerator_type:<X>``
    resource when Ray detected the GPU model, the ``ray.io/accelerator-type`` label when set."""
    res = {"CPU": 16.0, "GPU": float(gpus), "memory": 1e11, f"node:10.0.0.{node_id[0]}": 1.0}
    if accelerator:
        res[f"accelerator_type:{accelerator}"] = 1.0
    labels = {NODE_ID_LABEL: node_id}
    if label:
        labels[ACCELERATOR_LABEL] = label
    return {"NodeID": node_id, "Alive": alive, "Resources": res, "Labels": labels,
            "NodeManagerAddress": f"10.0.0.{node_id[0]}"}


def two_type_cluster_nodes() -> list[dict]:
    head = {"NodeID": "h" * 56, "Alive": True, "Resources": {"CPU": 8.0, "memory": 1e10},
            "Labels": {NODE_ID_LABEL: "h" * 56}}
    dead = gpu_node("d" * 56, 8, accelerator="H100", label="H100", alive=False)
    return [head, gpu_node(A100_NODE, 4, accelerator="A100", label="A100"),
            gpu_node(V100_NODE, 2, accelerator="V100"), dead]


def test_two_nodes_of_different_gpu_types_form_one_heterogeneous_cluster():
    """CPU-only head and dead node skipped; types lower-cased from the label (A100) or the
    accelerator_type resource (V100); counts from GPU; each NodeSpec knows its Ray node."""
    cl = ClusterSpec.from_ray(two_type_cluster_nodes(), memory_gb={"a100": 80.0})
    assert [(n.name, n.gpu_type, n.num_gpus, n.ray_node_id, n.memory_gb) for n in cl.nodes] == [
        ("aaaaaaaa-a100", "a100", 4, A100_NODE, 80.0),
        ("bbbbbbbb-v100", "v100", 2, V100_NODE, 16.0)]
    assert cl.gpu_types == ["a100", "v100"]


def test_type_precedence_gpu_resource_then_label_then_accelerator_then_plain_gpu():
    nodes = [
        # user-named gpu_<type> resource beats everything
        {**gpu_node("e" * 56, 2, accelerator="A100", label="A100"),
         "Resources": {"GPU": 2.0, "accelerator_type:A100": 1.0, "gpu_big": 2.0}},
        gpu_node(L4_NODE, 2, accelerator="T4", label="L4"),   # the label beats the resource
        gpu_node("f" * 56, 2, accelerator="T4"),               # resource only
        gpu_node("g" * 56, 2),                                 # nothing says which GPU
    ]
    cl = ClusterSpec.from_ray(nodes)
    assert [n.gpu_type for n in cl.nodes] == ["big", "l4", "t4", "gpu"]


def test_records_without_node_id_are_not_pinned():
    cl = ClusterSpec.from_ray([{"Alive": True, "Resources": {"GPU": 2.0}}])
    assert cl.nodes[0].name == "node0-gpu" and cl.nodes[0].ray_node_id is None
    assert all(s.ray_node_id is None for s in slots_for(cl, {"node0-gpu": 2}))


def test_cpu_only_cluster_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^nodes: the Ray cluster has no alive node with GPUs"):
        ClusterSpec.from_ray([two_type_cluster_nodes()[0]])


def test_heterogeneous_job_one_gpu_per_actor_pinned_to_its_node():
    """Allocation {a100 node: 2 GPUs, v100 node: 2 GPUs}: ranks 0-1 on the A100 node, 2-3 on
    the V100 node; each pair's placement group asks for 1 GPU per bundle (num_gpus=1 per actor)
    and selects its node by Ray's node-id label."""
    cl = ClusterSpec.from_ray(two_type_cluster_nodes())
    slots = slots_for(cl, {"aaaaaaaa-a100": 2, "bbbbbbbb-v100": 2})
    assert [(s.rank, s.gpu_type, s.ray_node_id) for s in slots] == [
        (0, "a100", A100_NODE), (1, "a100", A100_NODE), (2, "v100", V100_NODE), (3, "v100", V100_NODE)]
    bundles, selector = pair_request(slots[2:], emulate=False, available={"GPU": 6.0, "CPU": 24.0})
    assert bundles == [{"GPU": 1.0}, {"GPU": 1.0}]
    assert selector == [{NODE_ID_LABEL: V100_NODE}, {NODE_ID_LABEL: V100_NODE}]
    # a cluster that also advertises gpu_<type> resources: the bundle asks for that too
    bundles, _ = pair_request(slots[:2], emulate=False, available={"GPU": 6.0, "gpu_a100": 4.0})
    assert bundles == [{"GPU": 1.0, "gpu_a100": 1.0}] * 2


def test_unpinned_emulated_pairs_have_no_selector():
    cl = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2)])
    bundles, selector = pair_request(slots_for(cl, {"n0": 2}), emulate=True)
    assert bundles == [{"gpu_fast": 1.0}] * 2 and selector is None


def test_drop_dead_nodes_keeps_alive_and_unpinned_nodes():
    cl = ClusterSpec(nodes=[NodeSpec("a", "a100", 4, ray_node_id=A100_NODE),
                            NodeSpec("b", "v100", 2, ray_node_id=V100_NODE),
                            NodeSpec("file", "v100", 2)])
    assert [n.name for n in drop_dead_nodes(cl, {A100_NODE}).nodes] == ["a", "file"]
    assert drop_dead_nodes(ClusterSpec(nodes=cl.nodes[:2]), set()) is None


def test_ray_node_id_survives_the_checkpoint_json_round_trip():
    cl = ClusterSpec.from_ray(two_type_cluster_nodes())
    assert ClusterSpec.from_json(cl.to_json()) == cl


def test_actor_names_say_run_generation_node_and_rank():
    cl = ClusterSpec.from_ray(two_type_cluster_nodes())
    slot = slots_for(cl, {"bbbbbbbb-v100": 2})[1]
    assert actor_name("digits-1a2b3c", 2, slot) == "jabasray:digits-1a2b3c:g2:bbbbbbbb-v100:rank1"
