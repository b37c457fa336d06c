"""IIDP across two processes (gloo on 127.0.0.1) with different layouts per device.

Rank 0 hosts 2 VSWs x 2 GA steps (6 decoupled workers), rank 1 hosts 1 VSW x 4 GA steps
(5 workers): the all-reduced gradient must be the mean over all 11 workers - one plain step on
the union of the 11 micro-batches - not the mean of the two devices. After three steps both
ranks reconfigure (rank 0: 1 VSW x 0 GA, rank 1: 3 VSW x 1 GA, new B_L), run two more steps
and a ragged last step. Each scenario is compared with the plain single-process reference.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_reference import (OPTIMIZERS, make_data, make_model, max_rel_diff, reference_step, run_gloo_ranks,
                              split)

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

# (rank 0 (num_vsw, num_ga), rank 1 (num_vsw, num_ga), local_batch_size, steps)
PHASES = [((2, 2), (1, 4), 4, 3), ((1, 0), (3, 1), 6, 2)]
RAGGED_SIZES = [[3], [2, 2, 1, 0, 1, 1]]     # rank 0 then rank 1 (layout of phase 2)
SCENARIOS = [("sgd_momentum", "sws"), ("adam", "ows"), ("sgd_momentum", "ows")]


def _batches():
    """Yield (per-rank sizes, ragged) for every step of the schedule, seeded data later."""
    for (l0, l1, B, steps) in PHASES:
        w0, w1 = l0[0] * (l0[1] + 1), l1[0] * (l1[1] + 1)
        for _ in range(steps):
            yield (l0, l1, B), [[B] * w0, [B] * w1], False
    l0, l1, B, _ = PHASES[-1]
    yield (l0, l1, B), RAGGED_SIZES, True


def _worker(rank: int) -> dict:
    """One rank's runs of every scenario: weights, losses, bucket plan, first local gradient."""
    from jabasray.engine import IIDPWorker
    results = {}
    for opt_name, method in SCENARIOS:
        w = IIDPWorker(make_model(0), OPTIMIZERS[opt_name], F.cross_entropy,
                       process_group=dist.group.WORLD, weight_sync=method, bucket_cap_mb=0.0005)
        losses, configured = [], None
        for step, ((l0, l1, B), sizes, ragged) in enumerate(_batches()):
            layout = (l0, l1)[rank]
            if configured != (layout, B):
                w.configure(layout[0], layout[1], B)
                configured = (layout, B)
            X, y = make_data(100 + step, sum(map(sum, sizes)))
            offset = sum(sizes[0]) if rank == 1 else 0
            mine = split(X[offset:], y[offset:], sizes[rank])
            st = w.train_step(mine, ragged=ragged, keep_local_grad=step == 0)
            assert st.global_num_workers == sum(len(s) for s in sizes)
            losses.append(st.loss)
            if step == 0:
                local_grad = st.local_grad
        results[(opt_name, method)] = ({k: v.clone() for k, v in w.model.state_dict().items()}, losses,
                                       w.bucket_plan, local_grad)
        w.close()
    return results


def test_two_process_gloo_matches_plain_step_on_union(tmp_path):
    got = run_gloo_ranks(_worker, tmp_path)
    for opt_name, method in SCENARIOS:
        ref = make_model(0)
        opt = OPTIMIZERS[opt_name](list(ref.parameters()))
        ref_losses = []
        for step, (_, sizes, _) in enumerate(_batches()):
            X, y = make_data(100 + step, sum(map(sum, sizes)))
            ref_losses.append(reference_step(ref, opt, X, y))
        assert len(got[0][(opt_name, method)][2]) >= 3, "test needs several buckets"
        (_, sizes0, _), = list(_batches())[:1]
        X, y = make_data(100, sum(map(sum, sizes0)))
        mbs = split(X, y, sizes0[0] + sizes0[1])
        for r in range(2):                  # local_grad: this rank's sum, before the all-reduce
            mine = mbs[:len(sizes0[0])] if r == 0 else mbs[len(sizes0[0]):]
            init = make_model(0)
            for xb, yb in mine:
                F.cross_entropy(init(xb), yb).backward()
            expected = torch.cat([p.grad.reshape(-1) for p in init.parameters()])
            torch.testing.assert_close(got[r][(opt_name, method)][3], expected)
        for r in range(2):
            sd, losses, _, _ = got[r][(opt_name, method)]
            model = make_model(1)
            model.load_state_dict(sd)
            assert max_rel_diff(model, ref) < 1e-10, (opt_name, method, r)
            assert losses == pytest.approx(ref_losses, rel=1e-10)
