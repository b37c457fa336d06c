"""Every rank's SMA state survives re-placement and resume (Crossbow learners, per-rank state).

The driver runs SMA on one pair of emulated GPUs with the learner tuner driven by a forced
throughput curve (deterministic counts: 1, 2, 3, then settled at 2 per rank). Three ways to
train the same 2 epochs must end with the same state on every rank, bit for bit:
  * uninterrupted;
  * with a forced re-placement at every epoch (every actor restarts and gets its own state);
  * 1 epoch, then a new driver resuming from the checkpoint for the 2nd epoch (the uninterrupted
    run's epoch-1 checkpoint, in a copy of its run folder without the epoch-2 one: the same
    files a run stopped after epoch 1 leaves, without training that epoch again).
Before per-rank state the re-placed and resumed runs gave every rank rank 0's learners.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from actors_helpers import loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.config import JobConfig
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.ray

CURVE = [10.0, 20.0, 20.5]          # samples/s per rank at m = 1, 2, 3 (3 gains < 5%: settle at 2)


class CurveDriver(JabasDriver):
    def learner_throughput(self, rank, learners, reply):
        return CURVE[min(learners, len(CURVE)) - 1]


def run(tmp_path, name, epochs, force=False):
    ds, _ = tiny_data(96)
    job = JobConfig(epochs=epochs, sync="sma", sma_sync="hierarchical", sma_learners=1,
                    initial_global_batch=8,
                    min_global_batch=8, max_global_batch=8, min_local_batch=4, adapt_interval=2,
                    autoscale=False, lr=0.05, seed=5)
    drv = CurveDriver(model_fn, ds, optimizer_fn, loss_fn, job,
                      ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)]), tmp_path / name,
                      perf_model=perf_model(),
                      options=DriverOptions(evaluate=False, force_replacement=force))
    hist = drv.run()
    return drv.last_checkpoint.load_worker_state(), hist


def assert_same_state(a, b):
    assert a["sma_learners"] == b["sma_learners"] and a["sma_tuner"] == b["sma_tuner"]
    assert len(a["sma_ranks"]) == len(b["sma_ranks"]) == 2
    for sa, sb in zip(a["sma_ranks"], b["sma_ranks"]):
        assert sa["iteration"] == sb["iteration"] and sa["num_vsw"] == sb["num_vsw"]
        for k, v in sa["z"].items():
            assert torch.equal(sb["z"][k], v), k
        assert torch.equal(sa["velocity"], sb["velocity"])
        assert torch.equal(sa["ref"]["flat"], sb["ref"]["flat"])
        assert len(sa["replicas"]) == len(sb["replicas"])
        for ra, rb in zip(sa["replicas"], sb["replicas"]):
            assert torch.equal(ra["flat"], rb["flat"])


def test_forced_replacement_every_epoch_and_resume_equal_an_uninterrupted_run(ray_session, tmp_path):
    plain, hist = run(tmp_path, "plain", epochs=2)
    counts = [r.learners for r in hist.intervals]
    assert [1, 1] in counts and [2, 2] in counts and counts[-1] == [2, 2]
    # the ranks' learners differ (so a copy of rank 0's state would be detected)
    r0, r1 = plain["sma_ranks"]
    assert not torch.equal(r0["replicas"][0]["flat"], r1["replicas"][0]["flat"])
    assert not torch.equal(r0["ref"]["flat"], r1["ref"]["flat"])

    replaced, hist_r = run(tmp_path, "replaced", epochs=2, force=True)
    assert [e.replaced for e in hist_r.epochs] == [False, True]
    assert [r.learners for r in hist_r.intervals] == counts
    assert_same_state(plain, replaced)

    shutil.copytree(tmp_path / "plain", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "epoch_0002")
    resumed, hist_2 = run(tmp_path, "resumed", epochs=2)
    assert [e.epoch for e in hist_2.epochs] == [0, 1]
    assert any(m.startswith("resumed from") and "epoch_0001" in m for m in hist_2.events)
    assert [r.learners for r in hist_2.intervals] == counts
    assert_same_state(plain, resumed)
