"""SMA learner auto-tuning wired into the JABAS driver (Crossbow section 3.4, Alg. 2) on the
session Ray instance: a forced throughput curve makes the tuner's decisions deterministic."""
from __future__ import annotations

import pytest
import torch

from actors_helpers import assert_each_sample_once_per_epoch, loss_fn, model_fn, optimizer_fn, perf_model, tiny_data
from jabasray.actors.driver import DriverOptions, JabasDriver
from jabasray.config import JobConfig
from jabasray.types import ClusterSpec, NodeSpec

pytestmark = pytest.mark.ray

# Throughput (samples/s) of each rank as a function of its learner count m (index m - 1).
CURVES = {0: [10.0, 20.0, 30.0, 30.0, 30.0], 1: [10.0, 15.0, 15.0, 15.0]}


class CurveDriver(JabasDriver):
    """Reports the forced curve instead of the measured samples / wall time."""

    seen: list[tuple[int, int]]

    def learner_throughput(self, rank, learners, reply):
        self.seen.append((rank, learners))
        assert reply.rank == rank and reply.samples > 0
        return CURVES[rank][learners - 1]


def test_driver_tunes_learners_per_pair_and_serves_every_sample_once(ray_session, tmp_path):
    """One pair, B_G pinned at 8 (B_L = 4, n_GA = 0), p = 1, tau = 5% relative (defaults).

    Both GPUs of the pair are tuned as one unit on the sum of their throughputs (symmetric
    similarity groups; per rank they would settle at 3 and 2). Expected per Alg. 2 with the
    settling rule (start at sma_learners = 1):
      pair 0: t(1)=20 -> 2 (gain over t'=0), t(2)=35 -> 3 (+75%), t(3)=45 -> 4 (+29%),
              t(4)=45 (+0%: no gain) -> settled at 3.
    So the intervals run [1,1], [2,2], [3,3], [4,4], then [3,3] until the epoch ends; every
    interval's layout is m_r * (n_GA + 1), and the sampler serves every sample exactly once.
    With lr_scaling="sqrt" the LR stays at the base (plan B_G* = base batch) while the run
    batch grows with the learners.
    """
    ds, _ = tiny_data(240)
    cluster = ClusterSpec(nodes=[NodeSpec("n0", "fast", 2, speed=1.0)])
    job = JobConfig(epochs=1, sync="sma", sma_learners=1, initial_global_batch=8,
                    min_global_batch=8, max_global_batch=8, min_local_batch=4, adapt_interval=1,
                    autoscale=False, lr=0.05, lr_scaling="sqrt", seed=4)
    drv = CurveDriver(model_fn, ds, optimizer_fn, loss_fn, job, cluster, tmp_path / "run",
                      perf_model=perf_model(), options=DriverOptions(evaluate=False, record_samples=True))
    drv.seen = []
    hist = drv.run()

    recs = hist.intervals
    learners = [r.learners for r in recs]
    expected = [[1, 1], [2, 2], [3, 3], [4, 4]] + [[3, 3]] * (len(recs) - 4)
    assert learners == expected
    assert drv.learner_tuner.is_settled("pair0") and drv.learner_tuner.learners("pair0") == 3
    assert list(drv.learner_tuner.gpus) == ["pair0"]
    # every interval but the epoch's last one was fed to the tuner, with the counts it ran
    assert drv.seen == [(r, m) for rec in recs[:-1] for r, m in enumerate(rec.learners)]

    cursor = 0
    for rec in recs:
        assert rec.local_batch == 4 and rec.num_iterations == 1 and rec.cursor == cursor
        ga = [rec.plan.workers[0].num_ga] * 2
        assert rec.layout == [m * (g + 1) for m, g in zip(rec.learners, ga)]
        assert rec.global_batch == 4 * sum(rec.layout)
        # the LR follows the plan's B_G* (8 = base batch), not the tuned learner count
        assert rec.plan.global_batch_size == 8 and rec.lr == pytest.approx(0.05, rel=1e-12)
        assert rec.samples == len(rec.served)          # what the actors say they trained on
        if rec is not recs[-1]:
            assert rec.samples == rec.global_batch
        cursor += rec.samples
    assert cursor == len(ds)
    assert_each_sample_once_per_epoch(hist, len(ds))
    # the actors really ran the tuned counts, and the checkpoint holds every rank's own state
    ws = drv.last_checkpoint.load_worker_state()
    assert [st["num_vsw"] for st in ws["sma_ranks"]] == [3, 3] and ws["sma_learners"] == [3, 3]
    assert [st["rank"] for st in ws["sma_ranks"]] == [0, 1]
    assert not torch.equal(ws["sma_ranks"][0]["replicas"][0]["flat"],
                           ws["sma_ranks"][1]["replicas"][0]["flat"])   # rank 1's own learners


def test_sma_learners_above_the_tuner_bound_is_a_one_line_error(tmp_path):
    ds, _ = tiny_data(16)
    job = JobConfig(sync="sma", sma_learners=9)
    with pytest.raises(ValueError, match=r"^sma_learners must be <= DriverOptions.sma_max_learners \(8\), got 9$"):
        JabasDriver(model_fn, ds, optimizer_fn, loss_fn, job,
                    ClusterSpec(nodes=[NodeSpec("n0", "fast", 2)]), tmp_path / "r")
    with pytest.raises(ValueError, match="sma_tuner_tau"):
        DriverOptions(sma_tuner_tau=-1.0)
    with pytest.raises(ValueError, match="sma_autotune"):
        DriverOptions(sma_autotune="yes")
