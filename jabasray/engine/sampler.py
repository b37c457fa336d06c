"""Deterministic, communication-free sampler for IIDP (cross-team interface 3).

Every device computes its own micro-batch indices for an iteration from
``(seed, epoch, cursor, local_batch_size, layout, rank)`` and the dataset size:

* one shuffled permutation per epoch: ``numpy.random.default_rng([seed, epoch]).permutation(N)``;
* an iteration consumes the next ``B_G = B_L * sum(layout)`` entries of the permutation,
  starting at ``cursor`` (samples consumed so far this epoch - the only state the driver
  carries and checkpoints). Decoupled workers are numbered globally rank by rank
  (``layout[r]`` workers on rank ``r``, in the engine's micro-batch order), and global worker
  ``w`` gets entries ``cursor + w*B_L .. cursor + (w+1)*B_L``;
* the last iteration of an epoch, when fewer than ``B_G`` samples remain, hands out the
  remainder split as evenly as possible over all workers (worker ``w`` gets
  ``R // W + (w < R % W)`` samples, so some may get 0): ``ragged=True``, to be passed to
  ``IIDPWorker.train_step(..., ragged=True)``.

Because consumption is a contiguous walk over one permutation, every sample is served exactly
once per epoch even when ``B_L`` or the layout changes between iterations. What the actors
really served is checked, not assumed: each reports :func:`sample_digest` of the indices it
read, and the driver compares the epoch's sum with :func:`range_digest` of the dataset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from ..validation import check_int


def epoch_permutation(seed: int, epoch: int, dataset_size: int) -> np.ndarray:
    """The epoch's shuffled order of ``range(dataset_size)`` (int64)."""
    seed = check_int("seed", seed, min_value=0)
    epoch = check_int("epoch", epoch, min_value=0)
    dataset_size = check_int("dataset_size", dataset_size, min_value=1)
    return np.random.default_rng([seed, epoch]).permutation(dataset_size).astype(np.int64)


@dataclass(frozen=True)
class IterationIndices:
    """This rank's share of one iteration."""

    micro_batches: list[np.ndarray]  # dataset indices per decoupled worker of this rank
    cursor: int                      # samples consumed this epoch before the iteration
    next_cursor: int                 # ... and after it (cursor to carry)
    global_batch: int                # samples consumed by all ranks in this iteration
    ragged: bool                     # last, short iteration: pass ragged=True to train_step
    epoch_end: bool                  # next_cursor == dataset_size: start the next epoch at 0


def _check_layout(layout: Sequence[int], rank: int) -> list[int]:
    if not isinstance(layout, (list, tuple)) or not layout:
        raise ValueError(f"layout must be a non-empty list of decoupled-worker counts per rank, got {layout!r}")
    out = [check_int(f"layout[{i}]", w, min_value=1) for i, w in enumerate(layout)]
    check_int("rank", rank, min_value=0, max_value=len(out) - 1)
    return out


def split_sizes(cursor: int, local_batch_size: int, num_workers: int, dataset_size: int) -> list[int]:
    """Samples of every global decoupled worker for the iteration starting at ``cursor``."""
    remaining = dataset_size - cursor
    full = local_batch_size * num_workers
    if remaining >= full:
        return [local_batch_size] * num_workers
    base, extra = divmod(remaining, num_workers)
    return [base + (1 if w < extra else 0) for w in range(num_workers)]


def iteration_indices(seed: int, epoch: int, cursor: int, local_batch_size: int, layout: Sequence[int],
                      rank: int, dataset_size: int, permutation: np.ndarray | None = None
                      ) -> IterationIndices:
    """Micro-batch indices of ``rank`` for the iteration starting at ``cursor`` (module notes).

    ``permutation`` may pass the cached :func:`epoch_permutation` to skip recomputing it.
    """
    check_int("dataset_size", dataset_size, min_value=1)
    check_int("cursor", cursor, min_value=0, max_value=dataset_size - 1)
    check_int("local_batch_size", local_batch_size, min_value=1)
    layout = _check_layout(layout, rank)
    perm = epoch_permutation(seed, epoch, dataset_size) if permutation is None else permutation
    if len(perm) != dataset_size:
        raise ValueError(f"permutation must have dataset_size = {dataset_size} entries, got {len(perm)}")
    W = sum(layout)
    sizes = split_sizes(cursor, local_batch_size, W, dataset_size)
    starts = np.concatenate([[0], np.cumsum(sizes)]) + cursor
    first = sum(layout[:rank])
    mbs = [perm[starts[w]:starts[w + 1]] for w in range(first, first + layout[rank])]
    consumed = int(sum(sizes))
    ragged = consumed < local_batch_size * W
    nxt = cursor + consumed
    return IterationIndices(mbs, cursor, nxt, consumed, ragged, nxt == dataset_size)


class IIDPSampler:
    """Caches the epoch permutation; otherwise the pure :func:`iteration_indices`."""

    def __init__(self, dataset_size: int, seed: int = 0) -> None:
        self.dataset_size = check_int("dataset_size", dataset_size, min_value=1)
        self.seed = check_int("seed", seed, min_value=0)
        self._epoch: int | None = None
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:
            self._perm = epoch_permutation(self.seed, epoch, self.dataset_size)
            self._epoch = epoch
        return self._perm

    def iteration(self, epoch: int, cursor: int, local_batch_size: int, layout: Sequence[int],
                  rank: int = 0) -> IterationIndices:
        return iteration_indices(self.seed, epoch, cursor, local_batch_size, layout, rank,
                                 self.dataset_size, self.permutation(epoch))

    def iterations_left(self, cursor: int, local_batch_size: int, layout: Sequence[int]) -> int:
        """Iterations until the epoch ends if ``B_L`` and the layout stay as given."""
        full = local_batch_size * sum(layout)
        return -(-(self.dataset_size - cursor) // full)


_U64 = (1 << 64) - 1


def sample_digest(indices: Any) -> int:
    """Order-independent digest of a multiset of sample indices: ``sum_i h(i) mod 2^64`` with
    ``h`` the SplitMix64 finaliser (Steele, Lea and Flood 2014), a bijective 64-bit mixer.

    Digests of disjoint parts add (mod 2^64, :func:`add_digests`), so ranks and intervals
    combine theirs without sending indices. A multiset of ``n`` indices has the digest of
    ``range(n)`` with the same count only if it IS ``range(n)``, barring a 64-bit collision:
    a duplicated ``i`` in place of a missing ``j`` shifts the sum by ``h(i) - h(j) != 0``.
    """
    z = np.asarray(indices, dtype=np.int64).astype(np.uint64).reshape(-1)
    with np.errstate(over="ignore"):                     # arithmetic mod 2^64 is the point
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        return int(z.sum(dtype=np.uint64))


def add_digests(*digests: int) -> int:
    """The digest of the union of disjoint multisets (sum mod 2^64)."""
    return sum(digests) & _U64


def range_digest(dataset_size: int) -> int:
    """:func:`sample_digest` of ``range(dataset_size)``: every sample once."""
    return sample_digest(np.arange(check_int("dataset_size", dataset_size, min_value=1)))


def gather_micro_batches(dataset: Any, indices: Sequence[np.ndarray]) -> list[Any]:
    """One batch per index array (:func:`jabasray.engine.loader.gather_rows`: direct tensor
    indexing for a ``TensorDataset``, else ``default_collate`` over the items)."""
    from .loader import gather_rows
    return [gather_rows(dataset, idx) for idx in indices]
