"""Gradient buckets ("gradient buffers" of JABAS/IIDP section 4) and their flat storage.

Implementation notes
--------------------
* A *bucket plan* is ``list[list[str]]``: parameter names as in ``model.named_parameters()``,
  one inner list per bucket, buckets in BACKWARD order (the bucket whose gradients are ready
  first, i.e. the last layers, comes first). Every trainable parameter appears exactly once.
  This is the cross-team interface 1; a planner (``planners/libra.py``) may produce it, the
  engine only executes it (the split PyTorch DDP makes between Python and its reducer).
* :func:`default_bucket_plan` is the DDP-like default: parameters in reverse registration
  order (DDP's heuristic for backward order), grouped greedily until a bucket reaches
  ``bucket_cap_mb``; a bucket never mixes dtypes or devices.
* :class:`FlatBuffers` gives one VSW contiguous storage per bucket: one flat tensor for the
  bucket's parameters (parameters become views into it, so a weight copy is one ``copy_`` per
  bucket) and, when buckets are all-reduced, one flat tensor for its gradients (``p.grad``
  becomes a view into it, so GA steps accumulate in place, local aggregation is one ``add_``
  per bucket and VSW and the all-reduce works on the bucket directly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..validation import check_float

BucketPlan = list[list[str]]

# Every parameter starts at a multiple of 64 bytes inside its flat buffer: a misaligned weight
# view slows CPU GEMMs by ~25 % (measured on the dev machine) and breaks vectorised CUDA loads.
ALIGN_BYTES = 64


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, param)`` of every parameter with ``requires_grad``, in registration order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def default_bucket_plan(model: nn.Module, bucket_cap_mb: float = 25.0) -> BucketPlan:
    """DDP-like size-cap grouping in backward order.

    Parameters are visited in REVERSE registration order (the last layers produce their
    gradients first) and appended to the current bucket; the bucket is closed once its size
    reaches ``bucket_cap_mb`` MiB (so a bucket may exceed the cap by at most one parameter),
    or before a parameter of another dtype/device would enter it.
    """
    check_float("bucket_cap_mb", bucket_cap_mb, min_value=0, min_exclusive=True)
    cap = bucket_cap_mb * 2 ** 20
    plan: BucketPlan = []
    cur: list[str] = []
    cur_bytes = 0
    cur_kind: tuple | None = None
    for name, p in reversed(trainable_parameters(model)):
        kind = (p.dtype, p.device)
        if cur and kind != cur_kind:
            plan.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_kind = kind
        cur_bytes += p.numel() * p.element_size()
        if cur_bytes >= cap:
            plan.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        plan.append(cur)
    return plan


def validate_bucket_plan(model: nn.Module, plan: object) -> BucketPlan:
    """Return ``plan`` as ``list[list[str]]`` if it covers every trainable parameter exactly once.

    Raises ``ValueError`` naming ``bucket_plan`` for: not a list of non-empty lists of names,
    unknown or frozen parameter names, repeated names, missing names, or a bucket that mixes
    dtypes/devices (a flat buffer holds one dtype).
    """
    params = dict(trainable_parameters(model))
    if not isinstance(plan, (list, tuple)) or not plan:
        raise ValueError(f"bucket_plan must be a non-empty list of lists of parameter names, got {plan!r}")
    out: BucketPlan = []
    seen: set[str] = set()
    for i, bucket in enumerate(plan):
        if not isinstance(bucket, (list, tuple)) or not bucket:
            raise ValueError(f"bucket_plan[{i}] must be a non-empty list of parameter names, got {bucket!r}")
        names = []
        for name in bucket:
            if name not in params:
                raise ValueError(f"bucket_plan[{i}] names {name!r}, which is not a trainable parameter "
                                 f"of the model; allowed: names from model.named_parameters()")
            if name in seen:
                raise ValueError(f"bucket_plan repeats parameter {name!r} (bucket {i}); every trainable "
                                 "parameter must appear exactly once")
            seen.add(name)
            names.append(name)
        kinds = {(params[n].dtype, params[n].device) for n in names}
        if len(kinds) > 1:
            raise ValueError(f"bucket_plan[{i}] mixes dtypes/devices {sorted(map(str, kinds))}; "
                             "a bucket must hold one dtype on one device")
        out.append(names)
    missing = [n for n in params if n not in seen]
    if missing:
        raise ValueError(f"bucket_plan misses trainable parameter(s) {missing}; every trainable "
                         "parameter must appear exactly once")
    return out


@dataclass(frozen=True)
class BucketSpec:
    """Layout of one bucket: its parameters and where each lives in the flat buffer."""

    index: int                       # position in the plan (launch order)
    names: tuple[str, ...]           # parameter names, in flat-buffer order
    offsets: tuple[int, ...]         # element offset of each parameter (ALIGN_BYTES-aligned)
    numels: tuple[int, ...]          # element count of each parameter
    shapes: tuple[torch.Size, ...]   # parameter shapes
    numel: int                       # elements of the flat buffer (parameters + padding)
    dtype: torch.dtype
    element_size: int                # bytes per element

    @property
    def nbytes(self) -> int:
        """Bytes of the bucket's parameters (without alignment padding)."""
        return sum(self.numels) * self.element_size


def make_bucket_specs(model: nn.Module, plan: BucketPlan) -> list[BucketSpec]:
    """Flat layouts for a (validated) plan."""
    params = dict(trainable_parameters(model))
    specs = []
    for i, names in enumerate(plan):
        offsets, numels, shapes = [], [], []
        off = 0
        p0 = params[names[0]]
        align = max(1, ALIGN_BYTES // p0.element_size())
        for n in names:
            p = params[n]
            off = -(-off // align) * align
            offsets.append(off)
            numels.append(p.numel())
            shapes.append(p.shape)
            off += p.numel()
        specs.append(BucketSpec(i, tuple(names), tuple(offsets), tuple(numels), tuple(shapes),
                                off, p0.dtype, p0.element_size()))
    return specs


def bucket_nbytes(specs: Sequence[BucketSpec]) -> list[int]:
    """Size in bytes of every bucket, in plan order."""
    return [s.nbytes for s in specs]


class FlatBuffers:
    """One replica's flat parameter storage and its gradient buckets.

    Parameters: on construction the current values are copied into ``params[b]`` (one flat
    tensor per bucket) and every parameter's ``.data`` becomes a view into it, so a one-way
    weight copy is one ``copy_`` per bucket.

    Gradients, ``flat_grads=True`` (needed when buckets are all-reduced): ``grads[b]`` is a
    flat tensor per bucket and ``p.grad`` is a view into it, so autograd accumulates every
    micro-batch in place (DDP's ``gradient_as_bucket_view``): :meth:`begin_step` zeroes each
    bucket (one ``zero_`` per bucket) and keeps the views bound, and every backward adds each
    parameter's gradient into its view with one in-place ``add_``. All views of a bucket share
    the flat tensor's version counter, which autograd's in-place accumulation bumps once per
    parameter: :meth:`grad_version` lets one hook per bucket tell whether every parameter of
    the bucket has received this backward's gradient (the aggregation module's notes), with no
    per-parameter Python hook.

    ``flat_grads=False`` (single device, nothing to all-reduce): gradients stay the tensors
    autograd allocates (:meth:`begin_step` sets ``p.grad = None``, autograd hands over a fresh
    gradient); bucket operations act on the per-parameter list (``torch._foreach``).

    Parameters that receive no gradient in a step get a zero gradient (:meth:`finish`; the
    zeroed bucket of DDP), so every bucket is complete.
    """

    def __init__(self, model: nn.Module, specs: Sequence[BucketSpec], flat_grads: bool = True) -> None:
        named = dict(trainable_parameters(model))
        self.specs = list(specs)
        self.flat_grads = flat_grads
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []          # flat per bucket (flat_grads only)
        self.grad_views: list[list[torch.Tensor]] = []
        self.modules_params: list[list[nn.Parameter]] = []
        # parameter name -> (bucket, element offset, numel) in the flat layout
        self._slots = {n: (spec.index, off, k) for spec in self.specs
                       for n, off, k in zip(spec.names, spec.offsets, spec.numels)}
        for spec in self.specs:
            plist = [named[n] for n in spec.names]
            device = plist[0].device
            flat_p = torch.zeros(spec.numel, dtype=spec.dtype, device=device)
            with torch.no_grad():
                for p, off, n, shape in zip(plist, spec.offsets, spec.numels, spec.shapes):
                    flat_p[off:off + n].copy_(p.detach().reshape(-1))
                    p.data = flat_p[off:off + n].view(shape)
            self.params.append(flat_p)
            self.modules_params.append(plist)
            if flat_grads:
                flat_g = torch.zeros(spec.numel, dtype=spec.dtype, device=device)
                views = [flat_g[off:off + n].view(shape)
                         for off, n, shape in zip(spec.offsets, spec.numels, spec.shapes)]
                for p, v in zip(plist, views):
                    p.grad = v
                self.grads.append(flat_g)
                self.grad_views.append(views)
            else:
                for p in plist:
                    p.grad = None

    # -- per step ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start a step's gradients (class notes): flat buckets zeroed, their views bound as
        ``p.grad``; autograd's own gradients dropped (no memset)."""
        if self.flat_grads:
            for g, plist, views in zip(self.grads, self.modules_params, self.grad_views):
                g.zero_()
                for p, v in zip(plist, views):
                    if p.grad is not v:         # e.g. user code replaced p.grad
                        p.grad = v
            return
        for plist in self.modules_params:
            for p in plist:
                p.grad = None

    def grad_version(self, bucket: int) -> int:
        """The version counter of ``bucket``'s flat gradient (shared by its views): grows by one
        for every in-place accumulation into the bucket (flat gradients only)."""
        return self.grads[bucket]._version

    def finish(self) -> None:
        """Give every parameter without a gradient this step a zero gradient (flat buckets: the
        zeroed view). A flat bucket's parameter whose ``p.grad`` is another tensor (autograd
        accumulated out of place, e.g. under ``create_graph``; user code) has that tensor, the
        whole accumulated gradient, copied into its view."""
        for b, plist in enumerate(self.modules_params):
            if not self.flat_grads:
                for p in plist:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                continue
            for p, view in zip(plist, self.grad_views[b]):
                if p.grad is view:
                    continue
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    with torch.no_grad():
                        view.copy_(p.grad)
                p.grad = view

    # -- bucket operations -------------------------------------------------------------------
    def bucket_grads(self, bucket: int) -> list[torch.Tensor]:
        return [p.grad for p in self.modules_params[bucket]]

    def add_bucket_from(self, other: "FlatBuffers", bucket: int) -> None:
        """Local aggregation: ``self[bucket] += other[bucket]``."""
        if self.flat_grads:
            self.grads[bucket].add_(other.grads[bucket])
        else:
            torch._foreach_add_(self.bucket_grads(bucket), other.bucket_grads(bucket))

    def scale_bucket(self, bucket: int, factor: float) -> None:
        if self.flat_grads:
            self.grads[bucket].mul_(factor)
        else:
            torch._foreach_mul_(self.bucket_grads(bucket), factor)

    def bucket_flat_copy(self, bucket: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bucket's gradient as one flat tensor (a copy), layout of ``specs[bucket]``."""
        if self.flat_grads:
            return self.grads[bucket].clone() if out is None else out.copy_(self.grads[bucket])
        spec = self.specs[bucket]
        flat = out if out is not None else torch.empty(spec.numel, dtype=spec.dtype,
                                                       device=self.params[bucket].device)
        flat.zero_()
        for g, off, n in zip(self.bucket_grads(bucket), spec.offsets, spec.numels):
            flat[off:off + n].copy_(g.reshape(-1))
        return flat

    def copy_params_from(self, other: "FlatBuffers", bucket: int | None = None) -> None:
        """One-way weight copy ``other -> self`` for one bucket (or all)."""
        with torch.no_grad():
            if bucket is None:
                for dst, src in zip(self.params, other.params):
                    dst.copy_(src, non_blocking=True)
            else:
                self.params[bucket].copy_(other.params[bucket], non_blocking=True)

    def grads_in_param_order(self, names: Sequence[str], flats: Sequence[torch.Tensor] | None = None
                             ) -> torch.Tensor:
        """Concatenate per-parameter slices of bucket-layout ``flats`` (default: the current
        gradients) in the order of ``names`` into one 1-D tensor."""
        if flats is None:         # torch.cat below copies: no clone of flat buckets needed
            flats = self.grads if self.flat_grads else [self.bucket_flat_copy(b) for b in range(len(self.specs))]
        parts = []
        for n in names:
            b, off, k = self._slots[n]
            parts.append(flats[b][off:off + k])
        return torch.cat(parts) if parts else torch.zeros(0)
