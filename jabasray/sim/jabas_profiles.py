"""JABAS's published profiles -> our :class:`~jabasray.profiles.Profile` (paper section 5.1).

Source: the JABAS paper, section 5.1 (Eq. 1-6) and the profile files of its public
repository (unist-ssl/JABAS, ``examples/resnet50/quickstart``; a copy ships in
``profiles/jabas_resnet50``). The meaning of every field below is read from the code that
writes and reads them (IIDP's ``iidp/profiler/...`` and ``iidp/config/model/throughput``).

Folder layout (the quick start's)::

    cluster_info.json                                         node -> GPU type, count, bandwidths
    cluster_comp_profile_data/<B_L>/<node>/*_comp_profile.json one file per n_vsw ("num_models")
    cluster_mem_profile_data/<B_L>/<node>/max_memory_profile_info.json   n_max at B_L
    comm_profile_data/intra_comm_profile_data.txt             Eq. 3 within a node
    comm_profile_data/inter_comm_profile_data.txt             Eq. 3 across nodes (optional)
    bucket_profile_data/<one file>.json                       gradient bucket sizes

Field mapping (JABAS times are milliseconds, ours seconds: every time is divided by 1000)
----------------------------------------------------------------------------------------
Per GPU type g (``cluster_info[node]["type"]``) and local batch B_L:

* ``BatchProfile.max_num_vsw`` = n_max = the memory profile's ``max_num_models``.
* ``compute_time_1`` / ``compute_time_max`` = ``(data_time + fwd_time + bwd_time) / 1000`` of
  the compute profile with ``num_models`` = 1 / = n_max. IIDP's profiler times fwd and bwd of
  all n VSWs running concurrently (CUDA events around the whole round), so this is t_vsw of
  Eq. 2 at the two points Eq. 1's fit goes through. ``data_time`` (host-to-device copy of the
  round's inputs) is included because JABAS's own estimator counts it once per round, GA
  rounds included, exactly as Eq. 6 counts t_vsw; ``include_data_time=False`` gives the
  paper's fwd + bwd alone.
* ``zeta`` = ``(data_time + fwd_time) / (data_time + fwd_time + bwd_time)`` of the n_max file
  (JABAS takes its forward ratio from that file too; the input copy precedes the forward).
* Profiled n_vsw other than 1 and n_max (the P100's n = 2 at B_L = 32) are not used: Eq. 1
  goes exactly through the two points (JABAS's own code fits ``np.polyfit`` over all of them
  when n_max >= 3).

Per GPU type:

* ``optimizer_time`` t_optim = median of ``update_time`` / 1000 over all compute profiles of
  the type (the optimizer step does not depend on B_L or n_vsw; JABAS reads it per B_L from
  the n_max file, and the quick start's values spread 4.3-6.0 ms on the V100).
* ``copy_time`` t_copy = median over the profiles with n > 1 of ``copy_time / (n - 1) / 1000``
  (IIDP times the copy of the main VSW's weights into all n - 1 others; JABAS divides the same
  way). Without such a profile every n_max is 1 and t_copy is never used by Eq. 5: 0.
* ``bucket_sizes`` b_i = round(MiB * 2^20) bytes of ``bucket_size_distribution`` (IIDP lists
  them in backward order, as we do; it rounds each parameter to 0.01 MiB); ``param_bytes`` W =
  their sum (ResNet-50: 97.34 MiB, vs 97.5 MiB of 25.56 M float32 parameters).
* ``bucket_cap_mb`` = 25 (IIDP's DDP default), ``device`` = "cuda", ``memory_budget_gb`` = the
  memory profiles' smallest ``total_memory`` / 2^30, ``model_signature`` = "jabas:<model>".
* ``allreduce_intra`` / ``allreduce_inter``: Eq. 3 fitted by least squares
  (:meth:`AllReduceFit.fit`) to the comm file's points, see below; the same fits for every
  type (JABAS measures all-reduce once per cluster). ``allreduce_inter`` is None without the
  inter file.

All-reduce (Eq. 3). Each line of a comm file is ``x, y``: x = d * 4 (N_p - 1) / N_p / K_p in
ms (the theoretical time of IIDP's comm profiler for a tensor of d bytes over N_p GPUs at the
bandwidth K_p it was given) and y the measured mean all-reduce time in ms. We recover
d = x / 1000 * K_p * N_p / (4 (N_p - 1)) and fit ``AllReduceFit.fit(d, y / 1000, N_p, K_p)``;
as our regressor is then x / 1000, alpha equals JABAS's ``LinearRegression`` slope and beta its
intercept / 1000. N_p: the GPUs of one node (the largest node) within a node, all GPUs of
``cluster_info.json`` across nodes (informational: it cancels out of the fit). K_p: the
``comm_bandwidth`` argument, else ``cluster_info.json``'s (smallest) intra/inter bandwidth.

The quick start's inter file was NOT written with cluster_info's 12.5e9 B/s: its x column is
exactly 1, 5, 10, 15, 20, 25, 50, 100, 150 MiB (the sizes its profiling script loops over)
at N_p = 8 and K_p = 7e9 B/s, IIDP's default inter bandwidth (the intra file gives the same
sizes at N_p = 4 and 15.75e9, as cluster_info says). :data:`QUICKSTART_COMM_BANDWIDTH` holds
those values and :func:`quickstart_profiles` uses them; with cluster_info's 12.5e9 the
inter-node slope would be read 7 / 12.5 = 0.56 times too small (as JABAS's runtime does).

Not converted (no counterpart in Eq. 6): ``bn_sync_time`` (6.29 ms, a constant typed into
JABAS's profiler script, added by JABAS's estimator once per VSW and iteration), ``total_time``
(data + fwd + bwd + update + copy of one GPU, used only to check the model), and JABAS's own
deviation from Eq. 6 that keeps the last bucket's all-reduce outside the max with backward.

No torch or ray import here: the files are JSON and text.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..profiles import AllReduceFit, BatchProfile, Profile
from ..serialization import JsonMixin
from ..validation import check_float, check_int

QUICKSTART_RESNET50 = Path(__file__).resolve().parent / "profiles" / "jabas_resnet50"
"""The copy of JABAS's ResNet-50 quick-start profiles (V100 + P100) shipped with jabasray."""

QUICKSTART_COMM_BANDWIDTH: dict[str, float] = {"intra": 15.75e9, "inter": 7e9}
"""K_p (bytes/s) the quick start's comm files were written with (module notes)."""

MIB = 2 ** 20
IIDP_BUCKET_CAP_MB = 25.0          # DDP_DEFAULT_BUCKET_CAPACITY of IIDP, in MiB
COMM_KINDS = ("intra", "inter")
COMP_DIR, MEM_DIR = "cluster_comp_profile_data", "cluster_mem_profile_data"
COMM_DIR, BUCKET_DIR = "comm_profile_data", "bucket_profile_data"
CLUSTER_INFO, MEM_FILE = "cluster_info.json", "max_memory_profile_info.json"


@dataclass(frozen=True)
class JabasNode(JsonMixin):
    """One node of ``cluster_info.json``."""

    name: str                  # host name (the key of cluster_info.json)
    gpu_type: str              # "type", e.g. "Tesla V100-PCIE-16GB"
    num_gpus: int              # "number": GPUs on the node
    intra_bandwidth: float     # "intra_network_bandwidth", bytes/s
    inter_bandwidth: float     # "inter_network_bandwidth", bytes/s
    tflops: float | None = None  # "tfplos" (sic): peak FP32 TFLOPS, JABAS's cost model input


@dataclass(frozen=True)
class CommProfile(JsonMixin):
    """The points of one comm file, converted (module notes): tensor bytes and seconds."""

    kind: str                  # "intra" | "inter"
    num_gpus: int              # N_p of the measurement
    bandwidth: float           # K_p, bytes/s
    sizes: list[float]         # d_i, bytes
    times: list[float]         # measured all-reduce seconds

    def fit(self) -> AllReduceFit:
        """Eq. 3 by least squares over the points (:meth:`AllReduceFit.fit`)."""
        return AllReduceFit.fit(self.sizes, self.times, num_gpus=self.num_gpus, bandwidth=self.bandwidth)


# ---------------------------------------------------------------------------- file readers
def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"JABAS profile file {path} is missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"JABAS profile file {path} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"JABAS profile file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"JABAS profile file {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _field(data: dict, path: Path, name: str) -> Any:
    if name not in data:
        raise ValueError(f"JABAS profile file {path}: field {name!r} is missing")
    return data[name]


def _ms(data: dict, path: Path, name: str, positive: bool = False) -> float:
    """A time field in ms, checked, as seconds."""
    return check_float(f"JABAS profile file {path}: field {name!r}", _field(data, path, name),
                       min_value=0, min_exclusive=positive) / 1000.0


def _int(data: dict, path: Path, name: str) -> int:
    return check_int(f"JABAS profile file {path}: field {name!r}", _field(data, path, name), min_value=1)


def _gpu_type(data: dict, path: Path, expected: str) -> None:
    got = _field(data, path, "gpu_type")
    if got != expected:
        raise ValueError(f"JABAS profile file {path}: field 'gpu_type' is {got!r} but "
                         f"{CLUSTER_INFO} names {expected!r} for this node")


def _subdirs(path: Path) -> list[Path]:
    if not path.is_dir():
        raise ValueError(f"JABAS profile folder {path} is missing")
    return sorted((p for p in path.iterdir() if p.is_dir()), key=lambda p: p.name)


def _local_batch_dirs(path: Path) -> list[tuple[int, Path]]:
    out = []
    for d in _subdirs(path):
        if not d.name.isdigit() or int(d.name) < 1:
            raise ValueError(f"JABAS profile folder {d}: the name must be a local batch size "
                             f"(an integer >= 1), got {d.name!r}")
        out.append((int(d.name), d))
    return sorted(out)


def jabas_cluster(folder: str | Path) -> dict[str, JabasNode]:
    """The nodes ``cluster_info.json`` of a JABAS profile folder describes, by name."""
    path = Path(folder) / CLUSTER_INFO
    data = _read_json(path)
    if not data:
        raise ValueError(f"JABAS profile file {path} must name at least one node, got {{}}")
    nodes = {}
    for name, info in data.items():
        if not isinstance(info, dict):
            raise ValueError(f"JABAS profile file {path}: node {name!r} must be a JSON object, got {info!r}")
        where = f"JABAS profile file {path}: field {name}."
        gpu_type = info.get("type")
        if not isinstance(gpu_type, str) or not gpu_type:
            raise ValueError(f"{where}type must be a non-empty string, got {gpu_type!r}")
        tflops = info.get("tfplos", info.get("tflops"))
        nodes[name] = JabasNode(
            name=name, gpu_type=gpu_type,
            num_gpus=check_int(f"{where}number", info.get("number"), min_value=1),
            intra_bandwidth=check_float(f"{where}intra_network_bandwidth",
                                        info.get("intra_network_bandwidth"), min_value=0, min_exclusive=True),
            inter_bandwidth=check_float(f"{where}inter_network_bandwidth",
                                        info.get("inter_network_bandwidth"), min_value=0, min_exclusive=True),
            tflops=None if tflops is None else check_float(f"{where}tfplos", tflops, min_value=0))
    return nodes


def read_comm_profile(folder: str | Path, kind: str, bandwidth: float | None = None,
                      cluster: Mapping[str, JabasNode] | None = None) -> CommProfile | None:
    """The points of ``comm_profile_data/<kind>_comm_profile_data.txt`` as bytes and seconds
    (module notes), None when the file does not exist.

    ``bandwidth``: K_p the comm profiler ran with (default: cluster_info.json's smallest
    ``<kind>_network_bandwidth``); ``cluster``: :func:`jabas_cluster` of the folder (read when None).
    """
    if kind not in COMM_KINDS:
        raise ValueError(f"kind must be one of {COMM_KINDS}, got {kind!r}")
    path = Path(folder) / COMM_DIR / f"{kind}_comm_profile_data.txt"
    if not path.is_file():
        return None
    nodes = list((cluster if cluster is not None else jabas_cluster(folder)).values())
    if bandwidth is None:
        bandwidth = min(n.intra_bandwidth if kind == "intra" else n.inter_bandwidth for n in nodes)
    k_p = check_float(f"comm_bandwidth[{kind!r}]", bandwidth, min_value=0, min_exclusive=True)
    n_p = max(n.num_gpus for n in nodes) if kind == "intra" else sum(n.num_gpus for n in nodes)
    n_p = max(2, n_p)
    scale = k_p * n_p / (4.0 * (n_p - 1)) / 1000.0   # x (ms) -> d (bytes)
    sizes, times = [], []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"JABAS profile file {path} cannot be read: {e}") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parts = line.split(",")
        if len(parts) != 2:
            raise ValueError(f"JABAS profile file {path}: line {i} must be 'theoretical ms,measured ms', "
                             f"got {line.strip()!r}")
        x = check_float(f"JABAS profile file {path}: line {i} theoretical ms", parts[0].strip(),
                        min_value=0, min_exclusive=True)
        y = check_float(f"JABAS profile file {path}: line {i} measured ms", parts[1].strip(),
                        min_value=0, min_exclusive=True)
        sizes.append(x * scale)
        times.append(y / 1000.0)
    if len(set(sizes)) < 2:
        raise ValueError(f"JABAS profile file {path} must hold at least two different tensor sizes, "
                         f"got {len(sizes)} line(s)")
    return CommProfile(kind=kind, num_gpus=n_p, bandwidth=k_p, sizes=sizes, times=times)


def _bucket_sizes(folder: Path) -> tuple[list[int], str]:
    bdir = folder / BUCKET_DIR
    if not bdir.is_dir():
        raise ValueError(f"JABAS profile folder {bdir} is missing")
    files = sorted(p for p in bdir.iterdir() if p.suffix == ".json")
    if len(files) != 1:
        raise ValueError(f"JABAS profile folder {bdir} must hold exactly one bucket profile (.json), "
                         f"got {[p.name for p in files]}")
    path = files[0]
    data = _read_json(path)
    dist = _field(data, path, "bucket_size_distribution")
    if not isinstance(dist, list) or not dist:
        raise ValueError(f"JABAS profile file {path}: field 'bucket_size_distribution' must be a "
                         f"non-empty list of MiB, got {dist!r}")
    sizes = [round(check_float(f"JABAS profile file {path}: field 'bucket_size_distribution'[{i}]",
                               v, min_value=0, min_exclusive=True) * MIB) for i, v in enumerate(dist)]
    model = data.get("model")
    return [int(s) for s in sizes], model if isinstance(model, str) and model else "model"


@dataclass
class _Point:
    """What one (GPU type, B_L) contributes, read from one node's files."""

    batch: BatchProfile
    updates: list[float]       # update_time (s) of every compute file
    copies: list[float]        # copy_time / (n - 1) (s) of every compute file with n > 1
    total_memory: float | None


def _compute_files(node_dir: Path, local_batch: int, gpu_type: str) -> dict[int, tuple[Path, dict]]:
    files = sorted(p for p in node_dir.iterdir() if p.is_file() and p.suffix == ".json")
    out: dict[int, tuple[Path, dict]] = {}
    for path in files:
        data = _read_json(path)
        _gpu_type(data, path, gpu_type)
        lbs = _int(data, path, "lbs")
        if lbs != local_batch:
            raise ValueError(f"JABAS profile file {path}: field 'lbs' is {lbs} but the file lies "
                             f"in the folder of local batch {local_batch}")
        n = _int(data, path, "num_models")
        if n in out:
            raise ValueError(f"JABAS profile file {path}: field 'num_models' = {n} is also in {out[n][0]}")
        out[n] = (path, data)
    return out


def _round_time(path: Path, data: dict, include_data_time: bool) -> tuple[float, float]:
    """(t_vsw seconds, zeta) of one compute profile (module notes)."""
    fwd = _ms(data, path, "fwd_time", positive=True)
    bwd = _ms(data, path, "bwd_time", positive=True)
    pre = _ms(data, path, "data_time") if include_data_time else 0.0
    return pre + fwd + bwd, (pre + fwd) / (pre + fwd + bwd)


def _point(folder: Path, local_batch: int, node: JabasNode, include_data_time: bool) -> _Point:
    comp_dir = folder / COMP_DIR / str(local_batch) / node.name
    mem_path = folder / MEM_DIR / str(local_batch) / node.name / MEM_FILE
    mem = _read_json(mem_path)
    _gpu_type(mem, mem_path, node.gpu_type)
    if "lbs" in mem and _int(mem, mem_path, "lbs") != local_batch:
        raise ValueError(f"JABAS profile file {mem_path}: field 'lbs' is {mem['lbs']} but the file "
                         f"lies in the folder of local batch {local_batch}")
    n_max = _int(mem, mem_path, "max_num_models")
    total_memory = None
    if "total_memory" in mem:
        total_memory = check_float(f"JABAS profile file {mem_path}: field 'total_memory'",
                                   mem["total_memory"], min_value=0, min_exclusive=True)
    if not comp_dir.is_dir():
        raise ValueError(f"JABAS profile folder {comp_dir} is missing (the memory profile {mem_path} "
                         f"has local batch {local_batch} on node {node.name})")
    comp = _compute_files(comp_dir, local_batch, node.gpu_type)
    for n in sorted({1, n_max}):
        if n not in comp:
            raise ValueError(f"JABAS profile folder {comp_dir}: no compute profile with field "
                             f"'num_models' = {n} (n_max = {n_max} from {mem_path})")
    t1, _ = _round_time(*comp[1], include_data_time)
    t_max, zeta = _round_time(*comp[n_max], include_data_time)
    updates = [_ms(d, p, "update_time") for p, d in comp.values()]
    copies = [_ms(d, p, "copy_time") / (n - 1) for n, (p, d) in comp.items() if n > 1]
    batch = BatchProfile(local_batch=local_batch, max_num_vsw=n_max, compute_time_1=t1,
                         compute_time_max=t_max, zeta=zeta)
    return _Point(batch, updates, copies, total_memory)


def load_jabas_profiles(folder: str | Path, *, include_data_time: bool = True,
                        comm_bandwidth: Mapping[str, float] | None = None) -> dict[str, Profile]:
    """``{gpu_type: Profile}`` converted from a JABAS profile folder (module notes give the
    field mapping and the unit conversions).

    Args:
        folder: a folder with the quick start's layout (module notes).
        include_data_time: count the profiled input copy in t_vsw (JABAS's estimator does);
            False: forward + backward only.
        comm_bandwidth: ``{"intra": K_p, "inter": K_p}``, the bytes/s IIDP's comm profiler was
            run with for each file; a missing key takes cluster_info.json's bandwidth.
    Returns:
        one Profile per GPU type of cluster_info.json that has profiles; the local batches of a
        type are every B_L folder holding a node of that type (the first node by name when
        several nodes of one type have profiles).
    Raises:
        ValueError (one line, naming the file and the field) when a file is missing or malformed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"JABAS profile folder {folder} is missing")
    bw = dict(comm_bandwidth or {})
    unknown = set(bw) - set(COMM_KINDS)
    if unknown:
        raise ValueError(f"comm_bandwidth keys must be among {COMM_KINDS}, got {sorted(unknown)}")
    cluster = jabas_cluster(folder)
    buckets, model = _bucket_sizes(folder)
    fits: dict[str, AllReduceFit | None] = {}
    for kind in COMM_KINDS:
        comm = read_comm_profile(folder, kind, bw.get(kind), cluster)
        fits[kind] = None if comm is None else comm.fit()
    if fits["intra"] is None:
        raise ValueError(f"JABAS profile file {folder / COMM_DIR / 'intra_comm_profile_data.txt'} is missing")

    mem_lbs = {b: d for b, d in _local_batch_dirs(folder / MEM_DIR)}
    comp_lbs = {b: d for b, d in _local_batch_dirs(folder / COMP_DIR)}
    for b, d in comp_lbs.items():
        if b not in mem_lbs:
            raise ValueError(f"JABAS profile folder {folder / MEM_DIR / str(b)} is missing "
                             f"(the compute profiles {d} have no memory profile)")
    points: dict[str, dict[int, _Point]] = {}
    for b, mem_dir in sorted(mem_lbs.items()):
        for node_dir in _subdirs(mem_dir):
            node = cluster.get(node_dir.name)
            if node is None:
                raise ValueError(f"JABAS profile folder {node_dir}: node {node_dir.name!r} is not in "
                                 f"{folder / CLUSTER_INFO} (nodes {sorted(cluster)})")
            if b in points.get(node.gpu_type, {}):
                continue   # another node of the same type came first (sorted by name)
            points.setdefault(node.gpu_type, {})[b] = _point(folder, b, node, include_data_time)
        comp_nodes = {p.name for p in _subdirs(comp_lbs[b])} if b in comp_lbs else set()
        extra = comp_nodes - {p.name for p in _subdirs(mem_dir)}
        if extra:
            name = sorted(extra)[0]
            raise ValueError(f"JABAS profile file {mem_dir / name / MEM_FILE} is missing (compute "
                             f"profiles of node {name!r} at local batch {b} have no memory profile)")
    if not points:
        raise ValueError(f"JABAS profile folder {folder / MEM_DIR} holds no profiles")

    profiles = {}
    for gpu_type, by_batch in points.items():
        pts = [by_batch[b] for b in sorted(by_batch)]
        copies = [c for p in pts for c in p.copies]
        memory = [p.total_memory for p in pts if p.total_memory is not None]
        profiles[gpu_type] = Profile(
            model_signature=f"jabas:{model}", gpu_type=gpu_type, min_local_batch=pts[0].batch.local_batch,
            batches=[p.batch for p in pts],
            optimizer_time=statistics.median(u for p in pts for u in p.updates),
            copy_time=statistics.median(copies) if copies else 0.0,
            bucket_sizes=list(buckets), param_bytes=int(sum(buckets)),
            allreduce_intra=fits["intra"], allreduce_inter=fits["inter"], device="cuda",
            bucket_cap_mb=IIDP_BUCKET_CAP_MB,
            memory_budget_gb=min(memory) / 2 ** 30 if memory else None)
    return profiles


def quickstart_profiles(include_data_time: bool = True) -> dict[str, Profile]:
    """The shipped quick-start profiles (ResNet-50 on "Tesla V100-PCIE-16GB" and
    "Tesla P100-PCIE-16GB"), read with the bandwidths their comm files were written with
    (:data:`QUICKSTART_COMM_BANDWIDTH`, module notes)."""
    return load_jabas_profiles(QUICKSTART_RESNET50, include_data_time=include_data_time,
                               comm_bandwidth=QUICKSTART_COMM_BANDWIDTH)


__all__ = ["JabasNode", "CommProfile", "jabas_cluster", "read_comm_profile", "load_jabas_profiles",
           "quickstart_profiles", "QUICKSTART_RESNET50", "QUICKSTART_COMM_BANDWIDTH"]
