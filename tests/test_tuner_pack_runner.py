"""The device-side runner of packed Tune trials (torch only, no Ray): members that come and go
train exactly as each would alone on the same shared-stream batches."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from torch.utils.data import TensorDataset

from jabasray.tuner.digits import digits_data, digits_mlp_spec
from jabasray.tuner.pack_runner import PackRunner, Unpackable, state_from_bytes, state_to_bytes
from jabasray.tuner.training import build_member, cached_data
from tuner_helpers import STREAM, Alone as _Alone

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("float64")]



def digits_data_float64() -> tuple[TensorDataset, TensorDataset]:
    """The digits in float64, for the float64 models the fixture builds."""
    return tuple(TensorDataset(ds.tensors[0].double(), ds.tensors[1]) for ds in digits_data())


SPEC = dataclasses.replace(digits_mlp_spec(steps_per_unit=3), data_fn=digits_data_float64)
A = {"batch_size": 20, "optimizer": "adam", "lr": 1e-2, "activation": "relu"}
B = {"batch_size": 40, "optimizer": "momentum", "lr": 5e-2, "activation": "tanh"}
C = {"batch_size": 30, "optimizer": "sgd", "lr": 1e-1, "activation": "relu"}


def _check(row, ref_loss, ref_metric):
    assert row["train_loss"] == pytest.approx(ref_loss, rel=1e-10)
    assert row["accuracy"] == pytest.approx(ref_metric, abs=1e-9)


def test_members_arriving_and_leaving_train_as_alone():
    """Unit 1: A, B; unit 2: A, B, C (C loads); unit 3: B, C (A freed); unit 4: C alone while
    B is not asking (set aside, untouched); unit 5: B and C again."""
    run = PackRunner(SPEC, STREAM)
    refs = {"a": _Alone(A, SPEC), "b": _Alone(B, SPEC), "c": _Alone(C, SPEC)}
    assert run.load("a", A) == 0 and run.load("b", B) == 0
    plan = [["a", "b"], ["a", "b", "c"], ["b", "c"], ["c"], ["b", "c"]]
    for u, keys in enumerate(plan):
        if u == 1:
            run.load("c", C)
        if u == 2:
            run.free("a")
        pos = run.position
        rows = run.unit(keys)
        assert sorted(rows) == sorted(keys)
        for k in keys:
            _check(rows[k], *refs[k].unit(pos))
        assert run.position == pos + SPEC.steps_per_unit
    assert rows["c"]["pack_size"] == 2 and rows["b"]["units"] == 4 and rows["c"]["units"] == 4
    for k in ("b", "c"):                       # the checkpoint holds the member's own state_dicts
        st = run.state(k)
        ref = refs[k]
        for n, t in ref.model.state_dict().items():
            torch.testing.assert_close(st["model"][n], t)
        assert st["steps"] == 4 * SPEC.steps_per_unit and st["units"] == 4


def test_checkpoint_bytes_resume_the_member_exactly():
    run = PackRunner(SPEC, STREAM)
    run.load("a", A)
    run.load("b", B)
    run.unit(["a", "b"])
    blob = state_to_bytes(run.state("a"))
    pos = run.position
    after = run.unit(["a", "b"])["a"]
    other = PackRunner(SPEC, STREAM)               # a fresh device picks the trial up
    other.position = pos
    assert other.load("a", A, state_from_bytes(blob)) == 1
    again = other.unit(["a"])["a"]
    assert again["units"] == after["units"] == 2
    assert again["train_loss"] == pytest.approx(after["train_loss"], rel=1e-10)
    assert again["accuracy"] == pytest.approx(after["accuracy"], abs=1e-9)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


@pytest.mark.parametrize("kind", ["adam", "momentum", "sgd"])
def test_member_checkpoint_holds_only_its_own_tensors(kind):
    """A member's checkpoint is the same size in a pack of 4 as alone (it once saved the
    pack's whole stacked storage: size growing with K), every saved tensor owns exactly its
    own bytes, the state equals the member trained alone, and reading it restacks nothing."""
    cfgs = [{**A, "optimizer": kind, "lr": lr} for lr in (1e-2, 2e-2, 3e-2, 4e-2)]
    sizes, states = [], []
    for k in (1, 4):
        run = PackRunner(SPEC, STREAM)
        for i in range(k):
            run.load(f"m{i}", cfgs[i])
        run.unit([f"m{i}" for i in range(k)])
        run.unit([f"m{i}" for i in range(k)])
        flat = run.pack._groups[0].flat
        builds = []
        build = run.pack._build
        run.pack._build = lambda: (builds.append(1), build())[1]
        blob = state_to_bytes(run.state("m0"))
        st = state_from_bytes(blob)
        for t in _tensors(st):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert builds == [] and run.pack._groups[0].flat is flat          # no restack
        sizes.append(len(blob))
        states.append(st)
        run.unit([f"m{i}" for i in range(k)])                              # the pack goes on
    assert abs(sizes[1] - sizes[0]) <= 0.01 * sizes[0]
    ref = _Alone(cfgs[0], SPEC)
    ref.unit(0)
    ref.unit(SPEC.steps_per_unit)
    for st in states:
        for n, t in ref.model.state_dict().items():
            torch.testing.assert_close(st["model"][n], t)
        ref_opt = ref.opt.state_dict()
        for i, pst in ref_opt["state"].items():
            for key, v in pst.items():
                torch.testing.assert_close(st["optimizer"]["state"][i][key], v)
        assert st["optimizer"]["param_groups"] == ref_opt["param_groups"]


class _Exploding(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def forward(self, x):
        raise RuntimeError("boom: this configuration's forward fails")


def _model(config):
    return _Exploding() if config.get("explode") else digits_mlp_spec().model_fn(config)


def _metric(model, val):
    if isinstance(model, nn.Module) and getattr(model, "bad_metric", False):
        raise ValueError("metric failed")
    return SPEC.metric_fn(model, val)


def test_a_failing_member_fails_alone():
    spec = dataclasses.replace(SPEC, model_fn=_model)
    run = PackRunner(spec, STREAM)
    ref = _Alone(A, spec)
    run.load("ok", A)
    run.load("bad", {**B, "explode": True})
    pos = run.position
    rows = run.unit(["ok", "bad"])
    assert isinstance(rows["bad"], RuntimeError) and "boom" in str(rows["bad"])
    _check(rows["ok"], *ref.unit(pos))            # the other member trained its unit normally
    assert sorted(run.members) == ["ok"]
    pos = run.position
    _check(run.unit(["ok"])["ok"], *ref.unit(pos))


def test_a_failing_metric_fails_only_its_member():
    spec = dataclasses.replace(SPEC, metric_fn=_metric)
    run = PackRunner(spec, STREAM)
    run.load("ok", A)
    run.load("bad", B)
    run.members["bad"].model.bad_metric = True
    rows = run.unit(["ok", "bad"])
    assert isinstance(rows["bad"], ValueError) and isinstance(rows["ok"], dict)
    assert sorted(run.members) == ["ok"]


def _bn_model(config):
    return nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))


def test_unpackable_model_is_refused_with_its_reason():
    run = PackRunner(dataclasses.replace(SPEC, model_fn=_bn_model), STREAM)
    with pytest.raises(Unpackable, match="BatchNorm"):
        run.load("x", A)
    assert len(run) == 0


def test_unknown_or_duplicate_members_are_value_errors():
    run = PackRunner(SPEC, STREAM)
    run.load("a", A)
    with pytest.raises(ValueError, match="already loaded"):
        run.load("a", A)
    with pytest.raises(ValueError, match=r"members \['zz'\] are not loaded"):
        run.unit(["zz"])


def test_joins_and_leaves_of_a_unit_boundary_restack_once_and_stay_exact():
    """Unit 1: a, b, c. Then a and b leave and d, e join: ONE restack at unit 2's boundary;
    unit 3 with the same members: none. Every member equals its configuration trained alone."""
    D = {**A, "lr": 3e-3}
    E = {**B, "lr": 1e-2}
    run = PackRunner(SPEC, STREAM)
    refs = {k: _Alone(c, SPEC) for k, c in zip("abcde", (A, B, C, D, E))}
    for k, c in zip("abc", (A, B, C)):
        run.load(k, c)
    pos = run.position
    rows = run.unit(["a", "b", "c"])
    for k in "abc":
        _check(rows[k], *refs[k].unit(pos))
    run.free("a")
    run.free("b")
    run.load("d", D)
    run.load("e", E)
    builds = []
    build = run.pack._build
    run.pack._build = lambda: (builds.append(1), build())[1]
    for u in (2, 3):
        pos = run.position
        rows = run.unit(["c", "d", "e"])
        assert len(builds) == 1                            # unit 2: one restack; unit 3: none
        for k in "cde":
            _check(rows[k], *refs[k].unit(pos))
        assert rows["c"]["pack_size"] == 3


def test_the_spec_s_cuda_graphs_reaches_the_pack_and_graphed_units_stay_exact(monkeypatch):
    """``TrainingSpec.cuda_graphs`` is the packed model's mode; with a stand-in capture
    backend (tests/test_packing_graphs.py) the later units' steps are graph replays and every
    member still equals its configuration trained alone."""
    from test_packing_graphs import _fake_cuda
    with pytest.raises(ValueError, match="cuda_graphs must be one of 'auto', 'off', got 'yes'"):
        dataclasses.replace(SPEC, cuda_graphs="yes")
    off = PackRunner(dataclasses.replace(SPEC, cuda_graphs="off"), STREAM)
    off.load("a", A)
    off.unit(["a"])
    assert off.pack.cuda_graphs == "off"
    _fake_cuda(monkeypatch)
    run = PackRunner(SPEC, STREAM)
    refs = {"a": _Alone(A, SPEC), "b": _Alone(B, SPEC)}
    run.load("a", A)
    run.load("b", B)
    graphed = []
    for _ in range(3):
        pos = run.position
        rows = run.unit(["a", "b"])
        graphed.append(run.pack.last_step_graphed)
        for k in ("a", "b"):
            _check(rows[k], *refs[k].unit(pos))
    assert run.pack.cuda_graphs == "auto" and graphed == [False, True, True]
