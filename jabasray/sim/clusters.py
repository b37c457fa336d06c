"""Clusters to simulate: the JABAS paper's (Table 1) at any multiple of their size, a cluster
file, and profiles for GPU types nobody measured.

* :data:`PAPER_GPUS`: FP32 TFLOPS and memory of each GPU type of Table 1.
* :func:`paper_cluster`: cluster A (one node of four GPUs of each of V100, P100, TITAN RTX, RTX
  3090) or B (two nodes of four of each of RTX 2060, Quadro P4000, TITAN V, TITAN RTX) with
  ``num_gpus`` GPUs: the same mix of node types, each type's nodes repeated (B at 16 GPUs: one
  node of each type). Nodes carry their TFLOPS (the price of Eq. 8) and memory.
* :func:`cluster_from_arg`: ``A:64``, ``B:256`` or a cluster file
  (:meth:`jabasray.types.ClusterSpec.from_file`).
* :func:`type_profiles`: a profile for every GPU type of a cluster. A measured profile is used
  as it is; a type without one is derived from a measured reference type (an assumption, said
  in the result): compute times scale with FP32 TFLOPS (Eq. 8's premise; real training speed
  follows TFLOPS only roughly: tensor cores, memory bandwidth) and memory bounds the local
  batch and the VSWs - the local batches kept are those at most ``max B_L x memory ratio``,
  and each keeps ``floor(n_max x memory ratio)`` VSWs (at least one), its time at that count
  read off the reference's n_vsw curve (:func:`jabasray.planners.perf_model.vsw_time_at`).
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from ..planners.perf_model import vsw_time_at
from ..profiles import BatchProfile, Profile
from ..types import ClusterSpec, NodeSpec

# JABAS Table 1: GPU type -> (FP32 TFLOPS, memory in MB)
PAPER_GPUS: dict[str, tuple[float, float]] = {
    "v100": (14.13, 16160), "p100": (9.52, 16280), "titan-rtx": (16.31, 24220),
    "rtx3090": (35.58, 24260), "rtx2060": (6.45, 5933), "p4000": (5.30, 8119),
    "titan-v": (14.90, 12066), "a6000": (38.7, 48685), "titan-xp": (12.1, 12196)}

# JABAS Table 1: the nodes of clusters A and B (GPU type, GPUs per node), in the paper's order
PAPER_CLUSTERS: dict[str, list[tuple[str, int]]] = {
    "A": [("v100", 4), ("p100", 4), ("titan-rtx", 4), ("rtx3090", 4)],
    "B": [("rtx2060", 4), ("rtx2060", 4), ("p4000", 4), ("p4000", 4),
          ("titan-v", 4), ("titan-v", 4), ("titan-rtx", 4), ("titan-rtx", 4)]}


def paper_cluster(name: str, num_gpus: int | None = None) -> ClusterSpec:
    """Cluster ``name`` of Table 1 with ``num_gpus`` GPUs (module notes; None: its own size)."""
    if name not in PAPER_CLUSTERS:
        raise ValueError(f"cluster must be one of {sorted(PAPER_CLUSTERS)}, got {name!r}")
    types: dict[str, int] = {}
    for gpu, per_node in PAPER_CLUSTERS[name]:
        types[gpu] = per_node
    unit = sum(types.values())                 # one node of each type
    size = sum(g for _, g in PAPER_CLUSTERS[name])
    num_gpus = size if num_gpus is None else num_gpus
    if not isinstance(num_gpus, int) or num_gpus < unit or num_gpus % unit:
        raise ValueError(f"num_gpus of cluster {name} must be a multiple of {unit} (one node of "
                         f"each of its {len(types)} GPU types), got {num_gpus!r}")
    nodes = []
    for gpu, per_node in types.items():
        tflops, memory_mb = PAPER_GPUS[gpu]
        for i in range(num_gpus // unit):
            nodes.append(NodeSpec(f"{gpu}-{i}", gpu, per_node, memory_gb=memory_mb / 1024.0,
                                  speed=tflops / PAPER_GPUS["v100"][0], tflops=tflops))
    return ClusterSpec(nodes)


def cluster_from_arg(text: str) -> ClusterSpec:
    """``A``, ``A:64`` (a Table 1 cluster and its size) or the path of a cluster file."""
    name, _, size = text.partition(":")
    if name in PAPER_CLUSTERS:
        if size and not size.isdigit():
            raise ValueError(f"cluster: the size after {name}: must be a number of GPUs, got {size!r}")
        return paper_cluster(name, int(size) if size else None)
    if not Path(text).exists():
        raise ValueError(f"cluster must be a cluster file or one of {sorted(PAPER_CLUSTERS)} with an "
                         f"optional size (e.g. A:64), got {text!r}")
    return ClusterSpec.from_file(text)


def paper_type(name: str) -> str:
    """Table 1's name of a GPU type named as CUDA names it (``Tesla V100-PCIE-16GB`` ->
    ``v100``); a name it does not know stays as it is."""
    low = name.lower().replace("-", " ").replace("_", " ")
    for key in sorted(PAPER_GPUS, key=len, reverse=True):
        if key.replace("-", " ") in low or key.replace("-", "") in low.replace(" ", ""):
            return key
    return name


def derived_profile(reference: Profile, reference_node: NodeSpec, node: NodeSpec) -> Profile:
    """A profile of ``node``'s GPU type derived from ``reference`` measured on
    ``reference_node``'s (module notes: compute by TFLOPS, local batches and VSWs by memory)."""
    speed = _tflops(node) / _tflops(reference_node)
    memory = node.memory_gb / reference_node.memory_gb
    scaled = reference.scaled(speed, node.gpu_type)
    limit = reference.max_local_batch * memory
    batches = [_fewer_vsw(b, memory) for b in scaled.batches if b.local_batch <= limit]
    if not batches:
        raise ValueError(f"nodes[{node.name}]: its memory ({node.memory_gb:.1f} GB) holds no local "
                         f"batch the reference profile ({reference.gpu_type}, smallest B_L "
                         f"{reference.batches[0].local_batch}) measured")
    return replace(scaled, batches=batches)


def _tflops(node: NodeSpec) -> float:
    return node.tflops if node.tflops is not None else node.speed


def _fewer_vsw(point: BatchProfile, memory: float) -> BatchProfile:
    n = max(1, min(point.max_num_vsw, math.floor(point.max_num_vsw * memory)))
    if n == point.max_num_vsw:
        return point
    return replace(point, max_num_vsw=n, compute_time_max=vsw_time_at(point, n))


def type_profiles(profiles: dict[str, Profile], cluster: ClusterSpec, reference: str | None = None
                  ) -> tuple[dict[str, Profile], list[str]]:
    """A profile per GPU type of ``cluster``: measured where ``profiles`` has it, else derived
    from ``profiles[reference]`` (default: the first measured type of the cluster, else the
    first given) by :func:`derived_profile`. Returns the profiles and one note per derived type."""
    if not profiles:
        raise ValueError("profiles must hold at least one measured GPU type, got none")
    measured = [n for n in cluster.nodes if n.gpu_type in profiles]
    if reference is None:
        reference = measured[0].gpu_type if measured else next(iter(profiles))
    if reference not in profiles:
        raise ValueError(f"reference must be one of the profiled types {sorted(profiles)}, got {reference!r}")
    ref_node = next((n for n in cluster.nodes if n.gpu_type == reference), None)
    if ref_node is None:
        tflops, memory_mb = PAPER_GPUS.get(reference, (None, None))
        if tflops is None:
            raise ValueError(f"reference GPU type {reference!r} is not in the cluster and not in "
                             f"Table 1 {sorted(PAPER_GPUS)}: its TFLOPS and memory are unknown")
        ref_node = NodeSpec("reference", reference, 1, memory_gb=memory_mb / 1024.0, tflops=tflops)
    out, notes = {}, []
    for node in cluster.nodes:
        if node.gpu_type in out:
            continue
        if node.gpu_type in profiles:
            out[node.gpu_type] = profiles[node.gpu_type]
            continue
        out[node.gpu_type] = derived_profile(profiles[reference], ref_node, node)
        notes.append(f"{node.gpu_type}: derived from the {reference} profile (x{_tflops(node) / _tflops(ref_node):.2f} "
                     f"compute by TFLOPS, x{node.memory_gb / ref_node.memory_gb:.2f} memory)")
    return out, notes


__all__ = ["PAPER_GPUS", "PAPER_CLUSTERS", "paper_cluster", "cluster_from_arg", "paper_type", "derived_profile",
           "type_profiles"]
