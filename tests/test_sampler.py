"""The deterministic IIDP sampler: exactly-once service per epoch across all ranks and
decoupled workers, also when B_L or the layout changes mid-epoch, the ragged tail, and the
ragged tail step of the engine == a plain step on the union."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from engine_reference import OPTIMIZERS, clone, make_data, make_model, max_rel_diff, reference_step
from jabasray.engine import IIDPSampler, IIDPWorker, epoch_permutation, gather_micro_batches, iteration_indices
from jabasray.engine.sampler import add_digests, range_digest, sample_digest


def _run_epoch(sampler: IIDPSampler, epoch: int, schedule: list[tuple[int, list[int]]]):
    """Serve one epoch; ``schedule[k % len]`` gives (B_L, layout) of iteration k.
    Returns the indices served, per iteration per rank per worker."""
    cursor, served, k = 0, [], 0
    while True:
        B, layout = schedule[k % len(schedule)]
        parts = [sampler.iteration(epoch, cursor, B, layout, rank=r) for r in range(len(layout))]
        assert len({(p.next_cursor, p.ragged, p.epoch_end, p.global_batch) for p in parts}) == 1
        for r, p in enumerate(parts):
            assert len(p.micro_batches) == layout[r]
            if not p.ragged:
                assert all(len(mb) == B for mb in p.micro_batches)
        served.append([p.micro_batches for p in parts])
        assert parts[0].global_batch == sum(len(mb) for p in parts for mb in p.micro_batches)
        cursor = parts[0].next_cursor
        k += 1
        if parts[0].epoch_end:
            return served


SCHEDULES = [
    [(4, [3, 2])],                                   # fixed
    [(4, [3, 2]), (6, [3, 2]), (2, [3, 2])],         # B_L changes every iteration
    [(3, [1, 4]), (3, [2, 2, 2]), (5, [6])],         # layout (and number of ranks) changes
    [(7, [2, 5, 1])],
]


@pytest.mark.parametrize("n", [1, 13, 97, 120])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_sample_served_exactly_once_per_epoch(n, schedule):
    sampler = IIDPSampler(n, seed=3)
    for epoch in range(2):
        served = _run_epoch(sampler, epoch, schedule)
        if len(schedule) == 1:
            assert len(served) == sampler.iterations_left(0, *schedule[0])
        flat = np.concatenate([mb for it in served for rank in it for mb in rank])
        assert sorted(flat.tolist()) == list(range(n))
        for it in served[:-1]:                   # only the last iteration may be ragged
            sizes = [len(mb) for rank in it for mb in rank]
            assert len(set(sizes)) == 1


def test_ragged_tail_is_split_evenly_over_all_workers():
    # 23 samples, B_L=4, layout [2, 3]: one full iteration (20), then 3 left over 5 workers
    it0 = iteration_indices(0, 0, 0, 4, [2, 3], 0, 23)
    assert (it0.next_cursor, it0.ragged, it0.epoch_end) == (20, False, False)
    tails = [iteration_indices(0, 0, 20, 4, [2, 3], r, 23) for r in range(2)]
    assert [len(mb) for t in tails for mb in t.micro_batches] == [1, 1, 1, 0, 0]
    assert all(t.ragged and t.epoch_end and t.next_cursor == 23 for t in tails)
    exact = iteration_indices(0, 0, 0, 4, [2, 3], 1, 20)      # exact fit: not ragged
    assert not exact.ragged and exact.epoch_end


def test_deterministic_and_epoch_dependent():
    a = iteration_indices(5, 1, 8, 4, [2, 2], 1, 50)
    b = iteration_indices(5, 1, 8, 4, [2, 2], 1, 50)
    assert all(np.array_equal(x, y) for x, y in zip(a.micro_batches, b.micro_batches))
    assert not np.array_equal(epoch_permutation(5, 1, 50), epoch_permutation(5, 2, 50))
    assert not np.array_equal(epoch_permutation(5, 1, 50), epoch_permutation(6, 1, 50))
    perm = epoch_permutation(5, 1, 50)
    # rank 1 of layout [2, 2] holds global workers 2, 3: entries 8+8 .. 8+16 of the permutation
    assert np.array_equal(np.concatenate(a.micro_batches), perm[16:24])


@pytest.mark.parametrize("kwargs, field", [
    (dict(cursor=50), "cursor"), (dict(cursor=-1), "cursor"), (dict(local_batch_size=0), "local_batch_size"),
    (dict(layout=[]), "layout"), (dict(layout=[2, 0]), r"layout\[1\]"), (dict(rank=2), "rank"),
    (dict(dataset_size=0), "dataset_size"), (dict(seed=-1), "seed"),
])
def test_bad_sampler_input_names_the_field(kwargs, field):
    args = dict(seed=0, epoch=0, cursor=0, local_batch_size=4, layout=[1, 1], rank=0, dataset_size=50)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        iteration_indices(**args)


def test_ragged_tail_step_through_sampler_equals_plain_step_on_union():
    X, y = make_data(11, 30)
    ds = TensorDataset(X, y)
    sampler = IIDPSampler(len(ds), seed=1)
    model = make_model(0)
    ref = clone(model)
    ref_opt = OPTIMIZERS["adam"](list(ref.parameters()))
    w = IIDPWorker(model, OPTIMIZERS["adam"], F.cross_entropy, bucket_cap_mb=0.0005, weight_sync="ows")
    w.configure(2, 1, 4)
    cursor, ragged_seen = 0, False
    while True:
        it = sampler.iteration(0, cursor, 4, [w.num_workers])
        mbs = gather_micro_batches(ds, it.micro_batches)
        st = w.train_step(mbs, ragged=it.ragged)
        idx = torch.as_tensor(np.concatenate(it.micro_batches))
        assert st.loss == pytest.approx(reference_step(ref, ref_opt, X[idx], y[idx]), rel=1e-5)
        ragged_seen |= it.ragged
        cursor = it.next_cursor
        if it.epoch_end:
            break
    assert ragged_seen and cursor == 30
    assert max_rel_diff(w.model, ref) < 1e-5


def test_sample_digest_is_the_multiset_of_indices():
    """Order-independent, additive over disjoint parts, and it tells a duplicated sample in
    place of a missing one from every sample once (all such swaps of a small range)."""
    rng = np.random.default_rng(0)
    n = 40
    full = range_digest(n)
    assert sample_digest(rng.permutation(n)) == full
    parts = np.array_split(rng.permutation(n), 5)
    assert add_digests(*(sample_digest(p) for p in parts)) == full
    for dup in range(n):
        for missing in range(n):
            if dup != missing:
                served = [i for i in range(n) if i != missing] + [dup]
                assert sample_digest(served) != full, (dup, missing)
    assert sample_digest([]) == 0 and range_digest(1) == sample_digest([0])


def test_epoch_tally_checks_exactly_once_from_the_interval_digests():
    from jabasray.actors.metrics import EpochTally, IntervalRecord

    def rec(indices, digest=True):
        return IntervalRecord(epoch=0, interval=0, iteration=0, num_iterations=1, cursor=0,
                              requested_global_batch=1, global_batch=1, local_batch=1, plan=None,
                              loss=0.0, throughput=0.0, phi=None, lr=0.1, time_s=1.0,
                              samples=len(indices), served_digest=sample_digest(indices) if digest else None)

    ok, dup, unchecked = EpochTally(), EpochTally(), EpochTally()
    for t, parts in ((ok, [[0, 3], [1, 2, 4]]), (dup, [[0, 3], [1, 3, 4]])):
        for p in parts:
            t.add(rec(p))
    unchecked.add(rec([0, 1]))
    unchecked.add(rec([2, 3, 4], digest=False))
    assert ok.served_exactly_once(5) is True
    assert dup.served_exactly_once(5) is False        # 3 twice, 2 never: same count
    assert ok.served_exactly_once(6) is False
    assert unchecked.served_exactly_once(5) is None
