"""Bucket plans (default size-cap grouping, validation), flat buffers, the weight-sync rule
and the shard optimizer (stepping every shard == one full step, for a table of optimizers)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_reference import make_model
from jabasray.engine import FlatBuffers, ShardOptimizer, choose_weight_sync, default_bucket_plan, validate_bucket_plan
from jabasray.engine.buckets import make_bucket_specs


def _reference_plan(sizes: list[tuple[str, int]], cap: int) -> list[list[str]]:
    """Brute-force statement of the rule: walk backward order; close a bucket once >= cap."""
    plan, cur, tot = [], [], 0
    for name, nbytes in sizes:
        cur.append(name)
        tot += nbytes
        if tot >= cap:
            plan.append(cur)
            cur, tot = [], 0
    return plan + ([cur] if cur else [])


class _Stack(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))


@pytest.mark.parametrize("widths", [[3, 5, 2], [8, 8, 8, 8], [1, 30, 1, 7]])
@pytest.mark.parametrize("cap_bytes", [1, 40, 150, 600, 10 ** 6])
def test_default_plan_is_size_cap_grouping_in_backward_order(widths, cap_bytes):
    model = _Stack(widths)
    plan = default_bucket_plan(model, cap_bytes / 2 ** 20)
    backward = [(n, p.numel() * 4) for n, p in reversed(list(model.named_parameters()))]
    assert plan == _reference_plan(backward, cap_bytes)
    flat = [n for b in plan for n in b]
    assert sorted(flat) == sorted(n for n, _ in model.named_parameters()) and len(set(flat)) == len(flat)


def test_default_plan_never_mixes_dtypes_and_skips_frozen():
    model = _Stack([4, 4, 4])
    model.layers[0].double()
    model.layers[1].bias.requires_grad_(False)
    plan = default_bucket_plan(model, 100.0)
    assert plan == [["layers.1.weight"], ["layers.0.bias", "layers.0.weight"]]
    assert validate_bucket_plan(model, plan) == plan


@pytest.mark.parametrize("plan, message", [
    ([], "bucket_plan must be a non-empty list"),
    ([["fc2.bias"], []], r"bucket_plan\[1\] must be a non-empty list"),
    ([["nope"]], r"bucket_plan\[0\] names 'nope'"),
    ([["fc2.bias", "fc2.bias"]], "bucket_plan repeats parameter 'fc2.bias'"),
    ([["fc2.bias", "fc2.weight"]], r"bucket_plan misses trainable parameter\(s\) \['conv.weight'"),
])
def test_validate_bucket_plan_errors(plan, message):
    with pytest.raises(ValueError, match=message):
        validate_bucket_plan(make_model(0), plan)


def test_flat_buffers_bind_params_and_grads_as_views():
    model = make_model(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = default_bucket_plan(model, 0.0005)
    fb = FlatBuffers(model, make_bucket_specs(model, plan))
    named = dict(model.named_parameters())
    for b, names in enumerate(plan):
        assert fb.params[b].numel() >= sum(named[n].numel() for n in names)
        for n in names:
            assert named[n].data_ptr() % 64 == 0 and named[n].grad.data_ptr() % 64 == 0
            assert torch.equal(named[n], before[n])
            assert named[n].untyped_storage().data_ptr() == fb.params[b].untyped_storage().data_ptr()
            assert named[n].grad.untyped_storage().data_ptr() == fb.grads[b].untyped_storage().data_ptr()
    x = torch.randn(3, 1, 8, 8)
    model(x).sum().backward()
    model(x).sum().backward()          # accumulates in place into the flat buffers
    ref = make_model(0)
    ref(x).sum().backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(named[n].grad, 2 * p.grad)
    names_order = [n for n, _ in model.named_parameters()]
    torch.testing.assert_close(fb.grads_in_param_order(names_order),
                               torch.cat([2 * p.grad.reshape(-1) for p in ref.parameters()]))


@pytest.mark.parametrize("sizes_mb, cap, expected", [
    ([10, 10], 25, "ows"),        # ratio 0.4
    ([12.5, 12.5], 25, "ows"),    # ratio exactly 0.5 is not > R_buffer
    ([13, 13], 25, "sws"),        # 0.52
    ([25, 1], 25, "sws"),         # mean 13 -> 0.52
    ([1], 1, "sws"),
])
def test_choose_weight_sync_rule(sizes_mb, cap, expected):
    assert choose_weight_sync([int(s * 2 ** 20) for s in sizes_mb], cap) == expected


OPTIMIZER_TABLE = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_nesterov_wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "two_groups": lambda p: torch.optim.Adam([{"params": p[:3], "lr": 0.05}, {"params": p[3:]}], lr=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZER_TABLE))
def test_shard_steps_equal_one_full_step(name):
    full_model, shard_model = make_model(0), make_model(0)
    full = OPTIMIZER_TABLE[name](list(full_model.parameters()))
    sharded = OPTIMIZER_TABLE[name](list(shard_model.parameters()))
    params = list(shard_model.parameters())
    shards = [params[4:], params[1:4], params[:1]]
    so = ShardOptimizer(sharded, shards)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for pf, ps in zip(full_model.parameters(), shard_model.parameters()):
            pf.grad = torch.randn(pf.shape, generator=g)
            ps.grad = pf.grad.clone()
        full.step()
        for i in [2, 0, 1]:              # any order of the shards
            so.step_shard(i)
        for pf, ps in zip(full_model.parameters(), shard_model.parameters()):
            assert torch.equal(pf, ps), name
    assert len(sharded.param_groups) == len(full.param_groups)   # groups restored


def test_shard_optimizer_requires_exact_cover():
    model = make_model(0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(ValueError, match="optimizer_fn"):
        ShardOptimizer(opt, [params[:2]])


@pytest.mark.usefixtures("float64")
def test_flat_buffers_zero_per_step_and_take_out_of_place_gradients_whole():
    """begin_step zeroes the buckets (views stay bound, in-place accumulation bumps the bucket's
    version once per parameter); a gradient autograd accumulated out of place (create_graph)
    is the whole gradient and lands in the view at finish."""
    import torch.nn.functional as F
    from engine_reference import make_data, split
    model, ref = make_model(0), make_model(0)
    fb = FlatBuffers(model, make_bucket_specs(model, default_bucket_plan(model, 0.0005)))
    X, y = make_data(0, 6)
    for create_graph in (False, True):
        fb.begin_step()
        assert all(int(g.count_nonzero()) == 0 for g in fb.grads)
        before = [fb.grad_version(b) for b in range(len(fb.grads))]
        for xb, yb in split(X, y, [3, 3]):
            F.cross_entropy(model(xb), yb).backward(create_graph=create_graph)
        if not create_graph:
            assert [fb.grad_version(b) - v for b, v in enumerate(before)] == [2 * len(s.names) for s in fb.specs]
        fb.finish()
        ref.zero_grad(set_to_none=True)
        for xb, yb in split(X, y, [3, 3]):
            F.cross_entropy(ref(xb), yb).backward()
        for b, plist in enumerate(fb.modules_params):
            for p, view, (n, r) in zip(plist, fb.grad_views[b], [(n, dict(ref.named_parameters())[n])
                                                                  for n in fb.specs[b].names]):
                assert p.grad is view
                torch.testing.assert_close(view, r.grad, msg=n)
