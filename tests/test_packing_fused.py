"""The fused optimizer updates of a pack against ``torch.optim`` itself, as torch tests its own
optimizers: ONE table of cases (optimizer, several members' hyperparameters in one fused run),
random gradients, parameters AND optimizer state compared after every phase -- including a
member leaving and re-joining with its state (the slot table read back and written out)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from jabasray.engine.packing import pack
from jabasray.engine.packing.state import SLOT_KEYS

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]

SGD, Adam, Adagrad = torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad

#: (fused kind, optimizer class, per-member hyperparameters run as ONE fused update)
CASES = [
    ("sgd", SGD, [dict(lr=0.1), dict(lr=0.05, weight_decay=0.01), dict(lr=0.2)]),
    ("sgd_momentum", SGD, [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.5, dampening=0.1,
                                                          weight_decay=1e-2), dict(lr=0.02, momentum=0.7)]),
    ("sgd_nesterov", SGD, [dict(lr=0.1, momentum=0.9, nesterov=True),
                           dict(lr=0.02, momentum=0.8, nesterov=True, weight_decay=1e-3)]),
    ("adam", Adam, [dict(lr=1e-2), dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2),
                    dict(lr=3e-2, betas=(0.5, 0.9))]),
    ("adagrad", Adagrad, [dict(lr=0.1), dict(lr=0.05, lr_decay=0.01, weight_decay=1e-3,
                                             initial_accumulator_value=0.1)]),
]


def _loss(out, y):
    """A loss whose gradient is a random direction: d/dout = y."""
    return (out * y).sum()


def _members(cls, hps):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)) for _ in hps]
    opts = [cls(m.parameters(), **hp) for m, hp in zip(models, hps)]
    refs = [copy.deepcopy(m) for m in models]
    ref_opts = [cls(r.parameters(), **hp) for r, hp in zip(refs, hps)]
    return models, opts, refs, ref_opts


def _ref_step(refs, ref_opts, x, y):
    for r, o in zip(refs, ref_opts):
        o.zero_grad()
        _loss(r(x), y).backward()
        o.step()


def _assert_same(models, opts, refs, ref_opts):
    for m, o, r, ro in zip(models, opts, refs, ref_opts):
        for a, b in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(a, b)
        sa, sb = o.state_dict()["state"], ro.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            assert sa[i].keys() == sb[i].keys()
            for key in sa[i]:
                torch.testing.assert_close(torch.as_tensor(sa[i][key]).double(),
                                           torch.as_tensor(sb[i][key]).double(), msg=f"{key}")


@pytest.mark.parametrize("kind,cls,hps", CASES, ids=[c[0] for c in CASES])
def test_fused_update_matches_torch_optim(kind, cls, hps):
    models, opts, refs, ref_opts = _members(cls, hps)
    packed = pack(models, opts, [4] * len(models), loss_fn=_loss)
    assert [g[2] for g in packed.groups()] == [kind]             # ONE fused run of this kind
    gen = torch.Generator().manual_seed(1)

    def step():
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
        packed.train_step(x, y)
        _ref_step(refs, ref_opts, x, y)

    for _ in range(3):
        step()
    packed.sync()                                                # flush: SLOT_KEYS -> optimizer.state
    _assert_same(models, opts, refs, ref_opts)
    # member 0 leaves and re-joins with its state (read back through the same table)
    m0, o0 = packed.free(packed.member_ids[0])
    packed.load(m0, o0, 4)
    for _ in range(2):
        step()
    packed.sync()
    _assert_same(models, opts, refs, ref_opts)


def test_slot_table_covers_every_fused_kind():
    assert {c[0] for c in CASES} == set(SLOT_KEYS)
