"""Burst execution without a cluster: shard arithmetic against brute force, the plan's rank
placement, and bad input rejected before any training (one line naming the layer and why)."""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from jabasray.engine.burst import BurstExecutor, layer_names, shard_bounds, transfer_pieces
from jabasray.planners.burst import BlockPlan, BurstPlan, LayerPlan
from test_burst_exec import _models, make_optimizer, make_plan

EXAMPLE = torch.randn(4, 3, 8, 8)


def test_shard_bounds_and_pieces_match_per_sample_owners():
    """Every sample moves from the rank that holds it to the rank that needs it, once."""
    for batch, g, h in itertools.product([5, 8, 13], [1, 2, 3, 4], [1, 2, 3, 4]):
        sb, db = shard_bounds(batch, g), shard_bounds(batch, h)
        assert sb[0] == 0 and sb[-1] == batch and max(map(len, [range(a, b) for a, b in zip(sb, sb[1:])])) \
            - min(map(len, [range(a, b) for a, b in zip(sb, sb[1:])])) <= 1
        owner = lambda bounds, first, i: first + next(k for k in range(len(bounds) - 1) if bounds[k] <= i < bounds[k + 1])
        moved = {}
        for src, dst, lo, hi in transfer_pieces((1, g), (0, h), batch):
            for i in range(lo, hi):
                assert i not in moved
                moved[i] = (src, dst)
        assert moved == {i: (owner(sb, 1, i), owner(db, 0, i)) for i in range(batch)}


def test_placement_shifts_parallel_lanes_onto_their_own_ranks():
    """Block with three lanes, two moved (cap 2 of G=8 -> lanes at 0, 2, 4); a nested block
    inside the second moved lane shifts again by its own cap."""
    layers = [LayerPlan(n, g, 0, 0, 0, 0) for n, g in
              [("s", 8), ("a", 2), ("b", 2), ("c", 1), ("d", 1), ("e", 2), ("t", 8)]]
    blocks = [BlockPlan("s", "t", [["a"], ["b", "c", "d", "e"], []], [False, True, False], 2),
              BlockPlan("b", "e", [["c"], ["d"]], [False, True], 1)]
    plan = BurstPlan(0.0, 0.0, 8, 2.0, [1, 2, 4, 8], layers, blocks)
    assert plan.placement() == {"s": (0, 8), "a": (0, 2), "b": (2, 2), "c": (2, 1), "d": (3, 1),
                                "e": (2, 2), "t": (0, 8)}
    too_wide = BurstPlan(0.0, 0.0, 8, 2.0, [1, 2, 4, 8], [LayerPlan("s", 8, 0, 0, 0, 0),
                                                          LayerPlan("a", 8, 0, 0, 0, 0)], blocks[:1])
    too_wide.blocks[0].lanes = [[], ["a"]]
    too_wide.blocks[0].parallel = [False, True]
    with pytest.raises(ValueError, match="layer 'a' on ranks 2..9, beyond total_gpus=8"):
        too_wide.placement()


@pytest.fixture
def solo(tmp_path):
    """A one-process gloo group (the checks run before any communication)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class ViewNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(x.view(x.size(0), -1))


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 10)

    def forward(self, x):
        y = self.fc(torch.flatten(x, 1))
        return y, y * 2


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 3 * 8 * 8)
        self.out = nn.Linear(3 * 8 * 8, 10)

    def forward(self, x):
        x = torch.flatten(x, 1)
        return self.out(self.fc(torch.relu(self.fc(x))))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 10)

    def forward(self, x):
        if x.sum() > 0:                      # data-dependent control flow
            x = x * 2
        return self.fc(torch.flatten(x, 1))


def _example():
    """EXAMPLE in the default dtype (float64 under the ``float64`` fixture)."""
    return EXAMPLE.to(torch.get_default_dtype())


def _uniform(model, gpus=1):
    return BurstPlan.uniform(layer_names(model, _example()), gpus)


def _build(model, plan, batch=4):
    return BurstExecutor(model, plan, _example(), batch, F.cross_entropy, make_optimizer(model.parameters()))


@pytest.mark.parametrize("make,match", [
    (lambda: (ViewNet(), None), r"^layer size \(size\): output is a int for a batch of 4; burst"),
    (lambda: (TwoOutputs(), None), r"^layer output: the model returns several tensors"),
    (lambda: (Shared(), None), r"^layer fc_1: shares a parameter with layer fc;"),
    (lambda: (Untraceable(), None), r"^module cannot be traced with torch\.fx"),
])
def test_models_the_executor_cannot_run_fail_with_one_line(solo, make, match):
    model, _ = make()
    with pytest.raises(ValueError, match=match) as err:
        _build(model, _uniform(model))
    assert "\n" not in str(err.value)


def test_plan_for_a_different_model_fails_naming_the_layer(solo):
    bm = _models()
    chain, residual = bm.ChainCNN(), bm.ResidualNet()
    with pytest.raises(ValueError, match=r"^plan is for a different model: layer 'stem' of the model is not in the plan"):
        _build(residual, _uniform(chain))
    with pytest.raises(ValueError, match=r"plan.total_gpus must equal the process group size 1, got 2"):
        _build(chain, make_plan(chain, {n: 1 for n in layer_names(chain, EXAMPLE)}, total=2))
    big = BurstPlan.uniform(layer_names(chain, EXAMPLE), 1)
    with pytest.raises(ValueError, match=r"^inputs must hold rows 0..4"):
        _build(chain, big).train_step(None, torch.zeros(4, dtype=torch.long))


@pytest.mark.exactness
@pytest.mark.usefixtures("float64")
def test_one_rank_plan_is_a_plain_step(solo):
    """G = 1: the executor's step equals a plain step (no communication at all)."""
    bm = _models()
    torch.manual_seed(0)
    model = bm.BranchNet()
    torch.manual_seed(0)
    ref = bm.BranchNet()
    opt = make_optimizer(ref.parameters())
    ex = _build(model, _uniform(model), batch=6)
    X, y = torch.randn(6, 3, 8, 8), torch.randint(0, 10, (6,))
    st = ex.train_step(X, y)
    loss = F.cross_entropy(ref(X), y)
    loss.backward()
    opt.step()
    assert st.loss == pytest.approx(float(loss.detach()), rel=1e-10)
    for (k, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(a, b, msg=k)
