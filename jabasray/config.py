"""User-facing job configuration (``JobConfig``) and run configuration (``RunConfig``).

All fields are validated in ``__post_init__``: a bad value raises a one-line ``ValueError``
naming the field and the allowed values.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .serialization import JsonMixin
from .validation import check_choice, check_float, check_int

LR_SCALING_RULES = ("linear", "sqrt", "none")
WEIGHT_SYNC_METHODS = ("auto", "sws", "ows")
SYNC_METHODS = ("iidp", "sma")
AUTOSCALE_OBJECTIVES = ("time", "cost", "time_under_budget")

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
    adapt_interval: int = 10            # p: iterations between two B_G adaptations (one Ray call)
    alpha: float = 0.1                  # adaptive rate: B_G' = B_G * (1 +/- alpha)
    gamma: float = 0.5                  # similarity threshold: Phi < gamma grows B_G, > shrinks
    adaptive: bool = True               # False: keep B_G = initial_global_batch
    autoscale: bool = True              # re-place GPUs every epoch from the forecast trajectory
    autoscale_objective: str = "time"   # "time" | "cost" | "time_under_budget"
    cost_budget: float | None = None    # price budget per epoch for "time_under_budget"
    epochs: int = 5                     # training epochs
    lr: float = 0.05                    # learning rate at initial_global_batch
    lr_scaling: str = "sqrt"            # LR follows B_G: "linear" | "sqrt" | "none"
    warmup_iterations: int = 0          # linear LR warm-up from 0 over this many iterations
    weight_sync: str = "auto"           # IIDP one-way weight sync: "auto" | "sws" | "ows"
    sync: str = "iidp"                  # "iidp" (VSWs + all-reduce) or "sma" (Crossbow learners)
    sma_learners: int = 2               # m: SMA learners per device at start (sync="sma")
    sma_alpha: float | None = None      # SMA correction rate; None -> 1/k (k = total learners)
    seed: int = 0                       # seeds data order, model init and search

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
        check_int("adapt_interval", self.adapt_interval, min_value=1)
        check_float("alpha", self.alpha, min_value=0, min_exclusive=True)
        check_float("gamma", self.gamma, min_value=-1, max_value=1)
        check_choice("autoscale_objective", self.autoscale_objective, AUTOSCALE_OBJECTIVES)
        if self.autoscale_objective == "time_under_budget":
            if self.cost_budget is None:
                raise ValueError("cost_budget must be a number > 0 when autoscale_objective is "
                                 "'time_under_budget', got None")
        if self.cost_budget is not None:
            check_float("cost_budget", self.cost_budget, min_value=0, min_exclusive=True)
        check_int("epochs", self.epochs, min_value=1)
        check_float("lr", self.lr, min_value=0, min_exclusive=True)
        check_choice("lr_scaling", self.lr_scaling, LR_SCALING_RULES)
        check_int("warmup_iterations", self.warmup_iterations, min_value=0)
        check_choice("weight_sync", self.weight_sync, WEIGHT_SYNC_METHODS)
        check_choice("sync", self.sync, SYNC_METHODS)
        check_int("sma_learners", self.sma_learners, min_value=1)
        if self.sma_alpha is not None:
            check_float("sma_alpha", self.sma_alpha, min_value=0, max_value=1, min_exclusive=True)
        check_int("seed", self.seed, min_value=0)


@dataclass(frozen=True)
class RunConfig(JsonMixin):
    """Where a run keeps its checkpoints, metrics and plots (Ray Train's ``RunConfig`` shape)."""

    storage_path: str = "jabasray_runs"   # parent folder of all runs
    name: str = "run"                      # this run's folder under storage_path

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"name must be a non-empty folder name without '/', got {self.name!r}")

    @property
    def path(self) -> Path:
        """The run folder as an absolute path (a relative ``storage_path`` is taken from the
        current directory; under ``ray job submit`` that is the job's temporary copy of the
        working directory, so pass an absolute one there)."""
        return (Path(self.storage_path).expanduser() / self.name).absolute()
