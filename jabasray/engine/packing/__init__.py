"""The ``pack`` primitive: K models trained as one (Pack paper, sections 2.2, 3.1, 3.2).

Implementation notes
--------------------
The package holds one concern per module: :mod:`.keys` (grouping keys), :mod:`.fused` (the
fused optimizer updates), :mod:`.folded` (the folded layers), :mod:`.state` (stacked state and
the ONE slot -> optimizer-state-key table), :mod:`.update` (the runs' fused update: device
columns, device step counters, host bookkeeping), :mod:`.graphed` (the packed step as one CUDA
graph) and :mod:`.model` (``PackedModel`` / ``pack``).

``pack(models, optimizers, batch_sizes)`` returns a :class:`PackedModel`. One call of
:meth:`PackedModel.train_step` performs one optimizer step of every member on ONE shared input
batch (section 3.2, "shared input stream": the batch is moved to the device once and every
member reads it):

* Members are grouped by ``(architecture, optimizer kind)``. Architecture = module class,
  ``repr`` (which names every layer and activation) and parameter names/shapes/dtypes, so two
  MLPs that differ only in activation are *different* architectures (our call: batching them
  would need a per-member activation switch inside the model; the paper also packs them as
  side-by-side graphs, section 3.2 ``nn_relu``/``nn_sigmoid``).
* A group's parameters live STACKED: one leaf tensor ``S[name]`` of shape ``[K_g, *shape]``
  (``K_g``: the group's number of members; ``K`` the whole pack's). Each
  member's own ``nn.Parameter`` is re-pointed (``p.data = S[name][k]``) at its slice, so a
  member's module always shows its current weights and its optimizer state keys stay valid.
* Forward/backward of a group is one batched computation,
  ``vmap(functional_call(template, S, x))`` (torch.func model ensembling). Groups of different
  architectures run side by side in the same step; all member losses are summed and ONE
  backward runs for the whole pack (members share no parameters, so the sum's gradient w.r.t.
  member k's slice is exactly member k's own gradient).
* Misaligned batch sizes (section 3.1.1): the shared batch has ``max(batch_sizes)`` samples;
  each group runs on the first ``max(b_k in group)`` rows and member k's mean loss is taken
  over its first ``b_k`` rows only ("the padding is sliced and ignored"), so its gradient is
  the gradient of its own mini-batch ``x[:b_k]``.
* Optimizer steps are fused per group for SGD (incl. momentum/Nesterov/dampening/weight
  decay), Adam and Adagrad: the update of ``torch.optim`` (single-tensor form, written out in
  :func:`.fused.sgd_step`, :func:`.fused.adam_step`, :func:`.fused.adagrad_step`) runs once on the stacked
  tensors with per-member hyperparameters broadcast as ``[K_g, 1, ...]`` tensors. The
  hyperparameters are read from each member's ``optimizer.param_groups`` at every step, so LR
  schedulers attached to a member's optimizer keep working; their device columns are cached
  and rebuilt only when a value changes, and Adam's/Adagrad's step-dependent factors are
  computed on the device, so a steady-state step makes no host sync. Any other optimizer (or an
  unsupported flag such as ``amsgrad``/``maximize``) is stepped by the member's own
  ``optimizer.step()`` on gradient views: exact by construction, just not fused.
* On a CUDA device (``cuda_graphs="auto"``, the default) the whole packed step -- forwards,
  the one backward, the fused updates -- is captured as ONE CUDA graph after a few eager
  warm-up steps and replayed while the pack's membership and batch shape stay the same
  (:mod:`.graphed`): LR schedules refill the device columns in place; a restack, another
  batch shape or a hyper-parameter change of the update's code path re-captures. Packs that
  cannot be captured (CPU, an unbatched member, an optimizer stepped by its own ``step()``)
  run eagerly, the reason logged once.
* Members with buffers (BatchNorm running stats) or dropout are not vmapped: they run
  unbatched with their own module (still in the same step, on the same shared batch).
* ``free(member)`` / ``load(model, optimizer, batch_size)`` (section 2.2): the pack writes
  every member's weights and optimizer state back (the "checkpoint" of ``free``), drops or
  adds the member and re-stacks the rest. Members needing different step counts (3.1.2) are
  handled by freeing them when they are done.

Training a member in a pack is mathematically the same as training it alone on
``x[:b_k], y[:b_k]`` with its own optimizer; tests check this with ``allclose`` against a plain
loop for every optimizer, mixed batch sizes and mixed architectures.
"""
from __future__ import annotations

from jabasray.engine.packing.keys import (ACTIVATION_TYPES, architecture_key, batchable,
                                          estimate_memory_bytes, optimizer_kind, structure_key)
from jabasray.engine.packing.model import PackedModel, pack

__all__ = ["pack", "PackedModel", "architecture_key", "structure_key", "optimizer_kind",
           "estimate_memory_bytes", "batchable", "ACTIVATION_TYPES"]
