"""Per-VSW ("ghost") BatchNorm for batched VSW execution.

IIDP (JABAS section 4) runs ``n`` virtual stream workers on one device, each a model replica
that normalises over its OWN local batch of ``B_L`` samples and keeps its OWN BatchNorm
running statistics. After one-way weight sync all VSWs hold the same weights, so their ``n``
forwards can run as one forward over the ``n*B_L`` samples side by side - except that a stock
BatchNorm would then normalise over all ``n*B_L`` samples. :func:`ghost_norms` swaps every
BatchNorm layer's forward, for the duration of one batched forward, for :func:`ghost_forward`:

* the batched pass holds the VSWs' samples INTERLEAVED (:func:`~jabasray.engine.batched.join_batches`):
  row ``b*n + v`` is sample ``b`` of VSW ``v``. The activations ``x`` of shape
  ``[B_L*n, C, *rest]`` are then, without a copy, the view ``[B_L, n*C, *rest]`` (channel
  ``v*C + c`` is VSW ``v``'s channel ``c``), so the STOCK kernel ``F.batch_norm`` computes each
  VSW's statistics over exactly its ``B_L`` samples: ``y = (x - mean_v) / sqrt(var_v + eps) * w
  + b`` with ``mean_v, var_v`` over VSW ``v``'s samples (and positions), at the cost of one
  stock BatchNorm over the batch (no transposes: every other layer is per sample and does not
  care about the order of the rows);
* weight and bias are repeated ``n`` times (autograd sums their gradient over VSWs, as the
  sum of the VSWs' gradients) - for ALL layers at once (:class:`RepeatAffine`: one gather
  forward, one gather and one sum backward, instead of a ``repeat`` and its backward ``sum``
  per weight and bias: on a GPU every op is a kernel launch the host pays for);
* the running statistics are the ``n`` VSWs' own: :class:`PackedNormStats` stores every VSW's
  ``running_mean``/``running_var`` of one layer in one ``[n, C]`` tensor and makes each VSW
  module's buffers views of its row, so the kernel updates all ``n`` in place,
  ``r_v <- (1 - m) r_v + m * s_v`` (``s_v``: VSW ``v``'s batch mean, unbiased batch variance),
  and every replica (and ``state_dict``) still sees its own statistics. The
  ``num_batches_tracked`` of every layer and VSW live in one ``[layers, n]`` tensor
  (:class:`VSWNorms`), so a batched forward counts its batch with ONE ``add_`` (the stock
  forward: one per layer);
  ``momentum=None`` (cumulative average, ``m = 1 / num_batches_tracked``) takes each VSW's own
  count: the batch statistics are computed by the same kernel into scratch buffers
  (momentum 1 leaves exactly ``s_v`` there) and ``r_v <- r_v + (s_v - r_v) / t_v`` follows on
  the device - no host read of the count (stock PyTorch reads it with ``float()``).

Modules that couple the samples of a batch in a way this module cannot split make batched
execution inexact; :func:`coupling_modules` names them (SyncBatchNorm, BatchNorm subclasses
with their own forward, InstanceNorm with running statistics, uninitialised lazy modules) and
the engine then runs per VSW.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.lazy import LazyModuleMixin

# exact classes whose forward is _BatchNorm.forward (they only add an input-dim check)
GHOST_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_MISSING = object()


def norm_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """``(name, module)`` of every BatchNorm layer :func:`ghost_forward` handles."""
    return [(n, m) for n, m in model.named_modules() if type(m) in GHOST_NORMS]


def coupling_modules(model: nn.Module) -> list[str]:
    """Modules that couple the samples of a batch and cannot be split per VSW: one
    ``"name (Type)"`` each (empty: batched execution is exact for every module of ``model``)."""
    out = []
    for name, m in model.named_modules():
        t = type(m)
        if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
            out.append(f"{name or '<model>'} ({t.__name__}, uninitialised)")
        elif isinstance(m, _BatchNorm) and t not in GHOST_NORMS:   # SyncBatchNorm, own subclasses
            out.append(f"{name or '<model>'} ({t.__name__})")
        elif isinstance(m, _InstanceNorm) and m.track_running_stats:   # running stats: batch mean
            out.append(f"{name or '<model>'} ({t.__name__}, track_running_stats)")
    return out


class PackedNormStats:
    """The running statistics of one BatchNorm layer of ``n`` VSWs in ``[n, C]`` tensors.

    ``modules[v]`` is the layer in VSW ``v``; its ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` become views of row ``v`` (values kept), so an update of the packed
    tensor is an update of every VSW's own buffer (and per-VSW execution updates the same rows).
    """

    def __init__(self, modules: Sequence[_BatchNorm]) -> None:
        self.n = len(modules)
        self.modules = list(modules)
        first = modules[0]
        self.tracking = first.running_mean is not None and first.running_var is not None
        self.mean = self.var = self.count = self.flat_mean = self.flat_var = None
        if not self.tracking:
            return
        with torch.no_grad():
            self.mean = torch.stack([m.running_mean for m in modules])
            self.var = torch.stack([m.running_var for m in modules])
            if first.num_batches_tracked is not None:
                self.count = torch.stack([m.num_batches_tracked for m in modules])
        # the [n*C] views the kernel updates (kept: a view per step is an op per step)
        self.flat_mean, self.flat_var = self.mean.view(-1), self.var.view(-1)
        for v, m in enumerate(modules):
            m._buffers["running_mean"] = self.mean[v]
            m._buffers["running_var"] = self.var[v]
            if self.count is not None:
                m._buffers["num_batches_tracked"] = self.count[v]

    def bind_count(self, count: torch.Tensor) -> None:
        """Keep the counts in ``count`` (an ``[n]`` view of a tensor packing several layers,
        :class:`VSWNorms`), values copied; every VSW's ``num_batches_tracked`` follows."""
        with torch.no_grad():
            count.copy_(self.count)
        self.count = count
        for v, m in enumerate(self.modules):
            m._buffers["num_batches_tracked"] = count[v]


class RepeatAffine(torch.autograd.Function):
    """``[p.repeat(n) for p in params]`` as ONE gather, the gradients as one gather and one
    sum: ``d/dp_l = sum_v g_l[v*C_l : (v+1)*C_l]`` (the backward of ``repeat``, for all
    parameters at once; summed over ``v`` in VSW order like ``repeat``'s backward).
    ``fwd_index[j]``: the element of ``cat(params)`` at position ``j`` of ``cat(outputs)``;
    ``bwd_index`` lays ``cat(grads)`` out as ``[n, sum C_l]`` (row ``v``: copy ``v`` of every
    parameter). The outputs are returned as separate tensors (a ``narrow`` of one output
    would cost a ``slice_backward`` and an ``add`` per parameter in backward)."""

    @staticmethod
    def forward(ctx, n: int, fwd_index: torch.Tensor, bwd_index: torch.Tensor,
                *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.n, ctx.bwd_index = n, bwd_index
        ctx.sizes = [p.numel() for p in params]
        out = torch.cat(params).index_select(0, fwd_index)
        return out.split([n * k for k in ctx.sizes])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        total = sum(ctx.sizes)
        summed = torch.cat(grads).index_select(0, ctx.bwd_index).view(ctx.n, total).sum(0)
        return (None, None, None, *summed.split(ctx.sizes))


class VSWNorms(list):
    """``[(main's layer, PackedNormStats)]`` per BatchNorm layer (module order), plus what a
    batched forward reuses every step: the layers that need :func:`ghost_forward`, the gather
    indexes of :class:`RepeatAffine` for their weights and biases and (``pack_counts``) every
    active layer's ``num_batches_tracked`` of every VSW in ONE ``[layers, n]`` tensor, so that
    a batched forward counts its batch with one ``add_`` instead of one per layer."""

    def __init__(self, pairs: Sequence[tuple[_BatchNorm, PackedNormStats]],
                 pack_counts: bool = False) -> None:
        super().__init__(pairs)
        # one VSW: the stock forward is already per VSW, except momentum=None, whose stock
        # forward reads the count on the host
        self.active = [(m, s) for m, s in self if s.n > 1 or m.momentum is None]
        self.params: list[torch.Tensor] = []       # repeated affine parameters, in order
        self.fwd_index = self.bwd_index = None
        self.counts: torch.Tensor | None = None    # [active layers, n] (pack_counts)
        # each active layer's ghost forward, built once; what changes per batched forward
        # (the repeated affine parameters, the call counts) is read from these two
        self.step_repeated: dict[int, torch.Tensor] | None = None
        self.step_outputs: tuple[torch.Tensor, ...] | None = None   # RepeatAffine's outputs
        self.step_calls: list[int] | None = None
        self.forwards = [_GhostForward(self, m, s, i) for i, (m, s) in enumerate(self.active)]
        self.n = self.active[0][1].n if self.active else 1
        stats = [s for _, s in self.active]
        if (pack_counts and stats and all(s.count is not None for s in stats)
                and len({s.count.device for s in stats}) == 1):
            self.counts = torch.zeros(len(stats), self.n, dtype=stats[0].count.dtype,
                                      device=stats[0].count.device)
            for i, st in enumerate(stats):
                st.bind_count(self.counts[i])
        if self.n < 2:
            return
        params = [p for m, _ in self.active for p in (m.weight, m.bias) if p is not None]
        if not params or len({(p.dtype, p.device) for p in params}) != 1:
            return                                  # per layer (``repeat``) then
        n, fwd, segs, start, off = self.n, [], [], 0, 0
        for p in params:
            c = p.numel()
            fwd.append(torch.arange(off, off + c).repeat(n))
            segs.append((start, c))
            start, off = start + n * c, off + c
        bwd = [s + v * c + torch.arange(c) for v in range(n) for s, c in segs]
        device = params[0].device
        self.params = params
        self.fwd_index = torch.cat(fwd).to(device)
        self.bwd_index = torch.cat(bwd).to(device)
        # each layer's weight and bias as positions in RepeatAffine's outputs, found once
        # (not an id() lookup per parameter per forward)
        slot = {id(p): i for i, p in enumerate(params)}
        for f in self.forwards:
            f.slots = tuple(None if p is None else slot[id(p)] for p in (f.module.weight, f.module.bias))

    def repeated_outputs(self) -> tuple[torch.Tensor, ...] | None:
        """Every affine parameter of the active layers ``repeat(n)``-ed, in ``params`` order,
        by one :class:`RepeatAffine` (``None`` when not packed)."""
        if not self.params:
            return None
        return RepeatAffine.apply(self.n, self.fwd_index, self.bwd_index, *self.params)

    def repeated(self) -> dict[int, torch.Tensor]:
        """``id(param) -> param.repeat(n)`` for every affine parameter of the active layers,
        computed in one :class:`RepeatAffine` (empty when not packed)."""
        out = self.repeated_outputs()
        return {} if out is None else {id(p): r for p, r in zip(self.params, out)}


class _GhostForward:
    """Layer ``index`` of ``owner``'s active layers as :func:`ghost_forward` with the current
    batched forward's repeated parameters and call counts."""

    __slots__ = ("owner", "module", "stats", "index", "slots")

    def __init__(self, owner: VSWNorms, module: _BatchNorm, stats: PackedNormStats, index: int) -> None:
        self.owner, self.module, self.stats, self.index = owner, module, stats, index
        self.slots: tuple[int | None, int | None] | None = None   # (weight, bias) in the outputs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        o = self.owner
        out, slots = o.step_outputs, self.slots
        if out is not None and slots is not None:
            wi, bi = slots
            return ghost_forward(self.module, self.stats, x, None, o.step_calls, self.index,
                                 affine=(None if wi is None else out[wi], None if bi is None else out[bi]))
        return ghost_forward(self.module, self.stats, x, o.step_repeated, o.step_calls, self.index)


def pack_norm_stats(replicas: Sequence[nn.Module]) -> VSWNorms:
    """Pack every BatchNorm layer's statistics of the VSW modules ``replicas`` (main first);
    returns ``(main's layer, its packed statistics)`` per layer, in module order."""
    per_vsw = [[m for _, m in norm_layers(r)] for r in replicas]
    return VSWNorms([(layers[0], PackedNormStats(layers)) for layers in zip(*per_vsw)],
                    pack_counts=True)


def ghost_forward(module: _BatchNorm, stats: PackedNormStats, x: torch.Tensor,
                  repeated: dict[int, torch.Tensor] | None = None,
                  calls: list[int] | None = None, index: int = 0,
                  affine: tuple[torch.Tensor | None, torch.Tensor | None] | None = None) -> torch.Tensor:
    """``module``'s forward over ``stats.n`` VSWs' interleaved batches (module notes): each
    VSW normalised over its own rows and its own running statistics updated. ``repeated``:
    ``id(param) -> param.repeat(n)`` computed for all layers at once
    (:meth:`VSWNorms.repeated`); a parameter missing there is repeated here. ``calls``: the
    batch was counted for every layer on entry (:func:`ghost_norms`); ``calls[index]``
    counts this layer's calls, and only a second call of a layer counts itself. ``affine``:
    the repeated ``(weight, bias)`` of this layer given directly (instead of ``repeated``)."""
    module._check_input_dim(x)
    counted = False
    if calls is not None:
        calls[index] += 1
        counted = calls[index] == 1
    n = stats.n
    shape = x.shape
    N, C = shape[0], shape[1]
    if N % n:
        raise ValueError(f"a batched forward needs {n} equal local batches, got {N} rows")
    params = module._parameters                 # (BatchNorm registers both, None without affine)
    w, b = params["weight"], params["bias"]
    if n > 1 and affine is not None:
        xv = x.reshape(N // n, n * C, *shape[2:])   # a view for a contiguous x
        w, b = affine
    elif n > 1:
        xv = x.reshape(N // n, n * C, *shape[2:])
        if w is not None:
            w = repeated.get(id(w)) if repeated else None
            if w is None:
                w = params["weight"].repeat(n)
        if b is not None:
            b = repeated.get(id(b)) if repeated else None
            if b is None:
                b = params["bias"].repeat(n)
    else:
        xv = x
    tracking = stats.tracking
    update = module.training and module.track_running_stats and tracking
    if update:
        if stats.count is not None and not counted:
            stats.count.add_(1)
        if module.momentum is None and stats.count is not None:
            # cumulative average with each VSW's own count: batch statistics via momentum 1
            s_mean = torch.zeros(n * C, dtype=stats.mean.dtype, device=stats.mean.device)
            s_var = torch.ones(n * C, dtype=stats.var.dtype, device=stats.var.device)
            y = F.batch_norm(xv, s_mean, s_var, w, b, True, 1.0, module.eps)
            with torch.no_grad():
                f = stats.count.to(stats.mean.dtype).reciprocal().unsqueeze(1)
                stats.mean.add_((s_mean.view(n, C) - stats.mean) * f)
                stats.var.add_((s_var.view(n, C) - stats.var) * f)
        else:
            m = module.momentum if module.momentum is not None else 0.0
            y = F.batch_norm(xv, stats.flat_mean, stats.flat_var, w, b, True, m, module.eps)
    else:
        use_stats = tracking and not module.training
        y = F.batch_norm(xv, stats.flat_mean if use_stats else None,
                         stats.flat_var if use_stats else None, w, b,
                         module.training or not tracking, 0.0, module.eps)
    return y if n == 1 else y.reshape(shape)


@contextlib.contextmanager
def ghost_norms(layers: Sequence[tuple[_BatchNorm, PackedNormStats]]) -> Iterator[None]:
    """Within the block, each main-VSW layer of ``layers`` (best a :class:`VSWNorms`, which
    keeps what every step reuses) runs :func:`ghost_forward` over its packed statistics (an
    instance attribute shadows the class's ``forward``; restored on exit), the weights and
    biases of all layers repeated by one :class:`RepeatAffine` on entry. One VSW (``n == 1``)
    needs no ghost (the stock forward is already per VSW), except for ``momentum=None``,
    where the stock forward reads the count on the host."""
    if not isinstance(layers, VSWNorms):
        layers = VSWNorms(layers)
    active = layers.active
    if not active:
        yield
        return
    outputs = layers.repeated_outputs()
    calls = None
    if layers.counts is not None and all(m.training and m.track_running_stats and s.tracking
                                         for m, s in active):
        # every layer's count + 1 in one op; a layer the forward does not call gives it back
        calls = [0] * len(active)
        layers.counts.add_(1)
    layers.step_outputs, layers.step_calls = outputs, calls
    saved = [m.__dict__.get("forward", _MISSING) for m, _ in active]
    try:
        for (m, _), fwd in zip(active, layers.forwards):
            m.__dict__["forward"] = fwd            # (an instance attribute shadows the class's)
        yield
    finally:
        for (m, _), old in zip(active, saved):
            if old is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = old
        layers.step_outputs = layers.step_calls = None
        if calls is not None:
            for (_, s), k in zip(active, calls):
                if k == 0:
                    s.count.sub_(1)
