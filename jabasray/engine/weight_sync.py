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

from typing import Sequence

import torch

# The selection rule is pure arithmetic shared with the planners' perf model, so it lives in
# config (torch-free); re-exported here as part of the engine's API.
from ..config import R_BUFFER, WEIGHT_SYNC_METHODS, choose_weight_sync  # noqa: F401
from ..validation import check_choice

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
