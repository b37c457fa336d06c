"""Reading the exactly-once sampler's indices: in memory, or through a torch DataLoader.

The sampler (:mod:`jabasray.engine.sampler`) decides WHICH samples every decoupled worker of
a rank gets in an iteration; this module only READS them. One iteration of one rank is one
batch: the concatenation of the rank's micro-batch indices, collated once, moved to the
device once, then split into the per-worker micro-batches (:func:`split_batch`).

Two sources with the same surface, ``batches(iterations) -> iterator of batches``:

* :class:`InMemoryBatches` - an in-memory map-style dataset (without a ``collate_fn`` a
  ``TensorDataset`` is indexed directly, anything else goes through ``collate_fn``); no
  worker processes.
* :class:`LoaderBatches` - a ``torch.utils.data.DataLoader`` over the dataset the actor built
  itself (``dataset_fn``): ``num_workers`` reader processes (persistent across intervals),
  ``collate_fn``, ``pin_memory`` on CUDA, ``prefetch_factor`` batches per worker. Its
  ``batch_sampler`` is a :class:`PlannedBatchSampler` that yields the index lists the sampler
  planned for the current interval, so the DataLoader reads exactly those samples, in that
  order: every sample once per epoch whatever B_L, the layout, re-placement or resume do
  (they only change the plan, never the permutation).

A rank that gets no sample in an iteration (possible in the ragged last iteration) gets an
empty batch: a zero-row slice of a batch of the same structure (no DataLoader call).

The DataLoader drains at every interval boundary (p iterations): the next interval's plan is
only known when the driver sends it, so its first batch is not prefetched.
"""
from __future__ import annotations

from collections.abc import Mapping   # (isinstance with typing's alias is ~5x slower)
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset, default_collate


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or a list/tuple/dict nesting of them) on ``device`` (non-blocking)."""
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device, non_blocking=True)
    if isinstance(x, (list, tuple)) and not _is_per_sample(x):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def _is_per_sample(x: Sequence) -> bool:
    """A collated list of plain values (strings, numbers: one per sample), not a structure."""
    return not any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in x)


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Split a collated batch into ``len(sizes)`` consecutive batches of ``sizes`` samples.

    Tensors split along dim 0; lists/tuples/dicts of them split element-wise (structure kept);
    a list of plain values (collated strings/numbers) is sliced."""
    sizes = [int(s) for s in sizes]
    if isinstance(batch, torch.Tensor):
        return list(batch.split(sizes))
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, sizes) for k, v in batch.items()}
        return [{k: parts[k][i] for k in parts} for i in range(len(sizes))]
    if isinstance(batch, (list, tuple)):
        if _is_per_sample(batch):
            bounds = np.concatenate([[0], np.cumsum(sizes)])
            return [type(batch)(batch[bounds[i]:bounds[i + 1]]) for i in range(len(sizes))]
        cols = [split_batch(v, sizes) for v in batch]
        return [type(batch)(c[i] for c in cols) for i in range(len(sizes))]
    raise ValueError(f"a batch must be a tensor or a list/tuple/dict of tensors, got {type(batch).__name__}")


def empty_like_batch(batch: Any) -> Any:
    """The same structure with zero samples."""
    return split_batch(batch, [0, batch_size(batch)])[0]


def batch_size(batch: Any) -> int:
    """Samples in a collated batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping) and batch:
        return batch_size(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return len(batch) if _is_per_sample(batch) else batch_size(batch[0])
    raise ValueError(f"a batch must be a tensor or a list/tuple/dict of tensors, got {type(batch).__name__}")


def gather_rows(dataset: Any, indices: Any, collate_fn: Callable | None = None) -> Any:
    """Rows ``indices`` of an in-memory dataset as one batch: without a ``collate_fn`` a
    ``TensorDataset`` is indexed directly (a tuple of tensors, what ``default_collate`` gives),
    anything else goes through ``collate_fn`` (``default_collate``), as a DataLoader with that
    ``collate_fn`` batches it. Empty ``indices`` give a zero-row batch."""
    idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
    if isinstance(dataset, TensorDataset) and collate_fn is None:
        return tuple(t[idx] for t in dataset.tensors)
    collate = collate_fn or default_collate
    if len(idx) == 0:
        return empty_like_batch(collate([dataset[0]]))
    return collate([dataset[int(i)] for i in idx])


class InMemoryBatches:
    """Batches of an in-memory dataset, read in the calling thread."""

    def __init__(self, dataset: Any, collate_fn: Callable | None = None) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(self, index_lists: Sequence[np.ndarray]) -> Iterator[Any]:
        for idx in index_lists:
            yield gather_rows(self.dataset, idx, self.collate_fn)

    def close(self) -> None:
        pass


class PlannedBatchSampler(Sampler):
    """A DataLoader ``batch_sampler`` whose every pass yields the index lists set by
    :meth:`plan` (a new plan per interval; the workers stay alive between passes)."""

    def __init__(self) -> None:
        self._plan: list[list[int]] = []

    def plan(self, index_lists: Sequence[np.ndarray]) -> None:
        self._plan = [np.asarray(i, dtype=np.int64).tolist() for i in index_lists]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._plan)

    def __len__(self) -> int:
        return len(self._plan)


class LoaderBatches:
    """Batches read by a ``DataLoader`` (see the module notes).

    Args:
        dataset: map-style dataset built on this actor.
        num_workers: DataLoader worker processes (0: read in the calling thread).
        collate_fn: list of samples -> batch (None: ``default_collate``).
        pin_memory: page-locked batches for asynchronous host-to-GPU copies (CUDA).
        prefetch_factor: batches loaded in advance by each worker (``num_workers`` > 0).
    """

    def __init__(self, dataset: Any, num_workers: int = 0, collate_fn: Callable | None = None,
                 pin_memory: bool = False, prefetch_factor: int = 2) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate
        self._sampler = PlannedBatchSampler()
        self.loader = DataLoader(dataset, batch_sampler=self._sampler, num_workers=num_workers,
                                 collate_fn=self.collate_fn, pin_memory=pin_memory,
                                 prefetch_factor=prefetch_factor if num_workers > 0 else None,
                                 persistent_workers=num_workers > 0)
        self._template: Any = None

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(self, index_lists: Sequence[np.ndarray]) -> Iterator[Any]:
        """One batch per index list, in order; empty lists give zero-row batches."""
        nonempty = [idx for idx in index_lists if len(idx) > 0]
        self._sampler.plan(nonempty)
        it = iter(self.loader) if nonempty else iter(())
        for idx in index_lists:
            if len(idx) == 0:
                yield self._empty()
                continue
            batch = next(it)
            if self._template is None:
                self._template = empty_like_batch(batch)
            yield batch

    def _empty(self) -> Any:
        if self._template is None:
            self._template = empty_like_batch(self.collate_fn([self.dataset[0]]))
        return self._template

    def close(self) -> None:
        """Stop the worker processes."""
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.loader._iterator = None
