"""The SMA part of a checkpoint's worker_state (jabasray.actors.sma_state): packing every
rank's state and giving each rank of a new placement its own (no Ray, no training)."""
from __future__ import annotations

import pytest
import torch

from jabasray.actors.sma_state import is_packed_sma, pack_sma, restore_sma
from jabasray.engine.sma import SMAWorker


def rank_states(counts, sync="hierarchical"):
    """Real SMAWorker states whose learners are labelled (learner id g fills its replica with
    g) and whose reference models carry 100 + rank."""
    out, gid = [], 0
    for r, m in enumerate(counts):
        w = SMAWorker(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, lr=0.1, sma_sync=sync)
        w.configure(m, 0, 4)
        for fm in w._learners:
            fm.flat.fill_(float(gid))
            gid += 1
        if w._ref is not None:
            w._ref.flat.fill_(100.0 + r)
        out.append(w.state_dict())
    return out


def ids(states):
    return [[int(rep["flat"][0]) for rep in s["replicas"]] for s in states]


def test_same_gpus_give_every_rank_its_own_state_counts_and_tuner():
    """The next counts (the tuner's decision, [3, 3]) are returned for the driver to apply;
    each rank's state keeps the learners it ran with ([2, 3]), so nothing is re-split."""
    ws = pack_sma(rank_states([2, 3]), [3, 3], ["a", "a"], '{"tau": 0.05}')
    assert is_packed_sma(ws) and not is_packed_sma(ws["sma_ranks"][0])
    got = restore_sma(ws, ["a", "a"], default_learners=1)
    assert got.learners == [3, 3] and got.tuner_json == '{"tau": 0.05}'
    assert ids(got.states) == [[0, 1], [2, 3, 4]]
    assert [float(s["ref"]["flat"][0]) for s in got.states] == [100.0, 101.0]
    # loading a rank's state restores exactly its learners
    w = SMAWorker(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, lr=1.0, sma_sync="hierarchical")
    w.load_state_dict(got.states[1])
    assert [int(fm.flat[0]) for fm in w._learners] == [2, 3, 4] and float(w._ref.flat[0]) == 101.0


def test_other_gpus_restart_counts_and_tuner_and_map_learners_by_identity():
    ws = pack_sma(rank_states([2, 3]), [2, 3], ["a", "a"], '{"tau": 0.05}')
    got = restore_sma(ws, ["a", "a", "b", "b"], default_learners=2)
    assert got.learners == [2, 2, 2, 2] and got.tuner_json == ""
    assert ids(got.states) == [[0, 1], [2, 3], [4], []]          # 5 learners for 8 slots
    assert [s["ref"] is None for s in got.states] == [False, False, True, True]
    fewer = restore_sma(ws, ["b"], default_learners=4)
    assert fewer.learners == [4] and ids(fewer.states) == [[0, 1, 2, 3]]


def test_older_single_state_checkpoint_is_rank_zero_only():
    """The old form (rank 0's state, loaded into every rank) no longer clones rank 0's
    learners onto every rank: they stay on rank 0, the others start from z."""
    old = rank_states([2])[0]
    got = restore_sma(old, ["a", "a"], default_learners=2)
    assert ids(got.states) == [[0, 1], []] and got.learners == [2, 2]


def test_pack_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per rank"):
        pack_sma(rank_states([1]), [1, 1], ["a"])


def test_packed_state_loads_with_weights_only(tmp_path):
    """The checkpoint stays loadable without unpickling code (torch.load weights_only=True)."""
    ws = pack_sma(rank_states([1, 2]), [1, 2], ["a", "a"], '{"tau": 0.05}')
    torch.save(ws, tmp_path / "worker.pt")
    back = torch.load(tmp_path / "worker.pt", weights_only=True)
    assert back["sma_learners"] == [1, 2] and back["sma_tuner"] == '{"tau": 0.05}'
    assert ids(restore_sma(back, ["a", "a"], 1).states) == [[0], [1, 2]]
