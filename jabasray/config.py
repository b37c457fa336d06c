"""User-facing job configuration (``JobConfig``) and run configuration (``RunConfig``).

All fields are validated in ``__post_init__``: a bad value raises a one-line ``ValueError``
naming the field and the allowed values.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

from .serialization import JsonMixin
from .validation import check_choice, check_float, check_int

if TYPE_CHECKING:   # pragma: no cover
    from .storage import StoragePath

LR_SCALING_RULES = ("linear", "sqrt", "none")
WEIGHT_SYNC_METHODS = ("auto", "sws", "ows")
SYNC_METHODS = ("iidp", "sma")
CUDA_GRAPH_MODES = ("auto", "off")   # engine.graphs: "auto" captures batched CUDA steps where possible
SMA_SYNC_MODES = ("flat", "hierarchical")   # SMA across devices (engine/sma.py module notes)
SMA_RESTART_RULES = ("schedule", "batch", "never")   # when SMA restarts (engine.sma.sma_restart_due)
PARALLELISM = ("data", "burst")
AUTOSCALE_OBJECTIVES = ("time", "cost", "time_under_budget")
PRECISIONS = ("fp32", "bf16", "fp16")

R_BUFFER = 0.5  # threshold of IIDP's SWS/OWS selection rule (JABAS section 4)


def choose_weight_sync(bucket_nbytes: Sequence[int], bucket_cap_mb: float,
                       r_buffer: float = R_BUFFER) -> str:
    """The paper's rule: ``mean(bucket_nbytes) / (bucket_cap_mb MiB) > r_buffer`` -> ``"sws"``,
    else ``"ows"``."""
    check_float("bucket_cap_mb", bucket_cap_mb, min_value=0, min_exclusive=True)
    check_float("r_buffer", r_buffer, min_value=0)
    if not bucket_nbytes:
        raise ValueError("bucket_nbytes must list at least one bucket size, got []")
    ratio = (sum(bucket_nbytes) / len(bucket_nbytes)) / (bucket_cap_mb * 2 ** 20)
    return "sws" if ratio > r_buffer else "ows"


@dataclass(frozen=True)
class JobConfig(JsonMixin):
    """What a JABAS training job needs besides model, data and cluster.

    The batch-size fields follow the JABAS paper (section 6.1): the global batch B_G starts at
    ``initial_global_batch`` and every ``adapt_interval`` (p) iterations moves by the rate
    ``alpha`` depending on the gradient similarity Phi vs the threshold ``gamma``, clamped to
    ``[min_global_batch, max_global_batch]``.
    """

    initial_global_batch: int = 64      # B_G at the start of training
    min_global_batch: int = 32          # lower clamp of adaptive B_G
    max_global_batch: int = 512         # upper clamp of adaptive B_G
    min_local_batch: int = 8            # min B_L; every B_L is a multiple of it
    max_local_batch: int | None = None  # upper bound of B_L (AdaptDL's local_bsz_bounds[1]): the
                                        # solver and the profiler never go beyond it; None: what fits
    adapt_interval: int = 10            # p: iterations between two B_G adaptations (one Ray call)
    alpha: float = 0.1                  # adaptive rate: B_G' = B_G * (1 +/- alpha)
    gamma: float = 0.5                  # similarity threshold: Phi < gamma grows B_G, > shrinks.
                                        # The rule holds B_G near 2 gamma B_noise / (1 - gamma)
                                        # (sim.convergence.settled_batch); what that costs or
                                        # gains in accuracy depends on the job (README, gamma)
    adaptive: bool = True               # False: keep B_G = initial_global_batch
    autoscale: bool = True              # re-place GPUs every epoch from the forecast trajectory
    autoscale_objective: str = "time"   # "time" | "cost" | "time_under_budget"
    cost_budget: float | None = None    # price budget per epoch for "time_under_budget"
    replacement_cost_s: float | None = None  # seconds the auto-scaler charges a move to another
                                        # allocation (re-placing the actors); None: the driver's
                                        # last measured placement; 0: not charged (JABAS 6.3)
    epochs: int = 5                     # training epochs
    lr: float | None = None             # optional check: must equal the optimizer's LR (the LR at
                                        # initial_global_batch); None: the optimizer's LR as it is
    precision: str = "fp32"             # "fp32" | "bf16" | "fp16" (autocast; fp16: GradScaler)
    grad_clip_norm: float | None = None # clip the global (all-reduced) gradient to this L2 norm
    lr_scaling: str = "none"            # LR vs B_G: "none" (the user's LR whatever B_G) | "sqrt" |
                                        # "linear"; why "none" by default: adaptive.lr_scaling
    warmup_iterations: int = 0          # linear LR warm-up from 0 over this many iterations
    weight_sync: str = "auto"           # IIDP one-way weight sync: "auto" | "sws" | "ows"
    per_sample_loss: bool = True        # the step's loss is a mean of per-sample losses: the
                                        # VSWs of a device run as one batched pass (False: per VSW);
                                        # True and a loss summed over samples: the probe refuses it
    cuda_graphs: str = "auto"           # "auto": batched steps on one CUDA device replay a captured
                                        # CUDA graph where possible (engine.graphs) | "off": eager
    sync: str = "iidp"                  # "iidp" (VSWs + all-reduce) or "sma" (Crossbow learners)
    sma_learners: int = 2               # m: SMA learners per device at start (sync="sma")
    sma_alpha: float | None = None      # SMA correction rate; None -> 1/(learners averaged per level)
    sma_sync: str = "flat"              # SMA across GPUs: "flat" (Alg. 1 over all learners) |
                                        # "hierarchical" (Crossbow 3.3; slower to converge on digits)
    sma_restart: str = "schedule"       # when SMA restarts from z (Crossbow 3.2): "schedule" (a
                                        # step of the user's epoch-stepped LR scheduler; a B_G
                                        # change only rescales the LR) | "batch" (also at every
                                        # B_G change) | "never"; engine.sma.sma_restart_due
    seed: int = 0                       # seeds data order, model init and search
    parallelism: str = "data"           # "data" (IIDP) or "burst" (DeepPool: per-layer GPU counts
                                        # on all allocated GPUs; the auto-scaler is not applied)
    amp_limit: float = 2.0              # burst: GPU-sec amplification limit of every layer (>= 1)

    def __post_init__(self) -> None:
        check_int("initial_global_batch", self.initial_global_batch, min_value=1)
        check_int("min_global_batch", self.min_global_batch, min_value=1)
        check_int("max_global_batch", self.max_global_batch, min_value=1)
        if self.min_global_batch > self.max_global_batch:
            raise ValueError(f"min_global_batch must be <= max_global_batch ({self.max_global_batch}), "
                             f"got {self.min_global_batch}")
        if not self.min_global_batch <= self.initial_global_batch <= self.max_global_batch:
            raise ValueError(f"initial_global_batch must be in [min_global_batch, max_global_batch] = "
                             f"[{self.min_global_batch}, {self.max_global_batch}], got {self.initial_global_batch}")
        check_int("min_local_batch", self.min_local_batch, min_value=1)
        if self.min_local_batch > self.min_global_batch:
            raise ValueError(f"min_local_batch must be <= min_global_batch ({self.min_global_batch}), "
                             f"got {self.min_local_batch}")
        if self.max_local_batch is not None:
            check_int("max_local_batch", self.max_local_batch, min_value=self.min_local_batch)
        check_int("adapt_interval", self.adapt_interval, min_value=1)
        if not isinstance(self.per_sample_loss, bool):
            raise ValueError(f"per_sample_loss must be True or False, got {self.per_sample_loss!r}")
        check_float("alpha", self.alpha, min_value=0, min_exclusive=True)
        check_float("gamma", self.gamma, min_value=-1, max_value=1)
        check_choice("autoscale_objective", self.autoscale_objective, AUTOSCALE_OBJECTIVES)
        if self.autoscale_objective == "time_under_budget":
            if self.cost_budget is None:
                raise ValueError("cost_budget must be a number > 0 when autoscale_objective is "
                                 "'time_under_budget', got None")
        if self.cost_budget is not None:
            check_float("cost_budget", self.cost_budget, min_value=0, min_exclusive=True)
        if self.replacement_cost_s is not None:
            check_float("replacement_cost_s", self.replacement_cost_s, min_value=0)
        check_int("epochs", self.epochs, min_value=1)
        if self.lr is not None:
            check_float("lr", self.lr, min_value=0, min_exclusive=True)
        check_choice("precision", self.precision, PRECISIONS)
        if self.grad_clip_norm is not None:
            check_float("grad_clip_norm", self.grad_clip_norm, min_value=0, min_exclusive=True)
        check_choice("lr_scaling", self.lr_scaling, LR_SCALING_RULES)
        check_int("warmup_iterations", self.warmup_iterations, min_value=0)
        check_choice("weight_sync", self.weight_sync, WEIGHT_SYNC_METHODS)
        check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPH_MODES)
        check_choice("sync", self.sync, SYNC_METHODS)
        check_int("sma_learners", self.sma_learners, min_value=1)
        if self.sync == "sma" and (self.precision == "fp16" or self.grad_clip_norm is not None):
            raise ValueError(f"sync='sma' supports precision 'fp32' or 'bf16' without grad_clip_norm "
                             f"(SMA learners step their own replicas: no global gradient to clip "
                             f"or unscale), got precision={self.precision!r}, "
                             f"grad_clip_norm={self.grad_clip_norm!r}")
        if self.sma_alpha is not None:
            check_float("sma_alpha", self.sma_alpha, min_value=0, max_value=1, min_exclusive=True)
        check_choice("sma_sync", self.sma_sync, SMA_SYNC_MODES)
        check_choice("sma_restart", self.sma_restart, SMA_RESTART_RULES)
        check_int("seed", self.seed, min_value=0)
        check_choice("parallelism", self.parallelism, PARALLELISM)
        check_float("amp_limit", self.amp_limit, min_value=1.0)
        if self.parallelism == "burst" and self.sync != "iidp":
            raise ValueError(f"sync must be 'iidp' when parallelism is 'burst', got {self.sync!r}")

    def check_dataset_size(self, num_samples: int) -> None:
        """One-line ``ValueError`` when a global batch bound exceeds the training set: an
        iteration's B_G samples are drawn without repetition from one epoch, so B_G can never be
        larger than the dataset (and the solver's work grows with B_G; this keeps it bounded)."""
        check_int("dataset size", num_samples, min_value=1)
        for name in ("min_global_batch", "initial_global_batch", "max_global_batch"):
            value = getattr(self, name)
            if value > num_samples:
                raise ValueError(f"{name} must be <= the training set size ({num_samples} samples), "
                                 f"got {value}")


def changed_job_fields(recorded: dict, job: dict, ignore: Sequence[str] = ("epochs",)) -> list[str]:
    """The ``JobConfig`` fields (``to_dict()`` form) in which ``job`` differs from the
    ``recorded`` job of a run, sorted; ``ignore`` (default ``epochs``: raising it continues a
    run) is left out. A field the record does not hold (it was written before the field
    existed) counts as its default, so a run recorded by an earlier version resumes as long as
    the new field is left at its default; a recorded field ``JobConfig`` no longer has is
    ignored."""
    defaults = JobConfig().to_dict()
    return sorted(k for k in job if k in defaults and k not in ignore
                  and recorded.get(k, defaults[k]) != job[k])


_RUN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@,-]{0,254}$")


def check_run_name(name: object) -> str:
    """A run name is one plain folder name: letters, digits and ``_.+=@,-``, not starting with a
    dot (no ``..``, no hidden folders such as the profile cache), no path separators, at most 255
    characters. Raises a one-line ``ValueError`` otherwise."""
    if not isinstance(name, str) or not _RUN_NAME.match(name):
        raise ValueError(f"name must be a plain folder name (letters, digits, '_.+=@,-', not "
                         f"starting with '.', no '/' or '\\', 1-255 characters), got {name!r}")
    return name


@dataclass(frozen=True)
class FailureConfig(JsonMixin):
    """How a run meets GPU-actor failures (Ray Train's ``FailureConfig`` shape). Each failure
    restores the last checkpoint and redoes the epoch; completed epochs are never lost. What
    the redo runs on (:func:`jabasray.actors.recovery.failed_gpus`): a node that left the Ray
    cluster loses all its GPUs; a single dead actor on a live node costs its GPU once that GPU
    has failed ``drop_gpu_after`` times; several actors dead at once on live nodes (e.g. an NCCL
    abort) retry on the same GPUs."""

    max_failures: int = 3               # GPU-actor failures a run survives (-1: no limit)
    drop_gpu_after: int = 1             # failures of one GPU (its node alive, one rank dead) after
                                        # which the run leaves that GPU out (-1: never; a GPU then
                                        # leaves only with its node). Several ranks dying at once on
                                        # live nodes (a collective abort) retry on the same GPUs.

    def __post_init__(self) -> None:
        check_int("max_failures", self.max_failures, min_value=-1)
        check_int("drop_gpu_after", self.drop_gpu_after, min_value=-1)
        if self.drop_gpu_after == 0:
            raise ValueError("drop_gpu_after must be >= 1 or -1 (never), got 0")

    def exhausted(self, failures: int) -> bool:
        """Whether ``failures`` failures are more than the run survives."""
        return self.max_failures != -1 and failures > self.max_failures


@dataclass(frozen=True)
class CheckpointConfig(JsonMixin):
    """Which checkpoints a run writes and keeps (Ray Train's ``CheckpointConfig`` fields and
    meanings). A checkpoint is taken at epoch boundaries: every ``checkpoint_frequency``
    epochs and always after the final epoch; a fault restarts from the newest one, so up to
    ``checkpoint_frequency - 1`` completed epochs are redone. ``num_to_keep`` newest are kept
    (None: all, as in Ray). Default 2, not Ray's None: every checkpoint holds the whole
    optimizer state and resuming needs only the newest intact one (the older one covers a
    corrupt newest)."""

    num_to_keep: int | None = 2         # newest checkpoints kept (None: all)
    checkpoint_frequency: int = 1       # epochs between checkpoints (0: only after the final epoch)
    interval_minutes: float | None = None  # within an epoch: a checkpoint at the first interval
                                        # boundary this many minutes after the last checkpoint
                                        # (0: every interval; None: none), so a fault loses at most
                                        # about that much; one slot, replaced, dropped at epoch end

    def __post_init__(self) -> None:
        if self.num_to_keep is not None:
            check_int("num_to_keep", self.num_to_keep, min_value=1)
        check_int("checkpoint_frequency", self.checkpoint_frequency, min_value=0)
        if self.interval_minutes is not None:
            check_float("interval_minutes", self.interval_minutes, min_value=0)

    def due(self, epochs_done: int, epochs: int) -> bool:
        """Whether the epoch boundary after ``epochs_done`` of ``epochs`` epochs is checkpointed."""
        return epochs_done >= epochs or (self.checkpoint_frequency > 0 and
                                         epochs_done % self.checkpoint_frequency == 0)


def default_run_name(prefix: str = "JabasTrainer") -> str:
    """A run name unique per run, as Ray Train names runs: ``<prefix>_<local date>_<time>_<6 hex>``
    (the random suffix keeps two runs started in the same second apart)."""
    import datetime
    import uuid
    return f"{prefix}_{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}_{uuid.uuid4().hex[:6]}"


RESUME_MODES = ("auto", "force")
CALLBACK_METHODS = ("on_epoch", "on_interval", "on_event", "on_trial_result", "log_trial_result")


@dataclass(frozen=True)
class RunConfig(JsonMixin):
    """Where a run keeps its checkpoints, metrics and plots (Ray Train's ``RunConfig`` shape).

    ``name`` None (the default) names every run uniquely (:func:`default_run_name`, set by the
    trainer), so two jobs never share a folder. A run folder records the job that wrote it
    (``job.json``: :mod:`jabasray.actors.job_identity`); ``fit()`` on a folder that holds
    checkpoints resumes it only when the recorded job matches (``epochs`` may grow), and a
    finished run returns its result. ``resume="force"`` resumes a folder whose recorded job
    differs (e.g. a deliberately changed LR or batch bound), rewriting the record.

    ``storage_path`` is a local path (a shared NFS folder on a multi-node cluster) or a URI
    (``s3://bucket/runs``, ``gs://bucket/runs``, ...); with ``storage_filesystem`` (any
    ``pyarrow.fs.FileSystem``, e.g. an ``S3FileSystem`` with its own endpoint and credentials)
    it is a path on that filesystem without its scheme (``bucket/runs``). Resolved as Ray Train
    resolves it (:func:`jabasray.storage.resolve`); the run's folder is
    ``<storage_path>/<name>``. A bad scheme or a filesystem of the wrong type is a one-line
    ``ValueError`` here; reachability is checked when the run starts, before any actor.
    """

    storage_path: str = "jabasray_runs"   # parent of all runs: local path or URI
    name: str | None = None                # this run's folder under storage_path (None: unique)
    storage_filesystem: Any = None         # pyarrow.fs.FileSystem (None: from storage_path)
    failure_config: FailureConfig = field(default_factory=FailureConfig)   # GPU-actor failures
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)  # what is kept
    callbacks: Sequence[Any] = ()          # DriverCallbacks and Ray Tune logger callbacks
                                           # (TBXLoggerCallback, MLflow, W&B): jabasray.actors.callbacks
    resume: str = "auto"                   # "auto": resume a matching job; "force": also a changed one

    def __post_init__(self) -> None:
        from .storage import check_storage_path

        if self.name is not None:
            check_run_name(self.name)
        check_choice("resume", self.resume, RESUME_MODES)
        if not isinstance(self.checkpoint_config, CheckpointConfig):
            raise ValueError(f"checkpoint_config must be a jabasray.config.CheckpointConfig, got "
                             f"{type(self.checkpoint_config).__name__}")
        if isinstance(self.callbacks, (str, bytes)) or not isinstance(self.callbacks, Sequence):
            raise ValueError(f"callbacks must be a list of callbacks, got {self.callbacks!r}")
        for cb in self.callbacks:
            if not any(hasattr(cb, m) for m in CALLBACK_METHODS):
                raise ValueError(f"callbacks: {type(cb).__name__} is not a callback (a "
                                 f"jabasray DriverCallback or a Ray Tune Callback such as "
                                 f"ray.tune.logger.TBXLoggerCallback)")
        object.__setattr__(self, "callbacks", tuple(self.callbacks))
        check_storage_path(self.storage_path, self.storage_filesystem)
        if not isinstance(self.failure_config, FailureConfig):
            raise ValueError(f"failure_config must be a jabasray.config.FailureConfig, got "
                             f"{type(self.failure_config).__name__}")

    @cached_property
    def storage(self) -> "StoragePath":
        """The storage root (``storage_path`` resolved; a relative local path is taken from the
        current directory - under ``ray job submit`` that is the job's temporary copy of the
        working directory, so pass an absolute path or a URI there)."""
        from .storage import resolve
        return resolve(self.storage_path, self.storage_filesystem)

    def named(self, prefix: str = "JabasTrainer") -> "RunConfig":
        """This config with a unique ``name`` when it has none (:func:`default_run_name`)."""
        if self.name is not None:
            return self
        import dataclasses
        return dataclasses.replace(self, name=default_run_name(prefix))

    @property
    def path(self) -> "StoragePath":
        """The run folder, ``storage / name`` (``str()``: a local absolute path or a URI);
        ``name`` must be set (:meth:`named`)."""
        if self.name is None:
            raise ValueError("name: this RunConfig has no run name yet; the trainer names it "
                             "(RunConfig.named()) or pass name=...")
        return self.storage / self.name


RAY_RUN_FIELDS = ("name", "storage_path", "storage_filesystem", "failure_config",
                  "checkpoint_config", "callbacks")


def is_ray_run_config(obj: object) -> bool:
    """Whether ``obj`` is Ray's ``ray.train.RunConfig`` or ``ray.tune.RunConfig`` (duck-typed:
    this module imports no Ray)."""
    cls = type(obj)
    return cls.__name__ == "RunConfig" and cls.__module__.split(".")[0] == "ray"


def run_config_from_ray(cfg: Any) -> RunConfig:
    """A jabasray :class:`RunConfig` from Ray's ``ray.train.RunConfig`` / ``ray.tune.RunConfig``.

    Converted, with Ray's meanings: ``name`` (None: unique per run), ``storage_path`` (Ray's
    default ``~/ray_results`` becomes ours, ``jabasray_runs``), ``storage_filesystem``,
    ``failure_config.max_failures``, ``checkpoint_config.num_to_keep`` and (Tune's)
    ``checkpoint_frequency`` (0, Ray's default, becomes 1: a jabasray run checkpoints at epoch
    boundaries so that a fault never loses more than an epoch), ``callbacks``. Any other field
    set to a non-default value (``stop``, ``sync_config``, ``verbose``, ``checkpoint_score_attribute``,
    ``fail_fast`` ...) is refused in one ``ValueError`` naming it."""
    import dataclasses

    where = f"{type(cfg).__module__}.{type(cfg).__qualname__}"
    default = type(cfg)()
    unsupported = [f.name for f in dataclasses.fields(cfg)
                   if f.name not in RAY_RUN_FIELDS and getattr(cfg, f.name) != getattr(default, f.name)]
    fc, cc = cfg.failure_config, cfg.checkpoint_config
    if fc is not None and getattr(fc, "fail_fast", False) not in (False, "DEPRECATED", None):
        unsupported.append("failure_config.fail_fast")
    if cc is not None:
        if getattr(cc, "checkpoint_score_attribute", None) is not None:
            unsupported.append("checkpoint_config.checkpoint_score_attribute (jabasray keeps the "
                               "newest checkpoints)")
        if getattr(cc, "checkpoint_at_end", None) is False:
            unsupported.append("checkpoint_config.checkpoint_at_end=False (the final epoch is "
                               "always checkpointed)")
    if unsupported:
        raise ValueError(f"run_config: {where} sets {', '.join(unsupported)}, which JabasTrainer "
                         f"does not support; it converts {', '.join(RAY_RUN_FIELDS)} (verbose: "
                         f"JabasTrainer(verbose=...)) - or pass a jabasray.config.RunConfig")
    freq = getattr(cc, "checkpoint_frequency", 0) if cc is not None else 0
    checkpoint = CheckpointConfig(
        num_to_keep=cc.num_to_keep if cc is not None else CheckpointConfig().num_to_keep,
        checkpoint_frequency=freq if isinstance(freq, int) and freq > 0 else 1)
    failure = FailureConfig(max_failures=fc.max_failures) if fc is not None else FailureConfig()
    storage = cfg.storage_path if cfg.storage_path != default.storage_path else None
    return RunConfig(storage_path=storage or RunConfig.storage_path, name=cfg.name,
                     storage_filesystem=cfg.storage_filesystem, failure_config=failure,
                     checkpoint_config=checkpoint, callbacks=tuple(cfg.callbacks or ()))


RAY_SCALING_FIELDS = ("num_workers", "use_gpu", "accelerator_type", "resources_per_worker")


@dataclass(frozen=True)
class Scaling:
    """What a Ray Train ``ScalingConfig`` asks of a jabasray run (:func:`scaling_from_ray`).

    ``max_gpus``: the most GPUs the job may use (Ray's ``num_workers``: the auto-scaler
    chooses among at most that many); ``use_gpu``: False trains on ``max_gpus`` GPUs emulated
    on CPU (Ray Train's CPU workers); ``gpu_type``: only GPUs of this type (None: any)."""

    max_gpus: int
    use_gpu: bool
    gpu_type: str | None = None


def is_ray_scaling_config(obj: object) -> bool:
    """Whether ``obj`` is Ray's ``ray.train.ScalingConfig`` (duck-typed: no Ray import)."""
    cls = type(obj)
    return cls.__name__ == "ScalingConfig" and cls.__module__.split(".")[0] == "ray"


def scaling_from_ray(cfg: Any) -> Scaling:
    """A :class:`Scaling` from Ray Train's ``ScalingConfig``, with Ray's meanings where
    jabasray has them: ``num_workers`` (the upper bound of GPUs: jabasray's auto-scaler picks
    how many of them pay), ``use_gpu``, ``accelerator_type`` or ``resources_per_worker``'s
    ``accelerator_type:<T>`` key (the GPU type). Any other field set to a non-default value
    (``trainer_resources``, ``placement_strategy``, ``label_selector``, TPUs, ...) and
    ``resources_per_worker`` beyond one GPU (and its type) are refused in one ValueError."""
    import dataclasses

    if not is_ray_scaling_config(cfg):
        raise ValueError(f"scaling_config must be a ray.train.ScalingConfig, got "
                         f"{type(cfg).__module__}.{type(cfg).__qualname__}")
    default = type(cfg)()
    unsupported = [f.name for f in dataclasses.fields(cfg)
                   if f.name not in RAY_SCALING_FIELDS and getattr(cfg, f.name) != getattr(default, f.name)]
    gpu_type = cfg.accelerator_type
    for key, amount in dict(cfg.resources_per_worker or {}).items():
        if key.startswith("accelerator_type:") and gpu_type in (None, key.split(":", 1)[1]):
            gpu_type = key.split(":", 1)[1]
        elif not ((key == "GPU" and amount == 1) or (key == "CPU")):
            unsupported.append(f"resources_per_worker[{key!r}]={amount!r}")
    if unsupported:
        raise ValueError(f"scaling_config: ScalingConfig sets {', '.join(unsupported)}, which "
                         f"JabasTrainer does not support (each GPU actor holds one GPU); it "
                         f"converts {', '.join(RAY_SCALING_FIELDS)} - or pass cluster=ClusterSpec(...)")
    num = cfg.num_workers
    if not isinstance(num, int) or isinstance(num, bool) or num < 1:
        raise ValueError(f"scaling_config.num_workers must be an int >= 1 (the most GPUs the job "
                         f"may use), got {num!r}")
    if not cfg.use_gpu and gpu_type is not None:
        raise ValueError(f"scaling_config: accelerator_type {gpu_type!r} needs use_gpu=True")
    return Scaling(max_gpus=num, use_gpu=bool(cfg.use_gpu), gpu_type=gpu_type)
