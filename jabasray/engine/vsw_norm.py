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
  sum of the VSWs' gradients);
* the running statistics are the ``n`` VSWs' own: :class:`PackedNormStats` stores every VSW's
  ``running_mean``/``running_var`` of one layer in one ``[n, C]`` tensor and makes each VSW
  module's buffers views of its row, so the kernel updates all ``n`` in place,
  ``r_v <- (1 - m) r_v + m * s_v`` (``s_v``: VSW ``v``'s batch mean, unbiased batch variance),
  and every replica (and ``state_dict``) still sees its own statistics.
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
import functools
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
        first = modules[0]
        self.tracking = first.running_mean is not None and first.running_var is not None
        self.mean = self.var = self.count = None
        if not self.tracking:
            return
        with torch.no_grad():
            self.mean = torch.stack([m.running_mean for m in modules])
            self.var = torch.stack([m.running_var for m in modules])
            if first.num_batches_tracked is not None:
                self.count = torch.stack([m.num_batches_tracked for m in modules])
        for v, m in enumerate(modules):
            m._buffers["running_mean"] = self.mean[v]
            m._buffers["running_var"] = self.var[v]
            if self.count is not None:
                m._buffers["num_batches_tracked"] = self.count[v]


def pack_norm_stats(replicas: Sequence[nn.Module]) -> list[tuple[_BatchNorm, PackedNormStats]]:
    """Pack every BatchNorm layer's statistics of the VSW modules ``replicas`` (main first);
    returns ``(main's layer, its packed statistics)`` per layer, in module order."""
    per_vsw = [[m for _, m in norm_layers(r)] for r in replicas]
    return [(layers[0], PackedNormStats(layers)) for layers in zip(*per_vsw)]


def ghost_forward(module: _BatchNorm, stats: PackedNormStats, x: torch.Tensor) -> torch.Tensor:
    """``module``'s forward over ``stats.n`` VSWs' interleaved batches (module notes): each
    VSW normalised over its own rows and its own running statistics updated."""
    module._check_input_dim(x)
    n = stats.n
    N, C = x.shape[0], x.shape[1]
    if N % n:
        raise ValueError(f"a batched forward needs {n} equal local batches, got {N} rows")
    B, rest = N // n, tuple(x.shape[2:])
    xv = x.reshape(B, n * C, *rest)             # a view for a contiguous x
    w = module.weight.repeat(n) if module.weight is not None else None
    b = module.bias.repeat(n) if module.bias is not None else None
    tracking = stats.tracking
    update = module.training and module.track_running_stats and tracking
    if update:
        if stats.count is not None:
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
            y = F.batch_norm(xv, stats.mean.view(-1), stats.var.view(-1), w, b, True, m, module.eps)
    else:
        use_stats = tracking and not module.training
        y = F.batch_norm(xv, stats.mean.view(-1) if use_stats else None,
                         stats.var.view(-1) if use_stats else None, w, b,
                         module.training or not tracking, 0.0, module.eps)
    return y.reshape(N, C, *rest)


@contextlib.contextmanager
def ghost_norms(layers: Sequence[tuple[_BatchNorm, PackedNormStats]]) -> Iterator[None]:
    """Within the block, each main-VSW layer of ``layers`` runs :func:`ghost_forward` over its
    packed statistics (an instance attribute shadows the class's ``forward``; restored on
    exit). One VSW (``n == 1``) needs no ghost (the stock forward is already per VSW), except
    for ``momentum=None``, where the stock forward reads the count on the host."""
    active = [(m, s) for m, s in layers if s.n > 1 or m.momentum is None]
    saved = [m.__dict__.get("forward", _MISSING) for m, _ in active]
    try:
        for m, s in active:
            object.__setattr__(m, "forward", functools.partial(ghost_forward, m, s))
        yield
    finally:
        for (m, _), old in zip(active, saved):
            if old is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                object.__setattr__(m, "forward", old)
