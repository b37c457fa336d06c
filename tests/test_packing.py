"""The pack primitive trains every member exactly as a plain loop would (Pack paper, 2.2/3.1).

Each test builds K models, deep-copies them as references with an identical optimizer, runs
``PackedModel.train_step`` on shared batches and the plain loop
``opt.zero_grad(); loss_fn(model(x[:b]), y[:b]).backward(); opt.step()`` on the same slices,
and compares losses, weights and optimizer state with ``torch.testing.assert_close``
after several steps, in float64 (the ``float64`` fixture): the packed update and the plain loop
reduce in different orders, and in float32 how far apart that leaves them depends on the CPU's
vector width.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from jabasray.engine.packing import PackedModel, architecture_key, optimizer_kind, pack
from jabasray.models import MLP, DigitsCNN
from packing_helpers import solo_step

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

F = nn.functional

OPTIMIZERS = {
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr),
    "momentum": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
    "nesterov_wd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.8, nesterov=True, weight_decay=1e-2),
    "dampening": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.7, dampening=0.3),
    "adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
    "adam_wd": lambda p, lr: torch.optim.Adam(p, lr=lr, betas=(0.8, 0.95), weight_decay=1e-2, eps=1e-6),
    "adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr, lr_decay=0.01, weight_decay=1e-3,
                                                 initial_accumulator_value=0.1),
    "rmsprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr),       # not fused: own optimizer.step
}


def _clone_opt(opt: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    return type(opt)(model.parameters(), **opt.defaults)


def _reference(models, opts):
    refs = [copy.deepcopy(m) for m in models]
    return refs, [_clone_opt(o, r) for o, r in zip(opts, refs)]


def _plain_step(refs, ref_opts, batch_sizes, x, y, loss_fn=F.cross_entropy):
    return solo_step(refs, ref_opts, batch_sizes, x, y, loss_fn).tolist()


def _assert_same(models, refs):
    for m, r in zip(models, refs):
        for (n, a), (_, b) in zip(m.named_parameters(), r.named_parameters()):
            torch.testing.assert_close(a, b, msg=lambda s, n=n: f"{n}: {s}")


def _assert_same_state(opt, ref_opt):
    sa, sb = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for key in sa[k]:
            torch.testing.assert_close(torch.as_tensor(sa[k][key]).double(),
                                       torch.as_tensor(sb[k][key]).double())


def _batches(n, batch, seed=0, image=False):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        shape = (batch, 1, 8, 8) if image else (batch, 64)
        yield torch.rand(shape, generator=g), torch.randint(0, 10, (batch,), generator=g)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_matches_plain_loop(name):
    torch.manual_seed(0)
    lrs = [0.05, 0.01, 0.002]
    models = [MLP(hidden=(32,)) for _ in lrs]
    opts = [OPTIMIZERS[name](m.parameters(), lr) for m, lr in zip(models, lrs)]
    refs, ref_opts = _reference(models, opts)
    p = pack(models, opts, [16, 16, 16])
    assert len(p.groups()) == 1                    # one batched group for same arch + optimizer
    for step, (x, y) in enumerate(_batches(4, 16)):
        if step == 2:                               # an LR change (e.g. a scheduler) is honoured
            opts[1].param_groups[0]["lr"] *= 0.5
            ref_opts[1].param_groups[0]["lr"] *= 0.5
        losses = p.train_step(x, y)
        expected = _plain_step(refs, ref_opts, [16] * 3, x, y)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
    _assert_same(models, refs)                     # members' modules show the live weights
    freed = p.free_all()
    for (m, o), r, ro in zip(freed, refs, ref_opts):
        _assert_same([m], [r])
        _assert_same_state(o, ro)


def test_mixed_batch_sizes_take_a_prefix_of_the_shared_batch():
    torch.manual_seed(1)
    sizes = [5, 16, 11, 16]
    models = [MLP(hidden=(24,)) for _ in sizes]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    refs, ref_opts = _reference(models, opts)
    p = pack(models, opts, sizes)
    assert p.max_batch_size == 16
    for x, y in _batches(5, 16, seed=3):
        losses = p.train_step(x, y)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(_plain_step(refs, ref_opts, sizes, x, y)))
    _assert_same(models, refs)


def test_mixed_architectures_and_optimizers_side_by_side():
    torch.manual_seed(2)
    models = [MLP(hidden=(32,), act="relu"), MLP(hidden=(32,), act="tanh"), MLP(hidden=(32,), act="relu"),
              DigitsCNN(channels=4, hidden=16), DigitsCNN(channels=4, hidden=16, batch_norm=True),
              MLP(hidden=(16, 16), act="sigmoid")]
    opts = [torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(models[1].parameters(), lr=1e-2),
            torch.optim.SGD(models[2].parameters(), lr=0.05, momentum=0.5),
            torch.optim.Adagrad(models[3].parameters(), lr=0.05),
            torch.optim.Adam(models[4].parameters(), lr=1e-3),
            torch.optim.SGD(models[5].parameters(), lr=0.2)]
    sizes = [12, 8, 12, 10, 6, 3]
    refs, ref_opts = _reference(models, opts)
    p = pack(models, opts, sizes)
    groups = p.groups()
    # same layers, different activation/optimizer -> ONE batched group, ordered by optimizer kind
    assert sorted(sorted(ids) for ids, _, _ in groups) == [[0, 1, 2], [3], [4], [5]]
    assert [(ids, kind) for ids, _, kind in groups if len(ids) == 3] == [([1, 0, 2], "adam+sgd_momentum")]
    assert [b for ids, b, _ in groups if ids == [4]] == [False]     # BatchNorm: unbatched
    for x, y in _batches(4, 12, seed=5, image=True):
        losses = p.train_step(x, y)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(_plain_step(refs, ref_opts, sizes, x, y)))
    _assert_same(models, refs)
    for r, m in zip(refs, models):                 # BatchNorm running stats follow too
        for a, b in zip(m.buffers(), r.buffers()):
            torch.testing.assert_close(a, b)


def test_vmap_execution_matches_plain_loop():
    torch.manual_seed(3)
    models = [DigitsCNN(channels=4, hidden=16) for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(models, [0.1, 0.05, 0.01])]
    refs, ref_opts = _reference(models, opts)
    p = pack(models, opts, [8, 4, 8], execution="vmap")
    for x, y in _batches(3, 8, seed=7, image=True):
        p.train_step(x, y)
        _plain_step(refs, ref_opts, [8, 4, 8], x, y)
    _assert_same(models, refs)
    assert p._groups[0].folded is None


class _BatchCentered(nn.Module):
    """forward depends on the whole batch (x - batch mean): folded execution must be refused."""

    def __init__(self, act: str = "relu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 16)
        self.act = nn.ReLU() if act == "relu" else nn.Tanh()
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc2(h - h.mean(0, keepdim=True))


def test_batch_dependent_forward_falls_back_to_vmap_and_exact_groups():
    torch.manual_seed(4)
    models = [_BatchCentered("relu"), _BatchCentered("tanh"), _BatchCentered("relu")]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    refs, ref_opts = _reference(models, opts)
    p = pack(models, opts, [8, 8, 8])
    for x, y in _batches(3, 8, seed=9):
        losses = p.train_step(x, y)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(_plain_step(refs, ref_opts, [8] * 3, x, y)))
    # the relaxed (activation-mixing) group failed its check: regrouped by exact architecture
    assert sorted(ids for ids, _, _ in p.groups()) == [[0, 2], [1]]
    assert [g.folded is None for g in p._groups if len(g.members) == 2] == [True]
    _assert_same(models, refs)


def test_free_and_load_keep_training_exact():
    """Members with different step counts: free one early, train it on alone, load a new one."""
    torch.manual_seed(5)
    models = [MLP(hidden=(16,)) for _ in range(3)]
    opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(models, [1e-2, 5e-3, 1e-3])]
    refs, ref_opts = _reference(models, opts)
    p = pack(models, opts, [8, 8, 6])
    data = list(_batches(8, 8, seed=11))
    for x, y in data[:2]:
        p.train_step(x, y)
        _plain_step(refs, ref_opts, [8, 8, 6], x, y)
    m1, o1 = p.free(1)
    assert m1 is models[1] and o1 is opts[1] and p.member_ids == [0, 2]
    _assert_same([m1], [refs[1]])
    _assert_same_state(o1, ref_opts[1])
    # the freed member continues alone with its optimizer state, like its reference
    for x, y in data[2:4]:
        _plain_step([m1], [o1], [8], x, y)
        _plain_step([refs[1]], [ref_opts[1]], [8], x, y)
    _assert_same([m1], [refs[1]])
    # a member trained elsewhere (non-empty optimizer state) joins the running pack
    new = MLP(hidden=(16,))
    new_opt = torch.optim.Adam(new.parameters(), lr=2e-3)
    for x, y in data[:1]:
        _plain_step([new], [new_opt], [4], x, y)
    ref_new = copy.deepcopy(new)
    ref_new_opt = _clone_opt(new_opt, ref_new)
    ref_new_opt.load_state_dict(new_opt.state_dict())
    nid = p.load(new, new_opt, 4)
    assert nid == 3 and p.member_ids == [0, 2, 3]
    assert [ids for ids, _, _ in p.groups()] == [[0, 2, 3]]
    for x, y in data[2:6]:
        losses = p.train_step(x, y)
        expected = _plain_step([refs[0], refs[2], ref_new], [ref_opts[0], ref_opts[2], ref_new_opt], [8, 6, 4], x, y)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected))
    _assert_same([models[0], models[2], new], [refs[0], refs[2], ref_new])
    m3, o3 = p.free(nid)
    _assert_same_state(o3, ref_new_opt)


def test_momentum_members_joining_at_different_ages_stay_exact():
    torch.manual_seed(6)
    a, b = MLP(hidden=(8,)), MLP(hidden=(8,))
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    refs, ref_opts = _reference([a, b], [oa, ob])
    data = list(_batches(4, 8, seed=13))
    _plain_step([a], [oa], [8], *data[0])          # a has a momentum buffer, b not yet
    _plain_step([refs[0]], [ref_opts[0]], [8], *data[0])
    p = pack([a, b], [oa, ob], [8, 8])
    for x, y in data[1:]:
        p.train_step(x, y)
        _plain_step(refs, ref_opts, [8, 8], x, y)
    _assert_same([a, b], refs)


def test_classification_helpers():
    assert architecture_key(MLP(act="relu")) == architecture_key(MLP(act="relu"))
    assert architecture_key(MLP(act="relu")) != architecture_key(MLP(act="tanh"))
    m = MLP()
    assert optimizer_kind(torch.optim.Adam(m.parameters(), amsgrad=True), m) == "generic"
    assert optimizer_kind(torch.optim.Adam(m.parameters()), m) == "adam"
    assert optimizer_kind(torch.optim.SGD([{"params": m.net[0].parameters()},
                                           {"params": m.net[2].parameters(), "lr": 0.1}], lr=0.01), m) == "generic"


def test_bad_input_is_one_line_value_error():
    m = MLP()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="same length"):
        pack([m], [o], [4, 4])
    with pytest.raises(ValueError, match=r"batch_sizes\[0\] must be an integer >= 1, got 0"):
        pack([m], [o], [0])
    other = MLP()
    with pytest.raises(ValueError, match="optimizer must be built on the parameters of its model"):
        pack([m], [torch.optim.SGD(other.parameters(), lr=0.1)], [4])
    p = pack([m], [o], [8])
    with pytest.raises(ValueError, match="at least max\\(batch_sizes\\) = 8"):
        p.train_step(torch.zeros(4, 64), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"member must be one of \[0\], got 5"):
        p.free(5)
    with pytest.raises(ValueError, match="execution must be one of"):
        PackedModel(execution="jit")
    p.free(0)
    with pytest.raises(ValueError, match="no members"):
        p.train_step(torch.zeros(8, 64), torch.zeros(8, dtype=torch.long))


def test_sgd_hyperparameters_changed_mid_pack_stay_exact():
    """A member switching its momentum off mid-pack takes the per-member SGD path."""
    torch.manual_seed(7)
    models = [MLP(hidden=(8,)) for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    refs, ref_opts = _reference(models, opts)
    p = pack(models, opts, [8, 8, 8])
    for step, (x, y) in enumerate(_batches(5, 8, seed=17)):
        if step == 2:
            for o in (opts[1], ref_opts[1]):
                o.param_groups[0]["momentum"] = 0.0
            for o in (opts[2], ref_opts[2]):
                o.param_groups[0]["nesterov"] = True
        p.train_step(x, y)
        _plain_step(refs, ref_opts, [8] * 3, x, y)
    _assert_same(models, refs)


def test_sweep_like_members_run_folded_and_match_plain_loop():
    """The digits sweep's mix -- one layer structure, four activations, four optimizers, four
    batch sizes -- runs as ONE folded group (the stacked linear layers, not the vmap fallback
    taken when the folded forward disagrees with the members' modules) and every member
    trains exactly as alone."""
    torch.manual_seed(4)
    acts = ["sigmoid", "relu", "tanh", "leaky_relu"]
    models = [MLP(hidden=(16, 16, 16), act=a) for a in acts]
    opts = [torch.optim.SGD(models[0].parameters(), lr=0.1),
            torch.optim.Adam(models[1].parameters(), lr=1e-2),
            torch.optim.Adagrad(models[2].parameters(), lr=0.05),
            torch.optim.SGD(models[3].parameters(), lr=0.05, momentum=0.9)]
    sizes = [5, 12, 9, 7]
    refs, ref_opts = _reference(models, opts)
    p = pack(models, opts, sizes)
    for x, y in _batches(4, 12, seed=6):
        losses = p.train_step(x, y)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(_plain_step(refs, ref_opts, sizes, x, y)))
    (g,) = p._groups
    assert g.folded is not None and g.checked
    _assert_same(models, refs)
    for (m, o), r, ro in zip(p.free_all(), refs, ref_opts):
        _assert_same([m], [r])
        _assert_same_state(o, ro)
