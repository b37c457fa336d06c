"""The fused optimizer update of a pack's runs: hyper-parameters as cached device columns
(refilled in place when a value changes), Adam's/Adagrad's step-dependent factors from a device
step counter, and the host bookkeeping of a step kept apart from its device work, so that the
update runs without host syncs and can be captured in a CUDA graph (:mod:`.graphed`)."""
from __future__ import annotations

import itertools

import torch

from jabasray.engine.packing.fused import adagrad_step, adam_step, sgd_step
from jabasray.engine.packing.state import STEP_COUNTED, _Group, _Run

__all__ = ["member_hps", "step_run", "advance_run", "columns", "plain"]

_COLUMN_GENERATION = itertools.count(1)   # a run's columns are new tensors: a new generation


def member_hps(g: _Group, run: _Run) -> list[dict]:
    """The ``param_groups[0]`` of the run's members (live: schedulers write them)."""
    return [m.optimizer.param_groups[0] for m in g.members[run.lo:run.hi]]


def step_run(g: _Group, run: _Run) -> None:
    """One fused update of the run's rows (device work only; :func:`advance_run` does the
    host bookkeeping). Hyper-parameters come from each member's ``param_groups`` (LR
    schedulers keep working) but live on the device as cached ``[K_g, 1]`` columns
    (:func:`columns`), and Adam's/Adagrad's step-dependent factors are computed on the
    device from a device step counter -- as torch's ``capturable`` optimizers do --, so a
    steady-state step copies nothing from the host (no host sync) and can be captured."""
    members = g.members[run.lo:run.hi]
    hp = member_hps(g, run)
    p, grad = g.flat.data[run.lo:run.hi], g.gflat[run.lo:run.hi]
    if run.kind == "generic":
        for k, m in zip(range(run.lo, run.hi), members):
            named = dict(m.model.named_parameters())
            for n in g.names:
                named[n].grad = g.param_view(k, n, g.gflat)
            m.optimizer.step()
        return
    c = columns(run, hp, p)
    wd = c.get("wd")
    if run.kind.startswith("sgd"):
        path = _sgd_path(run, hp)
        if path != "plain" and "buf" not in run.state:   # momentum switched on mid-pack
            run.state["buf"] = torch.zeros_like(p)
        if path == "mixed":
            _sgd_mixed(run, p, grad, hp, c)
        elif path == "fused":
            sgd_step(p, grad, run.state["buf"], run.has_buf, c["lr"], c["momentum"],
                      c["one_minus_dampening"], wd, bool(hp[0]["nesterov"]))
        else:
            sgd_step(p, grad, None, False, c["lr"], None, None, wd, False)
    elif run.kind == "adam":
        run.t.add_(1)
        # torch's _single_tensor_adam computes these in Python doubles; here in float64 on
        # the device, rounded to the parameters' dtype as a Python scalar argument would be
        step_size = (c["lr64"] / (1 - torch.pow(c["b1_64"], run.t))).to(p.dtype)
        bc2_sqrt = (1 - torch.pow(c["b2_64"], run.t)).sqrt_().to(p.dtype)
        adam_step(p, grad, run.state["m"], run.state["v"], c["one_minus_b1"], c["b2"],
                   c["one_minus_b2"], step_size, bc2_sqrt, c["eps"], wd)
    elif run.kind == "adagrad":
        run.t.add_(1)
        clr = (c["lr64"] / (1 + (run.t - 1) * c["lr_decay64"])).to(p.dtype)
        adagrad_step(p, grad, run.state["sum"], clr, c["eps"], wd)


def columns(run: _Run, hp: list[dict], p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The run's hyper-parameters as device columns, built when they change (one
    host -> device copy then, none in steady state). Reading ``param_groups`` is Python
    only (see :func:`plain` for tensor hyper-parameters). When the same columns exist
    already, their tensors are refilled IN PLACE (a captured step reads the new values);
    only a new set of columns makes new tensors (a new ``run.cols_gen``). On CUDA a
    refill is a non-blocking copy from pinned memory (stream-ordered before the step that
    reads it; the caching host allocator keeps the pinned block until the copy is done)."""
    names = ("lr", "momentum", "dampening", "nesterov", "weight_decay", "betas", "eps", "lr_decay")
    key = tuple(tuple(plain(h.get(n)) for n in names) for h in hp)
    if key == run.hp_key and (run.t is not None or run.kind not in STEP_COUNTED):
        return run.cols
    dt, dev = p.dtype, p.device

    def col(vals, dtype=dt):               # on the host first: a refill copies it over
        return torch.tensor(list(vals), dtype=dtype).view(-1, 1)

    lr = [plain(h["lr"]) for h in hp]
    c: dict[str, torch.Tensor] = {"lr": col(lr)}
    if any(h["weight_decay"] != 0 for h in hp):
        c["wd"] = col(plain(h["weight_decay"]) for h in hp)
    if run.kind.startswith("sgd"):
        c["momentum"] = col(h["momentum"] for h in hp)
        c["one_minus_dampening"] = col(1 - h["dampening"] for h in hp)
    elif run.kind == "adam":
        b1, b2 = [h["betas"][0] for h in hp], [h["betas"][1] for h in hp]
        c.update(lr64=col(lr, torch.float64), b1_64=col(b1, torch.float64), b2_64=col(b2, torch.float64),
                 one_minus_b1=col(1 - b for b in b1), b2=col(b2), one_minus_b2=col(1 - b for b in b2),
                 eps=col(h["eps"] for h in hp))
    elif run.kind == "adagrad":
        c.update(lr64=col(lr, torch.float64), lr_decay64=col((h["lr_decay"] for h in hp), torch.float64),
                 eps=col(h["eps"] for h in hp))
    if run.kind in STEP_COUNTED and run.t is None:
        run.t = col(run.steps, torch.float64).to(dev)
    old = run.cols
    if old and old.keys() == c.keys() and all(old[n].shape == v.shape and old[n].dtype == v.dtype
                                              for n, v in c.items()):
        cuda = dev.type == "cuda"          # pinned + non-blocking: a refill does not sync
        for n, v in c.items():
            old[n].copy_(v.pin_memory() if cuda else v, non_blocking=cuda)
        c = old
    else:
        c = {n: v.to(dev) for n, v in c.items()}
        run.cols_gen = next(_COLUMN_GENERATION)
    run.hp_key, run.cols = key, c
    return c


def _sgd_mixed(run: _Run, p: torch.Tensor, grad: torch.Tensor, hp: list[dict],
               c: dict[str, torch.Tensor]) -> None:
    """SGD run mixing momentum-0 / Nesterov / heavy-ball members: one row at a time (the
    rows' hyper-parameters are views of the cached device columns)."""
    buf = run.state["buf"]
    flags = run.row_flags()
    for r, h in enumerate(hp):
        wd = c["wd"][r] if h["weight_decay"] != 0 else None
        if h["momentum"] != 0:
            sgd_step(p[r], grad[r], buf[r], flags[r], c["lr"][r], c["momentum"][r],
                      c["one_minus_dampening"][r], wd, bool(h["nesterov"]))
        else:
            sgd_step(p[r], grad[r], None, False, c["lr"][r], None, None, wd, False)


def _sgd_path(run: _Run, hp: list[dict]) -> str:
    """How an SGD run steps: ``"plain"`` (no member uses momentum), ``"fused"`` (one update of
    all rows: every member heavy-ball or every member Nesterov, buffers stacked) or
    ``"mixed"`` (row by row: mixed flavours, or momentum just switched on mid-pack)."""
    moms = [h["momentum"] for h in hp]
    if not any(moms):
        return "plain"
    if not all(moms) or len({bool(h["nesterov"]) for h in hp}) != 1 or "buf" not in run.state:
        return "mixed"
    return "fused"


def advance_run(run: _Run, hp: list[dict]) -> None:
    """The host bookkeeping of one update of ``run`` (after it, eager or replayed): step
    counts (Adam/Adagrad; a host copy for checkpoints, never read by the update) and the
    "momentum buffer exists" flags of SGD (the next update uses the buffers)."""
    if run.kind in STEP_COUNTED:
        run.steps = [s + 1 for s in run.steps]
        return
    if not run.kind.startswith("sgd") or not any(h["momentum"] != 0 for h in hp):
        return
    flags = run.row_flags()                    # every momentum row has its buffer now
    for r, h in enumerate(hp):
        if h["momentum"] != 0:
            flags[r] = True
    run.has_buf = all(flags)
    if run.row_has_buf is not None or not run.has_buf:
        run.row_has_buf = flags


def plain(v):
    """A hyper-parameter as a hashable Python value. A tensor hyper-parameter is read every
    step (a host sync on a GPU): give Python numbers for a sync-free packed step."""
    if isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, (list, tuple)):
        return tuple(plain(x) for x in v)
    return v
