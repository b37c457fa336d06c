"""What ``train_loop_per_worker`` calls (Ray Train's names): ``prepare_model``,
``prepare_optimizer``, ``prepare_data_loader``, ``epochs``, ``report``, ``get_context``.

Each ``prepare_*`` hands the user's object to the engine of this GPU (:mod:`.bridge`) and
returns what the loop keeps using:

* the prepared model is a thin module around the user's: its parameters, buffers and
  ``state_dict`` are the user's model's (the engine's main virtual stream worker, JABAS/IIDP
  section 4); calling it runs the VSW module of the batch in flight (the main VSW's module
  over all VSWs' micro-batches joined, BatchNorm per VSW, or one replica where batching is not
  exact). Moving it (``.to()``, ``.cuda()``) is refused: the engine's flat buffers hold its
  parameters.
* the prepared optimizer is the user's own optimizer (so schedulers and ``state_dict`` work as
  before); called from the loop, ``step()`` returns True when the engine has applied this
  global iteration's update (after this GPU's last accumulation round and the all-reduce; the
  LR is the user's LR times the batch-size rule's factor, :func:`jabasray.adaptive.lr_factor`,
  the user's scheduler keeps the base LR) and False after an earlier round; ``zero_grad()``
  does nothing (the engine clears its gradient buckets itself).
* the prepared loader yields this GPU's batches of each global iteration in the engine's order
  (the exactly-once sampler, :mod:`jabasray.engine.sampler`): one batch per accumulation round,
  its VSWs' micro-batches joined; B_L and the VSW count change at adaptation intervals without
  the loop noticing. Each batch must be trained on (its loss ``backward()``-ed) before the next.
* an enabled ``torch.amp.GradScaler`` passed to ``epochs(..., scaler=scaler)`` is the engine's
  loss scaler (:func:`attach_scaler`): one scale per global iteration, the inf/NaN check on the
  all-reduced gradient (so every rank skips alike); the loop's own scaler calls mirror it.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from . import bridge


@dataclass(frozen=True)
class LoopContext:
    """Where this worker stands (Ray Train's ``TrainContext`` names where they exist)."""

    world_rank: int = 0          # this GPU's rank in the current placement
    world_size: int = 1          # GPUs of the current placement
    epoch: int = 0               # the epoch being trained
    global_batch: int = 0        # B_G of the current interval (0 before the first)
    local_batch: int = 0         # B_L of the current interval
    num_vsw: int = 0             # this GPU's virtual stream workers
    num_accumulation: int = 0    # this GPU's gradient-accumulation steps per VSW (n_GA)

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:   # one worker per GPU: its rank among this node's is not tracked
        return 0


def get_context() -> LoopContext:
    """This worker's :class:`LoopContext` (rank, world size, epoch, B_G, B_L, VSW count)."""
    run = bridge.user_run("get_context")
    return run.context if run.context is not None else LoopContext()


class PreparedModel(nn.Module):
    """The user's model as the loop sees it after :func:`prepare_model` (module notes)."""

    def __init__(self, run: "bridge.LoopRun", model: nn.Module) -> None:
        super().__init__()
        self.module = model
        object.__setattr__(self, "_run", run)    # not a submodule, not in state_dict

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = self._run
        module = run.current_module if run.in_step and run.current_module is not None else self.module
        return module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:   # the user's keys, no "module." prefix
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("prepare_model: load the model's state before prepare_model, or pass "
                         "the model to epochs(model=...) so that jabasray restores it")

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("prepare_model: the model was moved or cast (.to(), .cuda(), .double()) "
                         "after prepare_model; do it before, jabasray places the prepared model")


def prepare_proxy(run: "bridge.LoopRun", model: nn.Module) -> PreparedModel:
    return PreparedModel(run, model)


def prepare_model(model: nn.Module) -> nn.Module:
    """Hand ``model`` to this GPU's engine (its VSWs, gradient buckets, local-to-global
    aggregation, one-way weight sync); returns the module the loop calls (module notes)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"prepare_model: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, PreparedModel):
        raise ValueError("prepare_model: the model is prepared already")
    return bridge.user_run("prepare_model").request("model", model)


def prepare_optimizer(*optimizers: torch.optim.Optimizer) -> Any:
    """Hand the loop's optimizer (over the prepared model's parameters) to the engine; returns
    it with ``step()``/``zero_grad()`` acting at the global iteration boundary (module notes).
    Several optimizers over disjoint parameters (a body and a head, say) are handed in ONE
    call, ``opt_a, opt_b = prepare_optimizer(opt_a, opt_b)``: together they must hold every
    trainable parameter once; the engine steps them as one (:class:`JointOptimizer`)."""
    if not optimizers:
        raise ValueError("prepare_optimizer: needs at least one torch.optim.Optimizer")
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"prepare_optimizer: argument {i} must be a torch.optim.Optimizer, "
                             f"got {type(opt).__name__}")
    payload = optimizers[0] if len(optimizers) == 1 else tuple(optimizers)
    return bridge.user_run("prepare_optimizer").request("optimizer", payload)


class JointOptimizer(torch.optim.Optimizer):
    """The loop's optimizers over disjoint parameters as the ONE optimizer the engine steps.

    ``param_groups`` are the optimizers' own group dicts (the engine's LR factor and the
    loop's schedulers change the same dicts); ``step()`` steps each optimizer over its groups
    present in ``param_groups`` - all of them, or the parameters of one gradient bucket when
    the engine swaps in a shard's groups (one-way weight sync, :mod:`jabasray.engine.weight_sync`);
    ``state_dict()`` is ``{"optimizers": [each one's state_dict]}``.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("prepare_optimizer: the optimizers share parameters; each trainable "
                             "parameter must belong to exactly one of them")
        super().__init__(params, {})
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self._ids = [frozenset(id(p) for g in o.param_groups for p in g["params"]) for o in self.optimizers]

    def step(self, closure: Any = None) -> None:
        groups = self.param_groups
        for opt, ids in zip(self.optimizers, self._ids):
            mine = [g for g in groups if g["params"] and id(g["params"][0]) in ids]
            if not mine:
                continue
            saved = opt.param_groups
            opt.param_groups = mine
            try:
                type(opt).step(opt)
            finally:
                opt.param_groups = saved

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            type(opt).zero_grad(opt, set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [type(o).state_dict(o) for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        parts = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(parts, list) or len(parts) != len(self.optimizers):
            raise ValueError(f"JointOptimizer.load_state_dict: needs {{'optimizers': [...]}} with "
                             f"{len(self.optimizers)} states")
        for o, sd in zip(self.optimizers, parts):
            type(o).load_state_dict(o, sd)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


def engine_optimizer(run: "bridge.LoopRun", payload: Any) -> torch.optim.Optimizer:
    """(engine side) The optimizer the engine steps for what the loop handed to
    ``prepare_optimizer`` (one optimizer, or a :class:`JointOptimizer` of several), each given
    its loop-side ``step``/``zero_grad`` (:func:`attach_optimizer`)."""
    subs = list(payload) if isinstance(payload, tuple) else [payload]
    joint = subs[0] if len(subs) == 1 else JointOptimizer(subs)
    check_params(run, joint)
    for opt in subs:
        attach_optimizer(run, opt)
    return joint


def check_params(run: "bridge.LoopRun", opt: torch.optim.Optimizer) -> None:
    if run.model is None:
        raise ValueError("prepare_optimizer: call prepare_model first (the optimizer must hold "
                         "the prepared model's parameters)")
    mine = {id(p) for p in run.model.parameters() if p.requires_grad}
    theirs = [p for g in opt.param_groups for p in g["params"]]
    if {id(p) for p in theirs} != mine or len(theirs) != len(mine):
        raise ValueError("prepare_optimizer: the optimizer(s) must hold exactly the trainable "
                         "parameters of the prepared model (build them from model.parameters() "
                         "after prepare_model)")


def attach_optimizer(run: "bridge.LoopRun", opt: torch.optim.Optimizer) -> None:
    """(engine side) Give ``opt`` loop-side ``step``/``zero_grad`` (module notes); the
    engine's own calls reach the optimizer's class methods."""
    cls_step, cls_zero = type(opt).step, type(opt).zero_grad
    in_loop = run.in_loop

    def step(self: Any, closure: Any = None) -> Any:
        if in_loop():
            if closure is not None:
                raise ValueError("optimizer.step(closure): closures are not supported in the loop")
            return run.update_done
        return cls_step(self, closure)

    def zero_grad(self: Any, set_to_none: bool = True) -> None:
        if in_loop():
            return None
        return cls_zero(self, set_to_none)

    # bound methods: LR schedulers wrap ``optimizer.step`` through its ``__func__``
    opt.step, opt.zero_grad = types.MethodType(step, opt), types.MethodType(zero_grad, opt)


def attach_scaler(run: "bridge.LoopRun", scaler: torch.amp.GradScaler) -> None:
    """(engine side) The loop's enabled GradScaler is the engine's
    (:meth:`~jabasray.engine.iidp.IIDPWorker.set_grad_scaler`): the engine scales every
    micro-batch's loss by its scale (one scale per global iteration), unscales the
    all-reduced gradient, skips the update on inf/NaN - on every rank alike, since the
    all-reduced gradient is every rank's - and updates the scale, at the iteration's boundary.
    The loop's calls, which come after that, only mirror it: ``scale(loss)`` returns ``loss``
    (the engine scales it), ``unscale_`` and ``update()`` do nothing, ``step(opt)`` returns
    ``opt.step()`` (True at the boundary, skipped or not); ``get_scale()``, ``state_dict()``
    are the scaler's own. The engine's own calls reach the class's methods."""
    cls = type(scaler)
    in_loop = run.in_loop

    def scale(self: Any, outputs: Any) -> Any:
        return outputs if in_loop() else cls.scale(self, outputs)

    def unscale_(self: Any, optimizer: Any) -> None:
        return None if in_loop() else cls.unscale_(self, optimizer)

    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step() if in_loop() else cls.step(self, optimizer, *args, **kwargs)

    def update(self: Any, new_scale: Any = None) -> None:
        if not in_loop():
            return cls.update(self, new_scale)
        if new_scale is not None:
            raise ValueError("GradScaler.update(new_scale): jabasray updates the scale at the "
                             "global iteration's boundary; new_scale is not supported in the loop")
        return None

    for name, fn in (("scale", scale), ("unscale_", unscale_), ("step", step), ("update", update)):
        setattr(scaler, name, types.MethodType(fn, scaler))


class PreparedLoader:
    """The loop's view of the job's data (module notes). ``dataset`` is the user's."""

    def __init__(self, run: "bridge.LoopRun", source: Any) -> None:
        self._run = run
        self.dataset = getattr(source, "dataset", source)
        self.sampler = _EngineSampler()


    def __iter__(self) -> Iterator[Any]:
        run = self._run
        while True:
            batch = run.request("batch")
            if batch is bridge.STOP:
                return
            bridge.enter_engine_context(run)    # the engine's autocast / CUDA stream
            yield batch

    def __len__(self) -> int:
        """Iterations of this epoch at the current global batch (it moves between intervals)."""
        ctx = self._run.context
        if ctx is None or not ctx.global_batch:
            raise TypeError("the prepared loader's length is known once training has started")
        return math.ceil(len(self.dataset) / ctx.global_batch) * (ctx.num_accumulation + 1)


class _EngineSampler:
    """Stands for a DistributedSampler: the engine's sampler orders each epoch already."""

    def set_epoch(self, epoch: int) -> None:
        pass


def prepare_data_loader(data_loader: Any, eval: bool = False) -> Any:
    """Hand the loop's training data to the engine: a ``torch.utils.data.DataLoader`` (its
    dataset is read; its batch size, sampler and shuffling are the engine's now; its
    ``collate_fn`` batches the samples, as the hooks API's ``collate_fn``: each rank's
    micro-batches of an iteration are collated as one batch, split per micro-batch and each
    round's joined, so the batch must be tensors or lists/tuples/dicts of them with samples
    along dim 0) or a map-style dataset. Returns the loader the loop iterates (module notes).

    ``eval=True``: a validation loader instead, which the engine does not touch: each rank
    iterates its contiguous shard ``[r N / W, (r + 1) N / W)`` of the dataset in order, in
    batches of the DataLoader's ``batch_size`` (as the hooks API shards its evaluation), so
    ``report`` of per-rank means gives the mean over the set."""
    ds = getattr(data_loader, "dataset", data_loader)
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise ValueError(f"prepare_data_loader: needs a DataLoader over a map-style dataset (with "
                         f"__len__ and __getitem__) or such a dataset, got {type(ds).__name__}")
    if not isinstance(eval, bool):
        raise ValueError(f"prepare_data_loader: eval must be True or False, got {eval!r}")
    if eval:
        return EvalLoader(bridge.user_run("prepare_data_loader"), data_loader)
    return bridge.user_run("prepare_data_loader").request("loader", data_loader)


def shard(n: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous shard of ``n`` samples over ``world`` ranks."""
    return range(rank * n // world, (rank + 1) * n // world)


class EvalLoader:
    """A validation loader over this rank's shard (:func:`prepare_data_loader` with eval=True)."""

    def __init__(self, run: "bridge.LoopRun", source: Any) -> None:
        self._run = run
        self.dataset = getattr(source, "dataset", source)
        self.batch_size = getattr(source, "batch_size", None) or 256
        self.collate_fn = getattr(source, "collate_fn", None)

    def _indices(self) -> range:
        ctx = self._run.context or LoopContext()
        return shard(len(self.dataset), ctx.world_rank, ctx.world_size)

    def __iter__(self) -> Iterator[Any]:
        sub = torch.utils.data.Subset(self.dataset, list(self._indices()))
        loader = torch.utils.data.DataLoader(sub, batch_size=self.batch_size, shuffle=False,
                                             collate_fn=self.collate_fn)
        device = next(self._run.model.parameters()).device if self._run.model is not None else None
        from ..engine.loader import to_device
        for batch in loader:
            yield to_device(batch, device) if device is not None else batch

    def __len__(self) -> int:
        return math.ceil(len(self._indices()) / self.batch_size)


def epochs(n: int, **state: Any) -> Iterator[int]:
    """``for epoch in epochs(n, model=model, optimizer=optimizer, scheduler=...)``: the epoch
    loop. It yields the epochs the driver trains (a resumed or re-placed run starts at the
    checkpoint's epoch, the loader at its sample). ``state``: objects with ``state_dict`` /
    ``load_state_dict`` checkpointed at every checkpoint of the run and restored when the loop
    is entered again (the prepared model and optimizer are the engine's and checkpointed
    anyway; schedulers, scalers and the like are the loop's). An enabled
    ``torch.amp.GradScaler`` among them is the one the engine scales the losses with
    (:func:`attach_scaler`); at most one."""
    run = bridge.user_run("epochs")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"epochs: n must be an int >= 1, got {n!r}")
    for k, v in state.items():
        if not (hasattr(v, "state_dict") and hasattr(v, "load_state_dict")):
            raise ValueError(f"epochs: {k}= must have state_dict() and load_state_dict(), got "
                             f"{type(v).__name__}")
    epoch = run.request("epochs", (n, state))
    while epoch is not None:
        yield epoch
        epoch = run.request("epoch_end", epoch)


def report(metrics: dict, checkpoint: Any = None) -> None:
    """Record this worker's metrics (numbers): each interval's record holds their mean over
    the reports and ranks of the interval, each epoch's over the epoch (the driver's training
    metrics, as a ``step_fn``'s). ``checkpoint`` (Ray Train's) is not needed: the run is
    checkpointed by the driver (model, optimizer and ``epochs(**state)``); it is ignored."""
    run = bridge.user_run("report")
    if not isinstance(metrics, dict):
        raise ValueError(f"report: metrics must be a dict of numbers, got {type(metrics).__name__}")
    clean = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"report: metric {k!r} must be a number, got {type(v).__name__}")
        clean[str(k)] = float(v)
    run.reports.append(clean)
