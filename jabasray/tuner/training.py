"""How ONE configuration trains, and the shared input stream packs feed (torch only, no Ray).

The user describes the training of one configuration in a :class:`TrainingSpec` (model,
optimizer, batch size, data, metric as functions of the config). The same spec drives:

* packed Tune trials (:func:`jabasray.tuner.packed`): the trials of one device train in one
  :class:`~jabasray.engine.packing.PackedModel` (:mod:`jabasray.tuner.pack_runner`);
* ordinary one-configuration Tune trials (:func:`make_trainable`), e.g. under Ray Tune's own
  ``HyperBandScheduler`` -- the unpacked baseline.

Shared input stream (Pack paper 3.1.1/3.2). Step ``j`` of every configuration reads chunk
``j`` of a stream of ``stream_batch`` samples (``stream_batch`` = the largest batch size of the
search space): epoch ``e = j // steps_per_epoch`` is a permutation seeded by ``(seed, e)``, and
a configuration with batch size ``b`` trains on the FIRST ``b`` samples of the chunk, the rest
is "sliced and ignored". A configuration therefore sees exactly the same batches whether it
trains alone or in any pack, which is what makes packed and unpacked search agree. (For
``b < stream_batch`` an "epoch" visits only ``b / stream_batch`` of the data; that is the
paper's slicing semantics.)

Data: ``data_fn()`` returns ``(train, validation)``, each any map-style ``Dataset`` (``len``
and integer indexing) whose samples are ``(inputs, target)`` pairs. A ``TensorDataset`` is
indexed on the device in one gather per chunk (the fast path); any other dataset is read
sample by sample (``dataset[i]`` for the chunk's indices) and collated with torch's
``default_collate``, so a chunk is the same batch whichever form holds the data.
``validation`` is handed to ``metric_fn`` as it is.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset
from torch.utils.data import default_collate

from jabasray.config import CUDA_GRAPH_MODES
from jabasray.validation import check_choice, check_int

Config = Mapping[str, Any]

__all__ = ["TrainingSpec", "SharedStream", "config_seed", "build_member", "cached_data",
           "member_state", "load_member_state"]


@dataclass
class TrainingSpec:
    """The training of one configuration, as functions of its config dict.

    Every callable must be picklable by Ray (module-level functions or closures over plain
    data); they run inside the trial processes.
    """
    model_fn: Callable[[Config], nn.Module]                          # config -> fresh model
    optimizer_fn: Callable[[Config, nn.Module], torch.optim.Optimizer]   # config, model -> optimizer
    data_fn: Callable[[], tuple[Dataset, Dataset]]                   # () -> (train, validation), map-style
    metric_fn: Callable[[nn.Module, Dataset], float]                 # model, validation -> metric
    batch_size: str | Callable[[Config], int] = "batch_size"          # config key or function
    metric: str = "accuracy"                                          # name of metric_fn's value
    mode: str = "max"                                                 # "max" or "min"
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy
    steps_per_unit: int = 1                                           # mini-batch steps per resource unit
    seed: int = 0                                                     # init + data order seed
    device: str = "cpu"                                               # device of every trial
    memory_fn: Callable[[Config], float] | None = None                # bytes of one config (pack_opt)
    extra: dict[str, Any] = field(default_factory=dict)               # free for user callables
    cuda_graphs: str = "auto"                                         # packed step as a CUDA graph
                                                                      # ("auto" where possible, "off")

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ("max", "min"))
        check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPH_MODES)
        check_int("steps_per_unit", self.steps_per_unit, min_value=1)

    def batch_size_of(self, config: Config) -> int:
        b = self.batch_size(config) if callable(self.batch_size) else config.get(self.batch_size)
        return check_int(f"batch size of {dict(config)!r}", b, min_value=1)

    def better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b


def config_seed(config: Config, seed: int) -> int:
    """Stable per-configuration seed for weight init (same in every process and pack)."""
    text = json.dumps({k: config[k] for k in sorted(config)}, sort_keys=True, default=str)
    return (zlib.crc32(text.encode()) + 1_000_003 * seed) % (2 ** 31)


def build_member(spec: TrainingSpec, config: Config) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Fresh model (seeded by :func:`config_seed`) and its optimizer, on ``spec.device``."""
    state = torch.random.get_rng_state()
    torch.manual_seed(config_seed(config, spec.seed))
    try:
        model = spec.model_fn(config).to(spec.device)
    finally:
        torch.random.set_rng_state(state)
    return model, spec.optimizer_fn(config, model)


_DATA_CACHE: dict[tuple, Any] = {}


def cached_data(spec: TrainingSpec) -> tuple[Dataset, Dataset]:
    """``spec.data_fn()`` once per process (the driver, or a trial worker given no data);
    only the latest spec's data is kept."""
    fn = spec.data_fn
    key = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)), spec.seed)
    if key not in _DATA_CACHE:
        _DATA_CACHE.clear()
        _DATA_CACHE[key] = fn()
    return _DATA_CACHE[key]


def member_state(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "steps": int(steps)}


def load_member_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> int:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["steps"])


def check_map_style(name: str, dataset: Any) -> None:
    """One-line ValueError unless ``dataset`` is a map-style dataset (``len`` and indexing)."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(f"{name} must be a map-style Dataset (len() and dataset[i] -> (inputs, target)), "
                         f"got {type(dataset).__name__}")


class SharedStream:
    """Deterministic stream of ``stream_batch``-sample chunks over a map-style dataset (see the
    module docstring). ``batch(j)`` is chunk ``j``; it is a pure function of (seed, j)."""

    def __init__(self, dataset: Dataset, stream_batch: int, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        check_map_style("the training dataset (data_fn()[0])", dataset)
        self.device = torch.device(device)
        if isinstance(dataset, TensorDataset):
            self.x, self.y = (t.to(device) for t in dataset.tensors[:2])
            self.dataset = None
            n = len(self.y)
        else:
            self.x = self.y = None
            self.dataset = dataset
            n = len(dataset)
        self.n = n
        self.stream_batch = check_int("stream_batch", stream_batch, min_value=1, max_value=n)
        self.steps_per_epoch = n // stream_batch
        self.seed = seed
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            perm = torch.from_numpy(rng.permutation(self.n))
            self._perm = perm.to(self.x.device) if self.dataset is None else perm
            self._perm_epoch = epoch
        return self._perm

    def batch(self, step: int, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``step`` (its first ``size`` samples if given)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        lo = k * self.stream_batch
        idx = self._permutation(epoch)[lo:lo + (self.stream_batch if size is None else size)]
        if self.dataset is None:
            return self.x[idx], self.y[idx]
        sample = default_collate([self.dataset[i] for i in idx.tolist()])
        if not isinstance(sample, (list, tuple)) or len(sample) < 2:
            raise ValueError(f"samples of the training dataset must be (inputs, target) pairs, got "
                             f"{type(self.dataset[0]).__name__}")
        x, y = sample[0], sample[1]
        non_blocking = self.device.type == "cuda"
        return x.to(self.device, non_blocking=non_blocking), y.to(self.device, non_blocking=non_blocking)
