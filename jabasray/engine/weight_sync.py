"""One-way weight synchronisation within a device (JABAS/IIDP section 4, Fig. 6).

Only the main VSW holds the optimizer. After the global all-reduce it updates the weights and
copies them to the other VSWs of the device:

* **SWS** (sequential): wait for every bucket's all-reduce, run the full optimizer once, then
  copy all weights.
* **OWS** (overlapping): as soon as bucket ``b``'s all-reduce has completed, a *shard
  optimizer* updates only bucket ``b``'s parameters and copies that shard, while the
  all-reduce of the next bucket is still running.

Selection rule (section 4, "One-way weight synchronization method selection"): with
``r = mean(bucket sizes) / bucket_cap`` (the cap the user specified), ``r > R_buffer`` -> SWS,
else OWS; the paper uses ``R_buffer = 0.5``. Large buffers make OWS's overlapped update
interfere with the all-reduce, hence SWS for them.

Shard optimizer design: we keep ONE ``torch.optim.Optimizer`` over all parameters (built by the
user's ``optimizer_fn``, so its ``state_dict`` is the ordinary one) and step a shard by
temporarily replacing ``optimizer.param_groups`` with copies of the groups restricted to the
shard's parameters (hyper-parameters taken from the live groups at each step, so LR changes
and ``load_state_dict`` are honoured). For every optimizer whose update of a parameter depends
only on that parameter's gradient and state (SGD, momentum, Nesterov, weight decay, Adam,
AdamW, RMSprop, Adagrad, ... - all of ``torch.optim`` except LBFGS), stepping every shard once
is exactly one full ``step()``: per-parameter states (including Adam's per-parameter step
count) are independent. Optimizers that couple parameters (LBFGS, a global-norm clip inside
``step``) must use SWS.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch

# The selection rule is pure arithmetic shared with the planners' perf model, so it lives in
# config (torch-free); re-exported here as part of the engine's API.
from ..config import R_BUFFER, WEIGHT_SYNC_METHODS, choose_weight_sync  # noqa: F401
from ..validation import check_choice
from .stats import _Timings

def resolve_weight_sync(method: str, bucket_nbytes: Sequence[int], bucket_cap_mb: float) -> str:
    """``"auto"`` -> :func:`choose_weight_sync`; ``"sws"``/``"ows"`` unchanged."""
    check_choice("weight_sync", method, WEIGHT_SYNC_METHODS)
    if method == "auto":
        return choose_weight_sync(bucket_nbytes, bucket_cap_mb)
    return method


class ShardOptimizer:
    """Step one shard (a gradient bucket's parameters) of a full optimizer at a time.

    ``shards[i]`` lists the parameters of shard ``i``; together the shards must cover every
    parameter of the optimizer exactly once. ``step_shard(i)`` for all ``i`` equals
    ``optimizer.step()`` (see the module notes for which optimizers qualify).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, shards: Sequence[Sequence[torch.Tensor]]) -> None:
        self.optimizer = optimizer
        self._shard_ids = [frozenset(id(p) for p in shard) for shard in shards]
        opt_ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
        all_ids = [i for s in self._shard_ids for i in s]
        if len(set(opt_ids)) != len(opt_ids) or set(opt_ids) != set(all_ids) or len(all_ids) != len(opt_ids):
            raise ValueError("optimizer_fn must return an optimizer over exactly the model's trainable "
                             f"parameters (got {len(opt_ids)} parameters in the optimizer, "
                             f"{len(all_ids)} trainable)")
        self._cache_key: tuple | None = None
        self._split: list[list[list[torch.Tensor]]] = []

    def _groups_of(self, shard: int) -> list[dict]:
        groups = self.optimizer.param_groups
        key = tuple(id(g["params"]) for g in groups)
        if key != self._cache_key:      # groups were replaced (load_state_dict, add_param_group)
            self._split = [[[p for p in g["params"] if id(p) in ids] for g in groups]
                           for ids in self._shard_ids]
            self._cache_key = key
        out = []
        for g, plist in zip(groups, self._split[shard]):
            if plist:
                d = dict(g)
                d["params"] = plist
                out.append(d)
        return out

    def step_shard(self, shard: int) -> None:
        """Update only ``shard``'s parameters (their ``.grad`` must hold the final gradient)."""
        opt = self.optimizer
        saved = opt.param_groups
        opt.param_groups = self._groups_of(shard)
        try:
            opt.step()
        finally:
            opt.param_groups = saved

    def step(self) -> None:
        """Full update (SWS)."""
        self.optimizer.step()


class WeightUpdate:
    """The main VSW's update after the all-reduces (module notes), SWS or OWS, at the LR
    ``group["lr"] * lr_factor``; the copy to the other VSWs follows each (shard) step.

    ``optimizer`` is the user's; ``scaler`` a GradScaler (fp16) or ``None``; ``grad_clip_norm``
    clips the global (averaged) gradient; ``method`` is ``"sws"`` or ``"ows"``. Attributes
    ``lr_factor``, ``grad_clip_norm`` and ``method`` may change between steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, shard: ShardOptimizer, scaler: Any,
                 grad_clip_norm: float | None, method: str) -> None:
        self.optimizer = optimizer
        self.shard = shard
        self.scaler = scaler
        self.grad_clip_norm = grad_clip_norm
        self.method = method
        self.lr_factor = 1.0
        # per step, set by the execution before the update
        self.copy_replicas = True        # replicas ran: copy the new weights to them
        self.prescaled = False           # the gradients are averaged already (in the loss)

    def lr_values(self) -> list[float]:
        """The LR of every param group in the next update: ``lr * lr_factor``."""
        return [g["lr"] * self.lr_factor for g in self.optimizer.param_groups]

    def update(self, buckets: Any, vsws: Sequence[Any], num_buckets: int, divisor: float,
               clock: Callable[[], float]) -> _Timings:
        """Wait for the all-reduces (``buckets.wait_bucket``), average, update and copy (SWS or
        OWS); runs on the update stream (CUDA). Host timings from ``clock`` (which synchronises
        the device around each phase when the profiler asks for device times). After a batched
        step no replica ran: ``copy_replicas=False`` defers their copy; ``prescaled``: the
        gradients leave backward averaged already."""
        main = vsws[0].buffers
        others = [v.buffers for v in vsws[1:]] if self.copy_replicas else []
        scale = 1.0 if self.prescaled else 1.0 / divisor
        tm = _Timings()
        bucket_ids = range(num_buckets)
        if self.method == "ows":
            for b in bucket_ids:   # (OWS never runs with clipping / a GradScaler)
                t0 = clock()
                buckets.wait_bucket(b)
                t1 = clock()
                if scale != 1.0:
                    main.scale_bucket(b, scale)
                with self.scaled_lr():
                    self.shard.step_shard(b)
                t2 = clock()
                for o in others:
                    o.copy_params_from(main, b)
                t3 = clock()
                tm.comm += t1 - t0
                tm.optim += t2 - t1
                tm.copy += t3 - t2
        else:
            t0 = clock()
            for b in bucket_ids:
                buckets.wait_bucket(b)
            t1 = clock()
            if scale != 1.0:
                for b in bucket_ids:
                    main.scale_bucket(b, scale)
            self.full_step()
            t2 = clock()
            for o in others:
                o.copy_params_from(main)
            t3 = clock()
            tm.comm, tm.optim, tm.copy = t1 - t0, t2 - t1, t3 - t2
        return tm

    def full_step(self) -> None:
        """SWS update of the averaged gradient: fp16 unscale, global-norm clip, optimizer step
        at ``lr * lr_factor`` (skipped by the GradScaler on inf/NaN), scale update."""
        opt, scaler = self.optimizer, self.scaler
        if scaler is not None:
            scaler.unscale_(opt)
        self.clip()
        with self.scaled_lr():
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                self.shard.step()

    def clip(self) -> None:
        if self.grad_clip_norm is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm)

    @contextlib.contextmanager
    def scaled_lr(self) -> Iterator[None]:
        """Param groups' LR times ``lr_factor`` for the duration of an optimizer step."""
        f = self.lr_factor
        if f == 1.0:
            yield
            return
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, saved):
            g["lr"] = lr * f
        try:
            yield
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr
