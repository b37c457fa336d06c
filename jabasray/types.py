"""Plain data shared by all layers: the cluster, an allocation of its GPUs, and a Plan.

Everything here is a dataclass (or NamedTuple) with a lossless JSON round-trip
(:class:`jabasray.serialization.JsonMixin`). No torch, no ray imports at module level.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from .serialization import JsonMixin
from .validation import check_float, check_int

log = logging.getLogger(__name__)

ACCELERATOR_LABEL = "ray.io/accelerator-type"   # Ray's node label naming a node's GPU type

# Similarity units (JABAS section 6.1 splits the allocation into two identical groups).
# Two GPUs of one node form a *pair*: one GPU in each group, both running the same
# configuration. A GPU left without a partner (one-GPU nodes, an odd count) is a *solo* unit:
# it runs both groups' decoupled workers itself, as two equal halves of its VSWs. Solvers see a
# unit as a type name; a solo unit's name is its GPU type with this suffix.
SOLO_SUFFIX = "/solo"


def accelerator_type_of(device_name: str) -> str | None:
    """Ray's accelerator type of an NVIDIA device called ``device_name`` (what Ray 2.60 puts in
    a GPU node's ``accelerator_type:<TYPE>`` resource and ``ray.io/accelerator-type`` label), by
    Ray's rule written out here so that the profiler needs no Ray: after the first word (the
    vendor or "Tesla"), any all-capital words followed by the leading capitals and digits of
    the next word, which must hold a digit, joined by ``-`` (``NVIDIA A100-SXM4-80GB`` ->
    ``A100``, ``NVIDIA RTX PRO 6000 Blackwell`` -> ``RTX-PRO-6000``); otherwise the name
    without a leading ``NVIDIA``, spaces as ``-`` (``NVIDIA GeForce RTX 4090`` ->
    ``GeForce-RTX-4090``). None for an empty name. ``tests/test_ray_internals.py`` checks this
    against Ray's own rule."""
    words = device_name.split()
    if len(words) >= 2 and re.fullmatch(r"\w+", words[0]):
        caps: list[str] = []
        for word in words[1:]:
            model = re.match(r"[A-Z0-9]*", word).group(0)
            if any(c.isdigit() for c in model):
                name = "-".join([*caps, model])
                if len(name) > 1:
                    return name
                break
            if not re.fullmatch(r"[A-Z]+", word):
                break
            caps.append(word)
    rest = re.sub(r"^NVIDIA\s+", "", device_name).strip()
    return rest.replace(" ", "-") or None


def solo_unit(gpu_type: str) -> str:
    """The unit name of a solo GPU of ``gpu_type``."""
    return gpu_type + SOLO_SUFFIX


def unit_gpu(unit: str) -> tuple[str, bool]:
    """``(GPU type, solo?)`` of a unit name."""
    if unit.endswith(SOLO_SUFFIX):
        return unit[: -len(SOLO_SUFFIX)], True
    return unit, False


def units_num_gpus(units: list[str] | tuple[str, ...]) -> int:
    """GPUs behind a list of units: 2 per pair, 1 per solo GPU."""
    return sum(1 if unit_gpu(u)[1] else 2 for u in units)


def node_units(gpu_type: str, num_gpus: int) -> list[str]:
    """Units of ``num_gpus`` GPUs of one node: ``num_gpus // 2`` pairs, then one solo GPU when
    the count is odd."""
    return [gpu_type] * (num_gpus // 2) + [solo_unit(gpu_type)] * (num_gpus % 2)


@dataclass(frozen=True)
class NodeSpec(JsonMixin):
    """One node: ``num_gpus`` identical GPUs of type ``gpu_type``."""

    name: str                      # unique node name, e.g. "node-a0"
    gpu_type: str                  # GPU type name, e.g. "v100"; all GPUs of a node share it
    num_gpus: int                  # GPUs on this node
    memory_gb: float = 16.0        # memory per GPU (GiB)
    speed: float = 1.0             # relative speed when emulated on CPU (1.0 = the CPU itself)
    tflops: float | None = None    # FP32 TFLOPS, for the cost model (Eq. 8); None -> speed
    ray_node_id: str | None = None # the Ray node that holds these GPUs (detected clusters): actors
                                   # of this node are placed there; None: any node with the resources
    launch_s: float | None = None  # None: the node exists; seconds: a node Ray's autoscaler must
                                   # launch first (a candidate of a NodeType), charged this long

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"node name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.gpu_type, str) or not self.gpu_type:
            raise ValueError(f"nodes[{self.name}].gpu_type must be a non-empty string, got {self.gpu_type!r}")
        check_int(f"nodes[{self.name}].num_gpus", self.num_gpus, min_value=1)
        check_float(f"nodes[{self.name}].memory_gb", self.memory_gb, min_value=0, min_exclusive=True)
        check_float(f"nodes[{self.name}].speed", self.speed, min_value=0, min_exclusive=True)
        if self.tflops is not None:
            check_float(f"nodes[{self.name}].tflops", self.tflops, min_value=0, min_exclusive=True)
        if self.launch_s is not None:
            check_float(f"nodes[{self.name}].launch_s", self.launch_s, min_value=0)

    @property
    def launched(self) -> bool:
        """Whether the node must be launched before its GPUs exist (``launch_s`` is set)."""
        return self.launch_s is not None

    @property
    def price_weight(self) -> float:
        """Price per GPU-second in arbitrary units, proportional to TFLOPS (Eq. 8 of JABAS)."""
        return self.tflops if self.tflops is not None else self.speed


DEFAULT_LAUNCH_S = 120.0   # seconds a node of a NodeType takes to launch when not given


@dataclass(frozen=True)
class NodeType(JsonMixin):
    """A kind of node Ray's autoscaler can launch (a node type of its cluster config):
    ``max_workers`` nodes of ``num_gpus`` GPUs of ``gpu_type`` each, at ``tflops`` per GPU
    (Eq. 8's price; None: ``speed``). Each launchable node is a candidate node of the
    auto-scaler, charged ``launch_s`` seconds (:mod:`jabasray.actors.cluster_view`)."""

    name: str                      # the autoscaler's node type name, e.g. "gpu_fast_2x"
    gpu_type: str                  # GPU type of its nodes (their gpu_<type> resource)
    num_gpus: int                  # GPUs per node
    max_workers: int = 1           # nodes of this type the autoscaler may run at once
    memory_gb: float = 16.0        # memory per GPU (GiB)
    speed: float = 1.0             # relative speed when emulated on CPU
    tflops: float | None = None    # FP32 TFLOPS per GPU (Eq. 8's price); None -> speed
    launch_s: float = DEFAULT_LAUNCH_S   # seconds from the request to the node's GPUs being usable

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"node_types name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.gpu_type, str) or not self.gpu_type:
            raise ValueError(f"node_types[{self.name}].gpu_type must be a non-empty string, "
                             f"got {self.gpu_type!r}")
        check_int(f"node_types[{self.name}].num_gpus", self.num_gpus, min_value=1)
        check_int(f"node_types[{self.name}].max_workers", self.max_workers, min_value=0)
        check_float(f"node_types[{self.name}].memory_gb", self.memory_gb, min_value=0, min_exclusive=True)
        check_float(f"node_types[{self.name}].speed", self.speed, min_value=0, min_exclusive=True)
        if self.tflops is not None:
            check_float(f"node_types[{self.name}].tflops", self.tflops, min_value=0, min_exclusive=True)
        check_float(f"node_types[{self.name}].launch_s", self.launch_s, min_value=0)

    def node(self, index: int) -> NodeSpec:
        """The ``index``-th launchable node of this type (not live: ``launch_s`` set, no Ray
        node id), named ``<type name>+<index>``."""
        return NodeSpec(name=f"{self.name}+{index}", gpu_type=self.gpu_type, num_gpus=self.num_gpus,
                        memory_gb=self.memory_gb, speed=self.speed, tflops=self.tflops,
                        launch_s=float(self.launch_s))


@dataclass(frozen=True)
class ClusterSpec(JsonMixin):
    """The GPUs a job may use, node by node.

    Any GPU count per node works: the two similarity groups are formed by pairs of GPUs and,
    for a GPU without a partner, by the two halves of its VSWs (:func:`node_units`).
    ``validated_pairs`` keeps only pairs (Crossbow SMA and burst modes, which need them).
    """

    nodes: list[NodeSpec] = field(default_factory=list)
    node_types: list[NodeType] = field(default_factory=list)   # nodes Ray's autoscaler can launch
                                   # (the auto-scaler's candidates beside ``nodes``: cluster_view)
    follow_ray: bool = False       # the job plans with the live Ray nodes, read again at every
                                   # epoch end (set by placement.ray_cluster_spec; cluster_view)

    def __post_init__(self) -> None:
        if not self.nodes and not self.node_types:
            raise ValueError("nodes must list at least one node (or node_types one node type "
                             "Ray's autoscaler can launch), got an empty list")
        types = [t.name for t in self.node_types]
        dup_types = {t for t in types if types.count(t) > 1}
        if dup_types:
            raise ValueError(f"node_types must have unique names, got duplicates {sorted(dup_types)}")
        names = [n.name for n in self.nodes]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"nodes must have unique names, got duplicates {sorted(dup)}")

    def limited(self, max_gpus: int, gpu_type: str | None = None) -> "ClusterSpec":
        """At most ``max_gpus`` GPUs of this cluster, of type ``gpu_type`` when given (matched
        case-insensitively). The fewest nodes hold them: nodes by GPU count, largest first
        (then in order), the last one taken cut to the GPUs still wanted. Several GPU types
        with more GPUs than ``max_gpus`` are ambiguous (which to leave out changes the job):
        one-line ValueError asking for a type or a cluster."""
        check_int("max_gpus", max_gpus, min_value=1)
        nodes = self.nodes
        if gpu_type is not None:
            nodes = [n for n in nodes if n.gpu_type.lower() == gpu_type.lower()]
            if not nodes:
                raise ValueError(f"accelerator_type: no GPU of type {gpu_type!r} in the cluster, "
                                 f"which has {self.gpu_types}")
        types = sorted({n.gpu_type for n in nodes})
        if sum(n.num_gpus for n in nodes) <= max_gpus:
            return ClusterSpec(nodes=list(nodes))
        if len(types) > 1:
            raise ValueError(f"num_workers: {max_gpus} of the cluster's {sum(n.num_gpus for n in nodes)} "
                             f"GPUs of types {types} - say which: accelerator_type=one of {types}, "
                             f"or cluster=ClusterSpec(...) listing the GPUs to use")
        kept, left = [], max_gpus
        for n in sorted(nodes, key=lambda n: -n.num_gpus):   # stable: ties keep their order
            if left == 0:
                break
            kept.append(n if n.num_gpus <= left else replace(n, num_gpus=left))
            left -= kept[-1].num_gpus
        return ClusterSpec(nodes=kept)

    def validated_pairs(self, drop_odd_gpu: bool = False) -> "ClusterSpec":
        """Return a spec whose nodes hold an even number of GPUs (>= 2), or raise naming the node."""
        out = []
        for n in self.nodes:
            if n.num_gpus % 2:
                if not drop_odd_gpu:
                    raise ValueError(
                        f"nodes[{n.name}].num_gpus must be even (GPUs are used in identical pairs), "
                        f"got {n.num_gpus}; pass drop_odd_gpu=True (--drop-odd-gpu) to leave one GPU out")
                log.warning("node %s: leaving out its odd GPU (%d -> %d)", n.name, n.num_gpus, n.num_gpus - 1)
                if n.num_gpus == 1:
                    continue
                n = replace(n, num_gpus=n.num_gpus - 1)
            out.append(n)
        if not out:
            raise ValueError("nodes: this mode needs GPUs in identical pairs on one node, "
                             "and no node has two GPUs")
        return replace(self, nodes=out)

    @property
    def gpu_types(self) -> list[str]:
        return sorted({n.gpu_type for n in self.nodes})

    def node(self, name: str) -> NodeSpec:
        found = self._by_name.get(name)
        if found is None:
            raise ValueError(f"node must be one of {[n.name for n in self.nodes]}, got {name!r}")
        return found

    @cached_property
    def _by_name(self) -> dict[str, NodeSpec]:
        # the auto-scaler looks nodes up by name for every candidate (a spec is not changed
        # after it is built: frozen, and its list is never mutated in place)
        return {n.name: n for n in self.nodes}

    @classmethod
    def from_file(cls, path: str | Path) -> "ClusterSpec":
        """Load a cluster from YAML or JSON: ``{nodes: [{name, gpu_type, num_gpus, ...}, ...]}``."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"cluster file {path}: {e.strerror}") from None
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml
                data = yaml.safe_load(text)
        except Exception as e:  # yaml.YAMLError / JSONDecodeError
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"cluster file {path} is not valid YAML/JSON: {first}") from None
        return cls.from_mapping(data, source=str(path))

    @classmethod
    def from_mapping(cls, data: object, source: str = "cluster") -> "ClusterSpec":
        """``{nodes: [{name, gpu_type, num_gpus, ...}], node_types: [{name, gpu_type, num_gpus,
        max_workers, tflops, memory_gb, speed, launch_s}]}`` (``node_types``: optional, what
        Ray's autoscaler can launch; ``nodes`` may then be empty)."""
        if not isinstance(data, dict) or not isinstance(data.get("nodes", []), list) or \
                ("nodes" not in data and not data.get("node_types")):
            raise ValueError(f"{source}: nodes must be a list of nodes, e.g. "
                             "{nodes: [{name: a0, gpu_type: v100, num_gpus: 4}]}")
        nodes = [NodeSpec(**nd) for nd in cls._records(data.get("nodes", []), NodeSpec, "nodes",
                                                       source, name_prefix="node")]
        if not isinstance(data.get("node_types", []), list):
            raise ValueError(f"{source}: node_types must be a list of node types, e.g. "
                             "{node_types: [{name: a100x4, gpu_type: a100, num_gpus: 4, max_workers: 2}]}")
        types = [NodeType(**nd) for nd in cls._records(data.get("node_types", []), NodeType,
                                                       "node_types", source, name_prefix="type")]
        return cls(nodes=nodes, node_types=types)

    @staticmethod
    def _records(items: list, kind: type, key: str, source: str, name_prefix: str) -> list[dict]:
        """The mappings of ``items`` checked against the fields of ``kind`` (unknown or missing
        fields name the entry); a missing name becomes ``<name_prefix><index>``."""
        out = []
        allowed = {f.name for f in fields(kind)}
        for i, nd in enumerate(items):
            if not isinstance(nd, dict):
                raise ValueError(f"{source}: {key}[{i}] must be a mapping, got {nd!r}")
            extra = set(nd) - allowed
            if extra:
                raise ValueError(f"{source}: {key}[{i}] has unknown field(s) {sorted(extra)}; "
                                 f"allowed: {sorted(allowed)}")
            missing = {"gpu_type", "num_gpus"} - set(nd)
            if missing:
                raise ValueError(f"{source}: {key}[{i}] is missing field(s) {sorted(missing)}")
            nd = dict(nd)
            nd.setdefault("name", f"{name_prefix}{i}")
            out.append(nd)
        return out

    @classmethod
    def emulated(cls, types: dict[str, tuple[int, int, float]]) -> "ClusterSpec":
        """Build a CPU-emulated cluster: ``{gpu_type: (num_nodes, gpus_per_node, speed)}``."""
        nodes = []
        for gpu_type, (num_nodes, per_node, speed) in types.items():
            for i in range(num_nodes):
                nodes.append(NodeSpec(name=f"{gpu_type}-{i}", gpu_type=gpu_type,
                                      num_gpus=per_node, speed=speed))
        return cls(nodes=nodes)

    @classmethod
    def from_ray(cls, nodes: list[dict], speeds: dict[str, float] | None = None,
                 memory_gb: dict[str, float] | None = None) -> "ClusterSpec":
        """Build the spec from Ray's node records (``nodes`` in the format of ``ray.nodes()``;
        pure: the live call is :func:`jabasray.actors.placement.ray_cluster_spec`).

        One NodeSpec per alive Ray node and GPU type, named ``<node id[:8]>-<type>`` (a longer
        id prefix where two nodes' ids share their first 8 characters), with
        ``ray_node_id`` set (placement pins the node's actors to it). GPU types come, in this
        order of precedence, from

        1. custom resources ``gpu_<type>`` (emulated or user-labelled GPUs; count = the resource
           amount; a node may carry several types, each becomes its own NodeSpec);
        2. the node label ``ray.io/accelerator-type`` (set by Ray on GPU nodes, or by the user:
           ``ray start --labels='{"ray.io/accelerator-type": "A100"}'``), count = ``GPU``;
        3. the resource ``accelerator_type:<TYPE>`` (Ray's GPU detection), count = ``GPU``;
        4. a bare ``GPU`` count: type ``"gpu"``.

        Types from labels and ``accelerator_type`` are lower-cased (``A100`` -> ``a100``). Nodes
        without GPUs are skipped. ``speeds``/``memory_gb`` map GPU type -> NodeSpec field.
        Odd GPU counts are kept; ``validated_pairs`` checks them.
        """
        if isinstance(nodes, (str, bytes, dict)) or not isinstance(nodes, (list, tuple)):
            raise ValueError(f"nodes must be a list of ray.nodes() records, got {type(nodes).__name__}")
        speeds = speeds or {}
        memory_gb = memory_gb or {}
        specs: list[NodeSpec] = []
        ids = [str(nd.get("NodeID") or nd.get("node_id") or f"node{i}") for i, nd in enumerate(nodes)
               if isinstance(nd, dict)]
        for i, nd in enumerate(nodes):
            if not isinstance(nd, dict):
                raise ValueError(f"nodes[{i}] must be a ray.nodes() mapping, got {nd!r}")
            if not nd.get("Alive", nd.get("alive", True)):
                continue
            res = nd.get("Resources") or nd.get("resources") or {}
            ray_id = nd.get("NodeID") or nd.get("node_id")
            node_id = str(ray_id or f"node{i}")
            types: dict[str, int] = {}
            for key, amount in res.items():
                if key.startswith("gpu_") and len(key) > 4 and int(amount) > 0:
                    types[key[4:]] = int(amount)
            if not types and int(res.get("GPU", 0)) > 0:
                labels = nd.get("Labels") or nd.get("labels") or {}
                accel = sorted(k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:"))
                label = labels.get(ACCELERATOR_LABEL)
                types[(label or (accel[0] if accel else "gpu")).lower()] = int(res["GPU"])
            for gpu_type, count in types.items():
                specs.append(NodeSpec(name=_node_name(node_id, gpu_type, ids), gpu_type=gpu_type,
                                      num_gpus=count, speed=float(speeds.get(gpu_type, 1.0)),
                                      memory_gb=float(memory_gb.get(gpu_type, 16.0)),
                                      ray_node_id=str(ray_id) if ray_id else None))
        if not specs:
            raise ValueError("nodes: the Ray cluster has no alive node with GPUs (resource GPU, "
                             "accelerator_type:* or gpu_<type>); to train without GPUs, emulate "
                             "them on CPU: cluster=ClusterSpec.emulated({'cpu': (1, 2, 1.0)}) with "
                             "DriverOptions(device='cpu'), or `jabasray train --device cpu`")
        return cls(nodes=specs)


def _node_name(node_id: str, gpu_type: str, ids: list[str]) -> str:
    """``<node id[:8]>-<type>``, the id prefix lengthened (by 4) while another of ``ids`` shares
    it (ids that agree in their first 8 characters, e.g. a fake cluster's)."""
    k = 8
    while k < len(node_id) and any(o != node_id and o[:k] == node_id[:k] for o in ids):
        k += 4
    return f"{node_id[:k]}-{gpu_type}"


class WorkerConfig(NamedTuple):
    """Configuration of one unit of group H in a plan: ``num_vsw`` VSWs, each with ``num_ga``
    GA steps, per group (a pair's two GPUs run it each; a solo GPU runs it twice: ``2 num_vsw``
    VSWs). ``gpu`` is the unit name (:func:`solo_unit`)."""

    gpu: str
    num_vsw: int
    num_ga: int

    @property
    def num_workers(self) -> int:
        """Decoupled workers on this GPU: n_vsw * (n_GA + 1)."""
        return self.num_vsw * (self.num_ga + 1)


@dataclass(frozen=True)
class Plan(JsonMixin):
    """A configuration chosen by the JABAS solver for ONE group H (the other group mirrors it).

    ``workers[i]`` configures unit ``i`` of group H (a pair, or a solo GPU that runs both
    groups' workers); the global batch actually used is
    ``global_batch_size = local_batch_size * 2 * sum(w.num_workers)`` (B_G* of Alg. 1, which
    may differ a little from the requested B_G because M is rounded).
    """

    global_batch_size: int                 # B_G* actually used
    local_batch_size: int                  # B_L
    workers: list[WorkerConfig]            # one per GPU of group H, in group order
    iteration_time: float                  # predicted seconds per iteration (max over GPUs)
    requested_global_batch_size: int = 0   # the B_G the solver was asked for
    weight_sync: str = "auto"              # "sws" | "ows" as predicted for every GPU, "mixed" when
                                           # they differ, "auto" when the model does not say
    worker_weight_sync: list[str] = field(default_factory=list)  # per workers[i]: the method the
                                           # prediction assumed, which its actors run ("auto": engine rule)
    bucket_plan: list[list[str]] | None = None  # gradient buckets (param names, backward order) the
                                                # actors run; None: the engine's size-capped default

    @property
    def throughput(self) -> float:
        """Samples per second: B_G* / iteration time (Eq. 7)."""
        return self.global_batch_size / self.iteration_time if self.iteration_time > 0 else 0.0

    @property
    def num_workers_per_group(self) -> int:
        return sum(w.num_workers for w in self.workers)

    def per_type(self) -> dict[str, tuple[int, int]]:
        """``{gpu_type: (num_vsw, num_ga)}``; GPUs of one type share a configuration when the
        solver gives them one (if not, the first GPU of the type is reported)."""
        out: dict[str, tuple[int, int]] = {}
        for w in self.workers:
            out.setdefault(w.gpu, (w.num_vsw, w.num_ga))
        return out
