"""Burst-parallel execution (engine/burst.py) on 4 gloo processes against references.

* Every scenario runs 3 iterations of a burst plan on 4 ranks, then a short last one of 3
  samples, and compares the weights (the executor's collected ``state_dict``, on every rank)
  with plain single-process SGD steps on the same batches: a VGG-like chain whose layers use 1-4 GPUs (also counts of 3,
  with a global batch of 10 that does not split evenly), residual blocks (one with its conv
  lane on its own GPUs), and Inception-like branches (three lanes on three single GPUs; one
  lane on its own two GPUs).
* A plan with every layer on the 4 ranks equals torch DDP on the same shards, BatchNorm included.
* Exactly once: in every iteration, over the 4 ranks the rows of inputs read and of targets
  read each partition the iteration's samples.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
STEPS = 3


def _models():
    spec = importlib.util.spec_from_file_location("burst_models", ROOT / "benchmarks" / "burst_models.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("burst_models", mod)
    spec.loader.exec_module(mod)
    return mod


def make_plan(model, counts, parallel=None, total=WORLD):
    """A BurstPlan with the given per-layer counts and lane choices (validated by the
    planner's own evaluation: counts within the lane caps)."""
    from jabasray.engine.layer_trace import layer_structure, trace_module
    from jabasray.planners.burst import (BlockPlan, BurstPlan, BurstProblem, LayerGraph, LayerSpec,
                                         NetworkModel, evaluate_assignment)
    structure = layer_structure(trace_module(model, torch.randn(2, 3, 8, 8)))
    graph = LayerGraph([LayerSpec(n, {g: 1.0 for g in range(1, total + 1)}, 1.0, 0.0, i)
                        for n, i, _ in structure])
    prob = BurstProblem(graph, NetworkModel(1.0), total, 1e9, powers_of_two=False)
    parallel = parallel or {}
    ev = evaluate_assignment(prob, counts, parallel, enforce_limit=False)
    assert ev.feasible, ev.reason
    blocks = []
    for s, t, lanes in prob.blocks():
        flags = list(parallel.get((s, t), [False] * len(lanes)))
        cap = prob.split_cap(total, sum(flags) + 1) if any(flags) else total
        blocks.append(BlockPlan(s, t, lanes, flags, cap))
    return BurstPlan(ev.iteration_time, 0.0, total, 1e9, prob.counts, ev.layers, blocks)


def _chain_counts(names):
    pattern = [4, 4, 2, 3, 1, 1, 4, 4, 2, 2, 3, 4, 4, 1, 2, 4]
    return dict(zip(names, pattern))


def scenarios():
    """name -> (model factory, plan factory, global batch)."""
    bm = _models()

    def names(model):
        from jabasray.engine.burst import layer_names
        return layer_names(model, torch.randn(2, 3, 8, 8))

    def chain_plan(model):
        return make_plan(model, _chain_counts(names(model)))

    def residual_plan(model):
        counts = dict(x=2, stem=4, relu=4, blocks_0_conv1=2, relu_1=1, blocks_0_conv2=2, add=4,
                      relu_2=4, blocks_1_conv1=4, relu_3=3, blocks_1_conv2=4, add_1=2, relu_4=2,
                      max_pool2d=1, flatten=1, fc=4)
        return make_plan(model, counts, {("relu", "add"): [False, True]})

    def branches_on_singles(model):
        counts = {n: 1 for n in names(model)}
        counts.update(x=4, stem=4, relu=4, cat=2, max_pool2d=4, flatten=4, fc=3)
        return make_plan(model, counts, {("relu", "cat"): [False, True, True]})

    def branch_on_pair(model):
        counts = {n: 2 for n in names(model)}
        counts.update(x=1, stem=4, relu=4, b1=1, relu_1=2, avg_pool2d=1, cat=4, fc=4)
        return make_plan(model, counts, {("relu", "cat"): [True, False, False]})

    return {
        "chain": (lambda: bm.ChainCNN(), chain_plan, 10),
        "residual": (lambda: bm.ResidualNet(), residual_plan, 12),
        "branches_on_singles": (lambda: bm.BranchNet(), branches_on_singles, 10),
        "branch_on_pair": (lambda: bm.BranchNet(), branch_on_pair, 8),
    }


def make_data(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def _init(rank, init_file):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)      # as the float64 fixture in the test process
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)


def _worker(rank, init_file, out_dir):
    """All multi-process scenarios in one spawn (process start-up dominates on 2 cores)."""
    _init(rank, init_file)
    try:
        _burst_scenarios(rank, out_dir)
        _dp_scenario(rank, out_dir)
        _background_scenario(rank, out_dir)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("burst_exec")
    mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True)
    return out


def _burst_scenarios(rank, out_dir):
    from jabasray.engine.burst import BurstExecutor
    results = {}
    for name, (build, plan_of, batch) in scenarios().items():
        torch.manual_seed(0)
        model = build()
        ex = BurstExecutor(model, plan_of(model), torch.randn(2, 3, 8, 8), batch, F.cross_entropy,
                           make_optimizer(model.parameters()))
        losses, rows = [], []
        for step, n in enumerate(batches(batch)):
            X, y = make_data(100 + step, n)
            (a, b), (c, d) = ex.shards(batch=n)
            rows.append(((a, b), (c, d)))
            st = ex.train_step(X[a:b] if b > a else None, y[c:d] if d > c else None, batch=n)
            losses.append(st.loss)
        results[name] = (ex.state_dict(), losses, rows)
    torch.save(results, os.path.join(out_dir, f"burst{rank}.pt"))


def batches(batch):
    """STEPS full iterations, then a short last one of 3 samples (an epoch's remainder: fewer
    samples than some layers have ranks, so some placed ranks get no rows)."""
    return [batch] * STEPS + [3]


def _reference(build, batch):
    torch.manual_seed(0)
    model = build()
    opt = make_optimizer(model.parameters())
    losses = []
    for step, n in enumerate(batches(batch)):
        X, y = make_data(100 + step, n)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model.state_dict(), losses


def test_burst_plans_equal_single_process_steps_on_the_global_batch(runs):
    got = [torch.load(runs / f"burst{r}.pt") for r in range(WORLD)]
    for name, (build, _, batch) in scenarios().items():
        ref_state, ref_losses = _reference(build, batch)
        for r in range(WORLD):
            state, losses, _ = got[r][name]
            assert losses == pytest.approx(ref_losses, rel=1e-10), (name, r)
            assert state.keys() == ref_state.keys()
            for key in ref_state:
                torch.testing.assert_close(state[key], ref_state[key],
                                           msg=lambda m: f"{name} rank {r} {key}: {m}")
        for step, n in enumerate(batches(batch)):
            inputs = [i for r in range(WORLD) for i in range(*got[r][name][2][step][0])]
            targets = [i for r in range(WORLD) for i in range(*got[r][name][2][step][1])]
            assert sorted(inputs) == list(range(n)), (name, step)    # every input read exactly once
            assert sorted(targets) == list(range(n)), (name, step)   # every target read exactly once


def _dp_scenario(rank, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from jabasray.engine.burst import BurstExecutor, layer_names, shard_bounds
    from jabasray.planners.burst import BurstPlan
    bm = _models()
    batch = 12
    torch.manual_seed(0)
    model = bm.ChainCNN(batch_norm=True)
    example = torch.randn(2, 3, 8, 8)
    plan = BurstPlan.uniform(layer_names(model, example), WORLD)
    ex = BurstExecutor(model, plan, example, batch, F.cross_entropy, make_optimizer(model.parameters()))
    torch.manual_seed(0)
    twin = bm.ChainCNN(batch_norm=True)
    ddp = DDP(twin, broadcast_buffers=False)
    opt = make_optimizer(ddp.parameters())
    bounds = shard_bounds(batch, WORLD)
    for step in range(STEPS):
        X, y = make_data(200 + step, batch)
        (a, b), (c, d) = ex.shards()
        assert (a, b) == (c, d) == (bounds[rank], bounds[rank + 1])
        ex.train_step(X[a:b], y[c:d])
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(X[a:b]), y[a:b]).backward()
        opt.step()
    torch.save((model.state_dict(), twin.state_dict()), os.path.join(out_dir, f"dp{rank}.pt"))


def test_all_layers_on_every_rank_equals_data_parallelism(runs):
    for r in range(WORLD):
        burst, ddp = torch.load(runs / f"dp{r}.pt")
        assert burst.keys() == ddp.keys()
        assert any("running_mean" in k for k in burst), "test needs BatchNorm buffers"
        for key in burst:
            torch.testing.assert_close(burst[key], ddp[key],
                                       msg=lambda m: f"rank {r} {key}: {m}")


# --------------------------------------------------------------------------- background hand-off
class RecordingRunner:
    """Stands in for BackgroundRunner: counts holds, records the idle windows it was given."""

    def __init__(self) -> None:
        self.holds = 0
        self.idle_windows = 0
        self.violations = 0

    def pause(self) -> None:
        self.holds += 1

    def resume(self) -> None:
        self.holds -= 1
        if self.holds == 0:
            self.idle_windows += 1


def _background_scenario(rank, out_dir):
    """Every layer's forward runs while the background is held; the background is let go
    while the rank waits, and released after the step."""
    from jabasray.engine.burst import BurstExecutor
    build, plan_of, batch = scenarios()["branches_on_singles"]
    torch.manual_seed(0)
    model = build()
    runner = RecordingRunner()

    def check_held(module, args):
        if runner.holds < 1:
            runner.violations += 1
    ex = BurstExecutor(model, plan_of(model), torch.randn(2, 3, 8, 8), batch, F.cross_entropy,
                       make_optimizer(model.parameters()), background=runner)
    for sub in model.modules():
        sub.register_forward_pre_hook(check_held)
    steps = []
    for step, n in enumerate(batches(batch)):
        X, y = make_data(100 + step, n)
        (a, b), (c, d) = ex.shards(batch=n)
        windows = runner.idle_windows
        st = ex.train_step(X[a:b] if b > a else None, y[c:d] if d > c else None, batch=n)
        steps.append((runner.idle_windows - windows, runner.holds, st.layers_run, st.wait_s))
    torch.save((runner.violations, steps, ex.state_dict()), os.path.join(out_dir, f"bg{rank}.pt"))


def test_background_runs_only_while_a_rank_waits(runs):
    """Rank 3 has no work in the branches (they run on ranks 0-2): it gets idle windows every
    step; no layer ever runs while the background is let go; the weights are unchanged."""
    build, _, batch = scenarios()["branches_on_singles"]
    ref_state, _ = _reference(build, batch)
    for r in range(WORLD):
        violations, steps, state = torch.load(runs / f"bg{r}.pt")
        assert violations == 0, r
        for windows, holds, layers_run, wait_s in steps:
            assert holds == 0 and windows >= 1 and wait_s >= 0.0
        for key in ref_state:
            torch.testing.assert_close(state[key], ref_state[key])
    assert torch.load(runs / "bg3.pt")[1][0][2] < torch.load(runs / "bg0.pt")[1][0][2]
