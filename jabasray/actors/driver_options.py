"""Driver options and callbacks (plain data and hooks of :class:`jabasray.actors.driver.JabasDriver`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..serialization import JsonMixin

if TYPE_CHECKING:   # pragma: no cover
    from .driver import JabasDriver
    from .metrics import EpochRecord, IntervalRecord


@dataclass
class DriverOptions(JsonMixin):
    """Advanced knobs of the driver (defaults suit CPU emulation)."""

    device: str = "cpu"                 # "cpu" (emulated GPU types) or "cuda"
    emulate: bool | None = None         # gpu_<type> resources + speed emulation; None: device == "cpu"
    emulation: str = "compute"          # emulated step time: "compute" (wall compute / speed; the
                                        # host's shared cores slow every emulated GPU) | "wait"
                                        # (CPU time / speed: the same share for every emulated GPU
                                        # while sum(speeds) <= host cores); actors.emulation
    force_replacement: bool = False     # re-place all actors at every epoch boundary (tests/advanced)
    placement_timeout_s: float = 120.0  # wait for placement-group resources
    collective_timeout_s: float = 300.0 # process-group timeout
    failure_grace_s: float = 20.0       # after one actor fails, wait this long for the others
    call_timeout_s: float = 600.0       # the longest any call to the GPU actors may take (setup:
                                        # plus placement_timeout_s and collective_timeout_s); a call
                                        # past it is a hang: an actor failure (actors killed, the
                                        # epoch redone)
    interval_timeout_factor: float = 20.0  # a training interval may take up to this many times its
                                        # predicted time when that exceeds call_timeout_s
    rendezvous_ports: tuple[int, int] | None = None  # (first, last) port the driver's rendezvous
                                        # store may listen on, tried in order (a cluster that opens
                                        # only some ports); None: any free port
    preflight: bool | None = None       # before any GPU actor starts, every GPU node opens a TCP
                                        # connection to the driver's node on the rendezvous port
                                        # (rendezvous.preflight; a one-line PreflightFailed naming
                                        # the node and port); None: on CUDA, off for CPU emulation
    preflight_timeout_s: float = 10.0   # how long each node's connection attempt may take
    share_node_devices: bool = False   # CUDA: every GPU actor sees all GPUs of its node (as Ray
                                        # Train's shared CUDA_VISIBLE_DEVICES; NCCL can use NVLink/
                                        # peer paths) and uses the one Ray assigned it
    actor_env: dict[str, str] | None = None  # environment variables of the GPU actors (Ray
                                        # runtime_env), e.g. {"NCCL_SOCKET_IFNAME": "eth0",
                                        # "GLOO_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"}
    torch_threads: int = 1              # torch threads inside each actor
    bucket_cap_mb: float = 25.0         # engine gradient bucket cap
    bucket_planner: str = "size"        # "size" (cap-sized buckets) or "libra" (LIBRA fusion, profiler.buckets)
    evaluate: bool = True               # validation accuracy at every epoch end
    profile_cache_dir: str | None = None  # where profiles are cached (default: <storage>/.profiles)
    reprofile: bool = False             # measure the profile again even if the cache has it
    profile_in_tasks: bool | None = None  # measure each GPU type in a Ray task holding one GPU of
                                        # it (actors.profiling); None: on CUDA (the driver holds no
                                        # GPU), not for CPU emulation (measured once, scaled)
    measure_allreduce: bool = True      # time all-reduces on the placed actors with the job's
                                        # backend after each new (backend, world size, span) and
                                        # plan with that Eq. 3 fit (actors.allreduce_fit); False:
                                        # the profiles' fits. A given perf_model is used as given
    sma_autotune: bool = True           # sync="sma": tune learners per rank (Crossbow Alg. 2)
    sma_tuner_tau: float = 0.05         # tuner tolerance: a gain must exceed it to add a learner
    sma_tuner_relative: bool = True     # tau as a fraction of the previous throughput
    sma_max_learners: int = 8           # upper bound of learners per GPU (memory)
    online_correction: bool = False     # measured interval times correct the model (planners.correction);
                                        # off by default: plans then depend on timings, so a run is no
                                        # longer reproducible bit for bit (resume == uninterrupted)
    correction_smoothing: float = 0.5   # weight of one interval in the per-GPU-type factor (log EWMA)
    reprofile_threshold: float = 2.0    # a type's factor beyond this (either way): re-measure the profile
    max_reprofiles: int = 1             # re-profilings per run (each costs a profiling run)
    driver: str = "actor"               # "actor": a restartable, detached Ray actor runs the driver
                                        # (jabasray.actors.driver_actor); "local": in fit()'s process
    driver_node: str | None = None      # actor driver: Ray node id or IP to run on (None: head node)
    driver_max_restarts: int = 10       # actor driver: restarts after its process/node died (-1: no limit)
    record_samples: bool = False        # every interval record lists the sample indices the actors
                                        # served (tests, debugging; large). The exactly-once check
                                        # itself always runs, on digests.
    driver_resources: dict[str, float] | None = None  # actor driver: custom Ray resources it needs,
                                        # e.g. {"run_storage": 1} on the nodes that mount a local
                                        # storage_path, so that a restart lands on one of them

    def __post_init__(self) -> None:
        from ..validation import check_choice, check_float, check_int
        check_choice("device", self.device, ("cpu", "cuda"))
        from ..profiler.buckets import BUCKET_PLANNERS
        check_choice("bucket_planner", self.bucket_planner, BUCKET_PLANNERS)
        if self.emulate is None:
            self.emulate = self.device == "cpu"
        from .emulation import check_emulation
        check_emulation(self.emulation)
        check_int("torch_threads", self.torch_threads, min_value=1)
        check_float("sma_tuner_tau", self.sma_tuner_tau, min_value=0)
        check_int("sma_max_learners", self.sma_max_learners, min_value=1)
        check_choice("driver", self.driver, ("actor", "local"))
        check_int("driver_max_restarts", self.driver_max_restarts, min_value=-1)
        if self.driver_resources is not None:
            if not isinstance(self.driver_resources, dict) or not all(
                    isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and v > 0 for k, v in self.driver_resources.items()):
                raise ValueError(f"driver_resources must map Ray resource names to amounts > 0, "
                                 f"got {self.driver_resources!r}")
        if self.driver_node is not None and (not isinstance(self.driver_node, str) or not self.driver_node):
            raise ValueError(f"driver_node must be a Ray node id or IP address, got {self.driver_node!r}")
        check_int("max_reprofiles", self.max_reprofiles, min_value=0)
        check_float("correction_smoothing", self.correction_smoothing, min_value=0, max_value=1,
                    min_exclusive=True)
        check_float("reprofile_threshold", self.reprofile_threshold, min_value=1, min_exclusive=True)
        if self.preflight is None:
            self.preflight = self.device == "cuda"
        if self.profile_in_tasks is None:
            self.profile_in_tasks = self.device == "cuda"
        for f in ("sma_autotune", "sma_tuner_relative", "online_correction", "reprofile", "record_samples",
                  "profile_in_tasks", "share_node_devices", "preflight", "measure_allreduce"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be True or False, got {getattr(self, f)!r}")
        for f in ("placement_timeout_s", "collective_timeout_s", "failure_grace_s", "bucket_cap_mb",
                  "call_timeout_s", "preflight_timeout_s"):
            check_float(f, getattr(self, f), min_value=0, min_exclusive=True)
        check_float("interval_timeout_factor", self.interval_timeout_factor, min_value=1)
        if self.rendezvous_ports is not None:
            self.rendezvous_ports = check_port_range(self.rendezvous_ports)
        if self.actor_env is not None:
            self.actor_env = check_actor_env(self.actor_env)

    def check_job(self, job: Any) -> None:
        """What these options bound of a job (a JobConfig): sync="sma" needs sma_learners <=
        sma_max_learners (ValueError, one line)."""
        if job.sync == "sma" and job.sma_learners > self.sma_max_learners:
            raise ValueError(f"sma_learners must be <= DriverOptions.sma_max_learners "
                             f"({self.sma_max_learners}), got {job.sma_learners}")


NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_port_range(ports: Any) -> tuple[int, int]:
    """``(first, last)`` with 1024 <= first <= last <= 65535, else a one-line ValueError."""
    if (not isinstance(ports, (list, tuple)) or len(ports) != 2
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in ports)
            or not 1024 <= ports[0] <= ports[1] <= 65535):
        raise ValueError(f"rendezvous_ports must be (first, last) ports with 1024 <= first <= "
                         f"last <= 65535, got {ports!r}")
    return int(ports[0]), int(ports[1])


def check_actor_env(env: Any) -> dict[str, str]:
    """Environment variables for the GPU actors: names of letters, digits and ``_``, string
    values; ``NCCL_DEBUG`` one of :data:`NCCL_DEBUG_LEVELS`; the interface variables
    (``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``) non-empty. One-line ValueError otherwise."""
    if not isinstance(env, dict):
        raise ValueError(f"actor_env must map variable names to strings, got {type(env).__name__}")
    for k, v in env.items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise ValueError(f"actor_env: {k!r} is not an environment variable name "
                             f"(letters, digits, _)")
        if not isinstance(v, str):
            raise ValueError(f"actor_env[{k}] must be a string, got {v!r}")
    if "NCCL_DEBUG" in env and env["NCCL_DEBUG"].upper() not in NCCL_DEBUG_LEVELS:
        raise ValueError(f"actor_env[NCCL_DEBUG] must be one of {list(NCCL_DEBUG_LEVELS)}, "
                         f"got {env['NCCL_DEBUG']!r}")
    for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if k in env and not env[k].strip():
            raise ValueError(f"actor_env[{k}] must name a network interface (e.g. eth0), got ''")
    return dict(env)


def check_driver_inputs(job: Any, cluster: Any, dataset: Any, dataset_size: int | None) -> int:
    """The driver's checks of its job (a JobConfig) and cluster (a ClusterSpec); returns the
    training set's size: ``dataset_size``, else ``len(dataset)`` (dataset=None: every actor builds
    it with ``hooks.dataset_fn`` and the size comes from the trainer's probe, so the driver never
    reads a sample). ValueError (one line) on a wrong type or an empty dataset."""
    from ..config import JobConfig
    from ..types import ClusterSpec

    if not isinstance(job, JobConfig):
        raise ValueError(f"job_config must be a JobConfig, got {type(job).__name__}")
    if not isinstance(cluster, ClusterSpec):
        raise ValueError(f"cluster must be a ClusterSpec, got {type(cluster).__name__}")
    size = int(dataset_size if dataset_size is not None else len(dataset))
    if size < 1:
        raise ValueError("dataset must hold at least one sample, got an empty dataset")
    return size


class DriverCallback:
    """Hooks the driver calls (override what you need). Progress bars and test fault injection
    use them; they run in the driver's process between Ray calls."""

    def on_interval(self, driver: "JabasDriver", record: "IntervalRecord") -> None:  # noqa: D401
        pass

    def on_epoch(self, driver: "JabasDriver", record: "EpochRecord") -> None:
        pass

    def on_event(self, driver: "JabasDriver", message: str) -> None:
        pass

    def on_phase(self, driver: "JabasDriver", phase: str) -> None:
        """What the driver does until its next interval reports: start-up steps and
        re-placements ("profiling the model", "placing 4 GPU actors"), then
        :data:`TRAINING_PHASE` once the actors are placed and the intervals begin."""
        pass


TRAINING_PHASE = "training"   # the phase after every placement: intervals follow


__all__ = ["DriverOptions", "DriverCallback", "TRAINING_PHASE", "check_driver_inputs", "check_actor_env",
           "check_port_range", "NCCL_DEBUG_LEVELS"]
