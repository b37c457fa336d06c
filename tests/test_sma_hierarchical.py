"""Two-level (hierarchical) SMA of Crossbow section 3.3, per-rank SMA state, the re-placement
mapping of learners, and the communication critical section.

The reference below is written from the paper's equations with plain autograd and lists of
per-parameter tensors, independently of ``jabasray.engine.sma`` (G GPUs, m_g learners on GPU g,
local reference models r_g, central model z; alpha_l = 1/m_g, alpha_g = 1/G)::

    c_gj = alpha_l (w_gj - r_g);   w_gj <- w_gj - lr (grad l(w_gj) + wd w_gj) - c_gj
    r_g^ = r_g + sum_j c_gj        (the reference model incorporates its learners' differences)
    C_g  = alpha_g (r_g^ - z);     r_g  <- r_g^ - C_g
    z    <- z + sum_g C_g + mu (z - z_prev);   z_prev <- z (before the update)
"""
from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from jabasray.config import JobConfig
from jabasray.engine.sma import (SMAWorker, redistribute_sma_states,
                                 sma_hierarchical_iteration_)

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

LR, MU, WD = 0.1, 0.9, 0.01
COUNTS = (2, 3)            # learners on rank 0 and rank 1
STEPS = 4
RESUME_AT = 2


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def step_batches(step: int, k: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The k micro-batches of one iteration, in global learner order (rank 0's first)."""
    g = torch.Generator().manual_seed(500 + step)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(k)]


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def grad_at(model: nn.Module, ws: list[torch.Tensor], batch) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p, w in zip(ref.parameters(), ws):
            p.copy_(w)
    x, y = batch
    nn.functional.cross_entropy(ref(x), y).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def transcription(model: nn.Module, counts, steps: int, lr=LR, mu=MU, wd=WD):
    """Section 3.3 verbatim (module docstring); returns (z, refs, replicas per GPU, losses)."""
    G = len(counts)
    z, z_prev = params(model), None
    refs = [params(model) for _ in counts]
    ws = [[params(model) for _ in range(m)] for m in counts]
    losses = []
    for s in range(steps):
        batches = step_batches(s, sum(counts))
        loss = 0.0
        C, new_ws, new_refs, off = [], [], [], 0
        for g, m in enumerate(counts):
            cs, mine = [], []
            for j in range(m):
                b = batches[off + j]
                grad = grad_at(model, ws[g][j], b)
                step = [lr * (gi + wd * wi) for gi, wi in zip(grad, ws[g][j])]
                c = [(1.0 / m) * (wi - ri) for wi, ri in zip(ws[g][j], refs[g])]
                mine.append([wi - si - ci for wi, si, ci in zip(ws[g][j], step, c)])
                cs.append(c)
                probe = copy.deepcopy(model)
                with torch.no_grad():
                    for p, w in zip(probe.parameters(), ws[g][j]):
                        p.copy_(w)
                    loss += float(nn.functional.cross_entropy(probe(b[0]), b[1]))
            new_ws.append(mine)
            r_hat = [ri + sum(c[i] for c in cs) for i, ri in enumerate(refs[g])]
            C.append([(1.0 / G) * (ri - zi) for ri, zi in zip(r_hat, z)])
            new_refs.append([ri - ci for ri, ci in zip(r_hat, C[g])])
            off += m
        z_old = [t.clone() for t in z]
        z = [zi + sum(C[g][i] for g in range(G)) + (mu * (zi - zp) if z_prev is not None else 0)
             for i, (zi, zp) in enumerate(zip(z, z_prev or z))]
        z_prev, ws, refs = z_old, new_ws, new_refs
        losses.append(loss / sum(counts))
    return z, refs, ws, losses


def assert_close_lists(a, b, atol=None):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **({} if atol is None else {"atol": atol, "rtol": 0}))


# ---------------------------------------------------------------- functional core

def test_functional_hierarchical_core_matches_the_equations_on_random_tensors():
    gen = torch.Generator().manual_seed(3)
    n, counts, a_g = 11, (2, 3), 0.5
    z0 = torch.randn(n, generator=gen)
    refs0 = [torch.randn(n, generator=gen) for _ in counts]
    reps0 = [[torch.randn(n, generator=gen) for _ in range(m)] for m in counts]
    grads = [[[torch.randn(n, generator=gen) for _ in range(m)] for m in counts] for _ in range(4)]
    # reference: the module docstring's equations, written out
    z, z_prev, refs, ws = z0.clone(), None, [r.clone() for r in refs0], [[w.clone() for w in g] for g in reps0]
    for gs in grads:
        C, new_refs, new_ws = [], [], []
        for g, m in enumerate(counts):
            cs = [(1.0 / m) * (w - refs[g]) for w in ws[g]]
            new_ws.append([w - LR * gr - c for w, gr, c in zip(ws[g], gs[g], cs)])
            r_hat = refs[g] + sum(cs)
            C.append(a_g * (r_hat - z))
            new_refs.append(r_hat - C[g])
        z_new = z + sum(C) + (MU * (z - z_prev) if z_prev is not None else 0)
        z_prev, z, refs, ws = z, z_new, new_refs, new_ws
    ez, v = z0.clone(), torch.zeros(n)
    erefs, ews = [r.clone() for r in refs0], [[w.clone() for w in g] for g in reps0]
    for gs in grads:
        sma_hierarchical_iteration_(ews, gs, erefs, ez, v, LR, [1.0 / m for m in counts], a_g, MU)
    torch.testing.assert_close(ez, z)
    assert_close_lists(erefs, refs)
    for a, b in zip(ews, ws):
        assert_close_lists(a, b)
    with pytest.raises(ValueError, match="one entry per device"):
        sma_hierarchical_iteration_(ews, grads[0], erefs[:1], ez, v, LR, 0.5, a_g, MU)


@pytest.mark.parametrize("mu", [0.0, MU])
@pytest.mark.parametrize("counts", [(1, 1), (2, 2), (2, 3), (4, 4)])
def test_without_gradients_the_two_levels_reach_consensus(counts, mu):
    """Zero gradients from scattered replicas and reference models: the recursion contracts
    to one model (every learner = every r_g = z) instead of oscillating (module notes: the
    order of the global correction: with the iteration-start r_g this diverges for (1, 1),
    (2, 2) and, without momentum, for every case here)."""
    gen = torch.Generator().manual_seed(4)
    n = 6
    z, v = torch.randn(n, generator=gen), torch.zeros(n)
    refs = [torch.randn(n, generator=gen) for _ in counts]
    ws = [[torch.randn(n, generator=gen) for _ in range(m)] for m in counts]
    zero = [[torch.zeros(n) for _ in range(m)] for m in counts]
    start = max(float((t - z).abs().max()) for t in refs + [w for g in ws for w in g])
    for _ in range(300):
        sma_hierarchical_iteration_(ws, zero, refs, z, v, LR, [1.0 / m for m in counts],
                                    1.0 / len(counts), mu)
    spread = max(float((t - z).abs().max()) for t in refs + [w for g in ws for w in g])
    assert start > 1.0 and spread < 1e-4 and float(z.abs().max()) < 10 * start


# ---------------------------------------------------------------- 2 processes x 2-3 learners

def _worker(rank: int, out_dir: str, init_file: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)      # as the float64 fixture in the test process
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        k, m, off = sum(COUNTS), COUNTS[rank], sum(COUNTS[:rank])

        def make(seed):
            w = SMAWorker(tiny_model(seed), nn.functional.cross_entropy, lr=LR, momentum=MU,
                          weight_decay=WD, process_group=dist.group.WORLD, sma_sync="hierarchical")
            w.configure(m, 0, 4)
            return w

        w = make(0)
        losses, saved = [], None
        for s in range(STEPS):
            if s == RESUME_AT:
                saved = w.state_dict()
            st = w.train_step(step_batches(s, k)[off:off + m])
            losses.append(st.loss)
            assert st.total_learners == k and st.global_num_workers == k
        # a resumed worker (other initial weights) given this rank's own state continues identically
        resumed = make(7)
        resumed.load_state_dict(saved)
        for s in range(RESUME_AT, STEPS):
            resumed.train_step(step_batches(s, k)[off:off + m])
        torch.save({"z": params(w.model), "ref": params(w.reference_model),
                    "replicas": [params(fm.module) for fm in w._learners], "losses": losses,
                    "alpha": (w.alpha, w.alpha_global),
                    "resumed": resumed.state_dict(), "final": w.state_dict()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hier")
    mp.spawn(_worker, args=(str(out), str(out / "init")), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_two_ranks_with_two_and_three_learners_follow_the_paper_equations(gloo_run):
    z, refs, ws, losses = transcription(tiny_model(0), COUNTS, STEPS)
    for rank, got in enumerate(gloo_run):
        assert got["alpha"] == (pytest.approx(1.0 / COUNTS[rank]), 0.5)
        assert_close_lists(got["z"], z)
        assert_close_lists(got["ref"], refs[rank])
        assert len(got["replicas"]) == COUNTS[rank]
        for a, b in zip(got["replicas"], ws[rank]):
            assert_close_lists(a, b)
        assert got["losses"] == pytest.approx(losses, rel=1e-10)
    # the reference models really differ between the GPUs (two levels, not one copy of z)
    assert any(not torch.allclose(a, b) for a, b in zip(gloo_run[0]["ref"], gloo_run[1]["ref"]))


def test_each_rank_resumed_from_its_own_state_continues_bit_identically(gloo_run):
    for got in gloo_run:
        final, resumed = got["final"], got["resumed"]
        assert torch.equal(final["velocity"], resumed["velocity"])
        for k, v in final["z"].items():
            assert torch.equal(resumed["z"][k], v)
        assert torch.equal(final["ref"]["flat"], resumed["ref"]["flat"])
        assert len(final["replicas"]) == len(resumed["replicas"])
        for a, b in zip(final["replicas"], resumed["replicas"]):
            assert torch.equal(a["flat"], b["flat"])
        assert final["iteration"] == resumed["iteration"] == STEPS


def test_saved_per_rank_states_move_to_one_rank_with_their_learner_identity(gloo_run):
    """2 ranks (2 + 3 learners) -> 1 rank with 5 learners -> 2 ranks again: learner ids keep
    their global order, rank 0 keeps its reference model, nothing is invented on the way."""
    states = [g["final"] for g in gloo_run]
    one = redistribute_sma_states(states, [5])
    assert len(one) == 1 and one[0]["num_vsw"] == 5 and one[0]["world_size"] == 1
    flat_ids = [rep["flat"] for st in states for rep in st["replicas"]]
    assert all(torch.equal(a["flat"], b) for a, b in zip(one[0]["replicas"], flat_ids))
    assert torch.equal(one[0]["ref"]["flat"], states[0]["ref"]["flat"])
    w = SMAWorker(tiny_model(9), nn.functional.cross_entropy, lr=1.0, sma_sync="hierarchical")
    w.load_state_dict(one[0])
    assert w.num_vsw == 5 and w.get_lr() == LR
    for fm, b in zip(w._learners, flat_ids):
        assert torch.equal(fm.flat, b)
    for k, v in states[0]["z"].items():
        assert torch.equal(w.model.state_dict()[k], v)
    back = redistribute_sma_states([w.state_dict()], list(COUNTS))
    assert [len(s["replicas"]) for s in back] == list(COUNTS)
    assert all(torch.equal(a["flat"], b) for a, b in
               zip([r for s in back for r in s["replicas"]], flat_ids))
    assert back[1]["ref"] is None          # rank 1 is new here: its reference model starts from z


# ---------------------------------------------------------------- the mapping, as a pure function

def _fake_states(counts, with_ref=True):
    """States whose replicas are labelled by global learner id (a 1-element tensor)."""
    out, gid = [], 0
    for r, m in enumerate(counts):
        reps = [{"flat": torch.tensor([float(gid + j)]), "buffers": []} for j in range(m)]
        gid += m
        out.append({"z": {"w": torch.tensor([-1.0])}, "velocity": torch.tensor([0.5]),
                    "replicas": reps, "ref": {"flat": torch.tensor([100.0 + r]), "buffers": []}
                    if with_ref else None, "num_vsw": m, "rank": r, "world_size": len(counts),
                    "iteration": 7, "lr": 0.1})
    return out


@pytest.mark.parametrize("old,new,ids,refs", [
    ((2, 3), (2, 3), [[0, 1], [2, 3, 4]], [100, 101]),            # same counts: identity
    ((2, 3), (5,), [[0, 1, 2, 3, 4]], [100]),                     # fewer GPUs: learners follow ids
    ((2, 3), (2, 2, 2), [[0, 1], [2, 3], [4]], [100, 101, None]),  # more learners: id 5 from z
    ((3, 3), (2, 2), [[0, 1], [2, 3]], [100, 101]),               # fewer learners: ids 4, 5 dropped
    ((1,), (1, 1), [[0], []], [100, None]),                       # a new rank starts from z
])
def test_redistribution_keeps_learner_identity_in_global_order(old, new, ids, refs):
    states = _fake_states(old)
    got = redistribute_sma_states(states, list(new))
    assert [[int(r["flat"].item()) for r in s["replicas"]] for s in got] == ids
    assert [None if s["ref"] is None else int(s["ref"]["flat"].item()) for s in got] == refs
    assert [s["num_vsw"] for s in got] == list(new)
    assert [(s["rank"], s["world_size"]) for s in got] == [(r, len(new)) for r in range(len(new))]
    assert all(s["iteration"] == 7 and torch.equal(s["velocity"], torch.tensor([0.5])) for s in got)
    # pure: the input states are untouched
    assert [s["num_vsw"] for s in states] == list(old)
    assert [[int(r["flat"].item()) for r in s["replicas"]] for s in states] == \
        [[i for i in range(sum(old[:r]), sum(old[:r + 1]))] for r in range(len(old))]


def test_redistribution_rejects_bad_input():
    with pytest.raises(ValueError, match="states"):
        redistribute_sma_states([], [1])
    with pytest.raises(ValueError, match=r"learners_per_rank\[1\]"):
        redistribute_sma_states(_fake_states((1,)), [1, 0])
    with pytest.raises(ValueError, match="learners_per_rank"):
        redistribute_sma_states(_fake_states((1,)), [])


def test_flat_state_loads_into_hierarchical_worker_with_reference_from_z():
    a = SMAWorker(tiny_model(1), nn.functional.cross_entropy, lr=LR, sma_sync="flat")
    a.configure(2, 0, 4)
    a.train_step(step_batches(0, 2))
    sd = a.state_dict()
    assert sd["ref"] is None and sd["sma_sync"] == "flat"
    b = SMAWorker(tiny_model(2), nn.functional.cross_entropy, lr=LR, sma_sync="hierarchical")
    b.load_state_dict(sd)
    assert torch.equal(b._ref.flat, a._z.flat)
    with pytest.raises(ValueError, match="redistribute_sma_states"):
        b.load_state_dict({**sd, "num_vsw": 1})


# ---------------------------------------------------------------- single device, restart

def test_hierarchical_on_one_device_and_restart():
    """G = 1: alpha_g = 1, so z_{i+1} = r_i + mu (z_i - z_{i-1}); a restart resets the
    reference model too."""
    model = tiny_model(4)
    w = SMAWorker(copy.deepcopy(model), nn.functional.cross_entropy, lr=LR, momentum=MU,
                  weight_decay=WD, sma_sync="hierarchical")
    w.configure(3, 0, 4)
    assert (w.alpha, w.alpha_global) == (pytest.approx(1 / 3), 1.0)
    z, refs, ws, _ = transcription(model, (3,), 3)
    for s in range(3):
        w.train_step(step_batches(s, 3))
    assert_close_lists(params(w.model), z)
    assert_close_lists(params(w.reference_model), refs[0])
    w.set_lr(LR / 2)
    for fm in w._learners + [w._ref]:
        assert torch.equal(fm.flat, w._z.flat)
    assert float(w._velocity.abs().sum()) == 0.0


def test_bad_sma_sync_names_the_field():
    with pytest.raises(ValueError, match="sma_sync"):
        SMAWorker(tiny_model(), nn.functional.cross_entropy, lr=LR, sma_sync="tree")
    with pytest.raises(ValueError, match="sma_sync"):
        JobConfig(sync="sma", sma_sync="tree")
    assert JobConfig(sync="sma", sma_sync="flat").sma_sync == "flat"


# ---------------------------------------------------------------- the critical section

class _FakeWork:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("collective done")
        return True


@pytest.mark.parametrize("sma_sync", ["flat", "hierarchical"])
def test_comm_guard_covers_the_collective_from_launch_to_completion(tmp_path, monkeypatch, sma_sync):
    """CPU: the guard is entered before the all-reduce is launched and left only after the
    work's wait() returned; the real reduction result is what the worker applies."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        log: list[str] = []
        real = dist.all_reduce

        def spy(tensor, group=None, async_op=False, **kw):
            log.append("launch" + (" async" if async_op else ""))
            real(tensor, group=group)
            return _FakeWork(log) if async_op else None

        @contextlib.contextmanager
        def guard(op):
            log.append(f"enter {op}")
            yield
            log.append(f"exit {op}")

        monkeypatch.setattr(dist, "all_reduce", spy)
        w = SMAWorker(tiny_model(5), nn.functional.cross_entropy, lr=LR, sma_sync=sma_sync,
                      process_group=dist.group.WORLD, comm_guard=guard)
        plain = SMAWorker(tiny_model(5), nn.functional.cross_entropy, lr=LR, sma_sync=sma_sync)
        for x in (w, plain):
            x.configure(2, 0, 4)
        log.clear()
        for s in range(2):
            w.train_step(step_batches(s, 2))
            plain.train_step(step_batches(s, 2))
        assert log == ["enter allreduce", "launch async", "collective done", "exit allreduce"] * 2
        assert torch.equal(w._z.flat, plain._z.flat)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_cuda_comm_guard_is_left_only_after_the_collective_executed(tmp_path):
    """NCCL: at the guard's exit the sync stream has nothing pending (the all-reduce ran),
    and the worker equals the CPU arithmetic."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        seen: list[bool] = []
        holder: dict = {}

        @contextlib.contextmanager
        def guard(op):
            yield
            seen.append(holder["w"]._lanes.comm.query())

        for sma_sync in ("flat", "hierarchical"):
            seen.clear()
            w = SMAWorker(tiny_model(6), nn.functional.cross_entropy, lr=LR, device="cuda",
                          process_group=dist.group.WORLD, comm_guard=guard, sma_sync=sma_sync)
            holder["w"] = w
            cpu = SMAWorker(tiny_model(6), nn.functional.cross_entropy, lr=LR, sma_sync=sma_sync)
            for x in (w, cpu):
                x.configure(2, 0, 4)
            for s in range(3):
                b = step_batches(s, 2)
                w.train_step([(x.cuda(), y.cuda()) for x, y in b])
                cpu.train_step(b)
            assert seen == [True] * 3
            torch.testing.assert_close(w.model.state_dict()["0.weight"].cpu(),
                                       cpu.model.state_dict()["0.weight"], atol=1e-5, rtol=1e-4)
    finally:
        dist.destroy_process_group()
