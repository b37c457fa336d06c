"""The ``pack`` primitive: K models trained as one (Pack paper, sections 2.2, 3.1, 3.2).

Implementation notes
--------------------
``pack(models, optimizers, batch_sizes)`` returns a :class:`PackedModel`. One call of
:meth:`PackedModel.train_step` performs one optimizer step of every member on ONE shared input
batch (section 3.2, "shared input stream": the batch is moved to the device once and every
member reads it):

* Members are grouped by ``(architecture, optimizer kind)``. Architecture = module class,
  ``repr`` (which names every layer and activation) and parameter names/shapes/dtypes, so two
  MLPs that differ only in activation are *different* architectures (our call: batching them
  would need a per-member activation switch inside the model; the paper also packs them as
  side-by-side graphs, section 3.2 ``nn_relu``/``nn_sigmoid``).
* A group's parameters live STACKED: one leaf tensor ``S[name]`` of shape ``[G, *shape]``. Each
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
  :func:`_sgd_step`, :func:`_adam_step`, :func:`_adagrad_step`) runs once on the stacked
  tensors with per-member hyperparameters broadcast as ``[G, 1, ...]`` tensors. The
  hyperparameters are read from each member's ``optimizer.param_groups`` at every step, so LR
  schedulers attached to a member's optimizer keep working. Any other optimizer (or an
  unsupported flag such as ``amsgrad``/``maximize``) is stepped by the member's own
  ``optimizer.step()`` on gradient views: exact by construction, just not fused.
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

import copy
import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from jabasray.validation import check_choice, check_int

log = logging.getLogger(__name__)

# A stacked leaf is a column block of the flat [G, P] storage (row stride P): its gradient is
# accumulated in place into the matching block of ``gflat`` (what we want); autograd merely
# notes that such a strided grad "may impair performance". Silenced around our backward only.
_LAYOUT_WARNING = "grad and param do not obey the gradient layout contract"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["pack", "PackedModel", "architecture_key", "optimizer_kind", "estimate_memory_bytes", "batchable"]


# ----------------------------------------------------------------------------- classification

def architecture_key(model: nn.Module) -> tuple:
    """Hashable key: members with equal keys are batched together with ``vmap``.

    The key is (class, repr, parameter names/shapes/dtypes). ``repr`` lists every sub-module
    with its arguments (layer sizes, activation classes), so it separates architectures whose
    parameters have the same shapes but whose ``forward`` differs (e.g. ReLU vs Tanh MLPs).
    """
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters())
    return (type(model).__module__, type(model).__qualname__, repr(model), params)


#: Elementwise activation modules that may differ between members of ONE batched group (the
#: folded execution applies each member's own activation to its rows).
ACTIVATION_TYPES = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.GELU, nn.ELU, nn.SiLU,
                    nn.Softplus, nn.Mish, nn.Hardtanh, nn.ReLU6, nn.CELU, nn.SELU)


def structure_key(model: nn.Module) -> tuple:
    """:func:`architecture_key` with every elementwise activation leaf replaced by a
    placeholder: members equal under this key differ at most in their activations."""
    mods = tuple((n, "ACT" if isinstance(m, ACTIVATION_TYPES)
                  else (type(m).__qualname__, m.extra_repr()))
                 for n, m in model.named_modules())
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters())
    return (type(model).__module__, type(model).__qualname__, mods, params)


def _activation_signature(model: nn.Module) -> tuple:
    return tuple((n, repr(m)) for n, m in model.named_modules() if isinstance(m, ACTIVATION_TYPES))


def batchable(model: nn.Module) -> bool:
    """Stacking (vmap or folded layers) needs a buffer-free, deterministic module."""
    if any(True for _ in model.buffers()):
        return False
    return not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())


def optimizer_kind(optimizer: torch.optim.Optimizer, model: nn.Module) -> str:
    """``"sgd"``/``"sgd_momentum"``/``"sgd_nesterov"``, ``"adam"``, ``"adagrad"`` when the fused
    update reproduces it, else ``"generic"``.

    Fusing needs one parameter group holding exactly ``model.parameters()`` in order, float
    hyperparameters and none of the flags our fused forms do not implement.
    """
    if len(optimizer.param_groups) != 1:
        return "generic"
    g = optimizer.param_groups[0]
    if [id(p) for p in g["params"]] != [id(p) for p in model.parameters()]:
        return "generic"
    if g.get("maximize") or g.get("differentiable") or g.get("capturable") or g.get("fused"):
        return "generic"
    if any(isinstance(v, torch.Tensor) for v in g.values() if not isinstance(v, list)):
        return "generic"
    t = type(optimizer)
    if t is torch.optim.SGD:   # split by structure so one group needs one fused update
        return "sgd" if g["momentum"] == 0 else ("sgd_nesterov" if g["nesterov"] else "sgd_momentum")
    if t is torch.optim.Adam and not g.get("amsgrad") and not g.get("decoupled_weight_decay"):
        return "adam"
    if t is torch.optim.Adagrad:
        return "adagrad"
    return "generic"


def estimate_memory_bytes(model: nn.Module, batch_size: int, optimizer_slots: int = 2,
                          activation_floats_per_sample: int | None = None) -> int:
    """Modelled training memory of one member (bytes): weights + gradients + optimizer slots
    + forward activations and their gradients (``activation_floats_per_sample`` per sample,
    default: the sum of the output widths of all weight matrices/filters). A coarse model for
    ``pack_opt``; on a GPU use measured peaks (``torch.cuda.max_memory_allocated``) instead."""
    n_params = sum(p.numel() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    if activation_floats_per_sample is None:
        activation_floats_per_sample = sum(int(p.shape[0]) for p in model.parameters() if p.dim() > 1)
    return int(elem * (n_params * (2 + optimizer_slots) + 2 * batch_size * activation_floats_per_sample))


# ----------------------------------------------------------------------------- fused updates
# Each function is torch.optim's single-tensor update (torch/optim/{sgd,adam,adagrad}.py,
# ``_single_tensor_*``) applied to stacked tensors; per-member hyperparameters are tensors of
# shape [G, 1, ..., 1] (float32, i.e. the same rounding as torch's Python-scalar arguments).

def _sgd_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None, has_buf: bool,
              lr: torch.Tensor, momentum: torch.Tensor | None, dampening: torch.Tensor | None,
              wd: torch.Tensor | None, nesterov: bool) -> None:
    """SGD (torch.optim.SGD docstring):
    ``g <- g + wd*p``; ``b <- g`` (first step) or ``b <- mu*b + (1-tau)*g``;
    ``d <- g + mu*b`` (Nesterov) or ``d <- b``; ``p <- p - lr*d``. ``momentum is None``: d = g."""
    if wd is not None:
        g = g + wd * p
    if momentum is not None:
        assert buf is not None and dampening is not None
        if has_buf:
            buf.mul_(momentum).add_(dampening * g)   # dampening holds (1 - tau)
        else:
            buf.copy_(g)
        g = g + momentum * buf if nesterov else buf
    p.sub_(lr * g)


def _adam_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               one_minus_b1: torch.Tensor, b2: torch.Tensor, one_minus_b2: torch.Tensor,
               step_size: torch.Tensor, bc2_sqrt: torch.Tensor, eps: torch.Tensor,
               wd: torch.Tensor | None) -> None:
    """Adam (torch.optim.Adam docstring): ``g <- g + wd*p``; ``m <- lerp(m, g, 1-b1)``;
    ``v <- b2*v + (1-b2)*g^2``; ``p <- p - (lr/(1-b1^t)) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``."""
    if wd is not None:
        g = g + wd * p
    m.lerp_(g, one_minus_b1)
    sq = g * g                                   # (1-b2)*g*g, as addcmul(v, g, g, value=1-b2)
    v.mul_(b2).add_(sq.mul_(one_minus_b2))
    denom = v.sqrt().div_(bc2_sqrt).add_(eps)    # few temporaries: the update is memory-bound
    p.addcdiv_(m * step_size, denom, value=-1)


def _adagrad_step(p: torch.Tensor, g: torch.Tensor, s: torch.Tensor, clr: torch.Tensor,
                  eps: torch.Tensor, wd: torch.Tensor | None) -> None:
    """Adagrad (torch.optim.Adagrad docstring): ``g <- g + wd*p``; ``s <- s + g^2``;
    ``p <- p - clr * g / (sqrt(s) + eps)`` with ``clr = lr / (1 + (t-1)*lr_decay)``."""
    if wd is not None:
        g = g + wd * p
    s.addcmul_(g, g)
    p.addcdiv_(g * clr, s.sqrt().add_(eps), value=-1)



# ----------------------------------------------------------------------------- batched execution
# Two ways to run G same-architecture members as ONE computation on stacked parameters:
#  * vmap:   torch.vmap(functional_call(template, S, x)) -- works for any buffer-free module.
#  * folded: the member axis is folded into the batch axis ([G*B, ...] activations). Shape ops
#    (flatten, view(-1, ...), pooling, activations) then run unchanged and only the
#    parametrised layers change: Linear -> one batched matmul with the stacked weights, Conv2d ->
#    one grouped convolution (groups = G * groups). A shadow copy of the template has its
#    Linear/Conv2d children replaced by such stacked layers. It avoids vmap's per-op dispatch
#    overhead (about 10x on small CPU models) and is used when every parametrised leaf is a
#    Linear/Conv2d; the first step after a (re)build checks it against a plain forward of one
#    member and falls back to vmap if the model's forward is batch-dependent.

class _Ctx:
    """Rows of the shared input: a layer seeing ``rows`` rows gets the SHARED batch (same
    input for every member); seeing ``G * rows`` rows it gets the folded per-member batch."""
    rows: int = 0


class _StackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ctx: _Ctx) -> None:
        super().__init__()
        self.w, self.b, self.ctx = weight, bias, ctx            # [G, out, in], [G, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        G = self.w.shape[0]
        n = x.shape[0]
        if n == G * self.ctx.rows:                               # folded [G*B, ..., in]
            xf = x.reshape(G, -1, x.shape[-1])
        elif n == self.ctx.rows:                                 # shared [B, ..., in]
            xf = x.reshape(1, -1, x.shape[-1])
        else:
            raise _NotFoldable(f"linear input has {n} rows, expected {self.ctx.rows} or {G * self.ctx.rows}")
        out = torch.matmul(xf, self.w.transpose(1, 2))           # [G, M, out]
        if self.b is not None:
            out = out + self.b.unsqueeze(1)
        return out.reshape(G * self.ctx.rows, *x.shape[1:-1], self.w.shape[1])


class _StackedConv2d(nn.Module):
    def __init__(self, conv: nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor | None, ctx: _Ctx) -> None:
        super().__init__()
        self.w, self.b, self.ctx = weight, bias, ctx            # [G, O, C/g, k, k], [G, O]
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        G, O = self.w.shape[0], self.w.shape[1]
        B = self.ctx.rows
        n, C, H, W = x.shape
        if n == G * B:                                           # [G*B, C, H, W] -> [B, G*C, H, W]
            xg = x.view(G, B, C, H, W).transpose(0, 1).reshape(B, G * C, H, W)
        elif n == B:
            xg = x.repeat(1, G, 1, 1)
        else:
            raise _NotFoldable(f"conv input has {n} rows, expected {B} or {G * B}")
        w = self.w.reshape(G * O, *self.w.shape[2:])
        b = None if self.b is None else self.b.reshape(G * O)
        out = nn.functional.conv2d(xg, w, b, self.stride, self.padding, self.dilation, G * self.groups)
        Ho, Wo = out.shape[-2:]
        return out.view(B, G, O, Ho, Wo).transpose(0, 1).reshape(G * B, O, Ho, Wo)


class _NotFoldable(RuntimeError):
    pass


class _MultiActivation(nn.Module):
    """Member k's own activation on member k's rows of a folded ``[G*B, ...]`` tensor; runs
    of consecutive members with the same activation are one call."""

    def __init__(self, acts: list[nn.Module], ctx: _Ctx) -> None:
        super().__init__()
        self.ctx = ctx
        self.runs: list[tuple[int, int, nn.Module]] = []       # (first member, end, module)
        for k, a in enumerate(acts):
            if self.runs and repr(self.runs[-1][2]) == repr(a):
                lo, _, mod = self.runs[-1]
                self.runs[-1] = (lo, k + 1, mod)
            else:
                self.runs.append((k, k + 1, a))
        self.G = len(acts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = self.ctx.rows
        if x.shape[0] == B and self.G > 1:                     # shared input: fold it first
            x = x.unsqueeze(0).expand(self.G, *x.shape).reshape(self.G * B, *x.shape[1:])
        elif x.shape[0] != self.G * B:
            raise _NotFoldable(f"activation input has {x.shape[0]} rows, expected {B} or {self.G * B}")
        if len(self.runs) == 1:
            return self.runs[0][2](x)
        return torch.cat([mod(x[lo * B:hi * B]) for lo, hi, mod in self.runs])


def _foldable(model: nn.Module) -> bool:
    """Every parametrised leaf is a Linear or a zero-padded Conv2d."""
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            if isinstance(m, nn.Linear):
                continue
            if isinstance(m, nn.Conv2d) and m.padding_mode == "zeros" and not isinstance(m.padding, str):
                continue
            return False
    return True


def _build_folded(models: list[nn.Module], stacked: dict[str, torch.Tensor]) -> Callable | None:
    """Shadow copy of ``models[0]`` whose Linear/Conv2d run on the stacked parameters and whose
    activations are each member's own (``models`` share :func:`structure_key`), or None."""
    template = models[0]
    if not _foldable(template):
        return None
    shadow = copy.deepcopy(template)
    ctx = _Ctx()
    for name, mod in list(shadow.named_modules()):
        if isinstance(mod, ACTIVATION_TYPES) and name:
            acts = [m.get_submodule(name) for m in models]
            if len({repr(a) for a in acts}) > 1:
                parent_name, _, child = name.rpartition(".")
                parent = shadow.get_submodule(parent_name) if parent_name else shadow
                setattr(parent, child, _MultiActivation(acts, ctx))
            continue
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            w = stacked[f"{name}.weight" if name else "weight"]
            b = stacked.get(f"{name}.bias" if name else "bias")
            new = _StackedLinear(w, b, ctx) if isinstance(mod, nn.Linear) else _StackedConv2d(mod, w, b, ctx)
            if not name:
                return None                                       # the model IS one layer: use vmap
            parent_name, _, child = name.rpartition(".")
            parent = shadow.get_submodule(parent_name) if parent_name else shadow
            setattr(parent, child, new)
    for p in list(shadow.parameters()):                           # nothing trainable left
        p.requires_grad_(False)

    def run(_stacked: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        G = next(iter(stacked.values())).shape[0]
        ctx.rows = x.shape[0]
        out = shadow(x)
        return out.reshape(G, x.shape[0], *out.shape[1:])
    return run

# ----------------------------------------------------------------------------- members/groups

@dataclass
class _Member:
    id: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch_size: int
    arch: tuple
    kind: str
    batchable: bool
    structure: tuple = ()
    acts: tuple = ()


@dataclass
class _Run:
    """Consecutive members ``lo..hi-1`` of a group that share one optimizer kind: their rows of
    the flat tensors get ONE fused update; ``state`` slots are ``[hi-lo, P]``."""
    kind: str
    lo: int
    hi: int
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)        # per member (adam/adagrad)
    has_buf: bool = False                                 # sgd momentum buffers exist
    row_has_buf: list[bool] | None = None                 # per member, once a run mixes sgd flavours

    def row_flags(self) -> list[bool]:
        """Per-member "momentum buffer exists" flags (``has_buf`` for every row until a
        mixed SGD run tracked them one by one)."""
        return self.row_has_buf if self.row_has_buf is not None else [self.has_buf] * (self.hi - self.lo)


@dataclass
class _Group:
    """Members executed together. A batched group keeps ALL its parameters in one flat
    ``[G, P]`` tensor (``flat``; gradients in ``gflat``), so a fused optimizer update is a
    handful of tensor ops per run of equal optimizer kinds, not per parameter. ``stacked``
    holds one leaf view ``[G, *shape]`` of ``flat`` per parameter name for the forward."""
    members: list[_Member]
    batched: bool
    kind: str
    names: list[str] = field(default_factory=list)
    layout: dict[str, tuple[int, int, tuple[int, ...]]] = field(default_factory=dict)  # off, numel, shape
    flat: torch.Tensor | None = None
    gflat: torch.Tensor | None = None
    stacked: dict[str, torch.Tensor] = field(default_factory=dict)
    runs: list[_Run] = field(default_factory=list)
    max_batch: int = 0
    vmapped: Callable | None = None
    folded: Callable | None = None
    checked: bool = False
    weights: torch.Tensor | None = None                   # [G, B] loss weights (1/b_k on each prefix)

    def param_view(self, k: int, name: str, t: torch.Tensor | None = None) -> torch.Tensor:
        """Member k's slice of a ``[G, P]`` tensor (default ``flat``) shaped like ``name``."""
        off, n, shape = self.layout[name]
        t = self.flat.data if t is None else t
        return t[k, off:off + n].view(shape)


def _grouped_cross_entropy(out: torch.Tensor, y: torch.Tensor, g: "_Group") -> torch.Tensor:
    """Mean cross-entropy of every member over ITS first ``b_k`` rows, in one call.

    ``out`` is ``[G, B, C]``; per-sample losses ``[G, B]`` are masked to each member's prefix
    and averaged over ``b_k``: the same value and gradient as ``cross_entropy(out[k, :b_k],
    y[:b_k])`` (mean reduction), up to the order of the floating-point sum.
    """
    G, B = out.shape[0], out.shape[1]
    per = nn.functional.cross_entropy(out.permute(0, 2, 1), y.unsqueeze(0).expand(G, B), reduction="none")
    if g.weights is None or g.weights.shape != per.shape or g.weights.device != per.device:
        w = torch.zeros(G, B, dtype=per.dtype, device=per.device)
        for k, m in enumerate(g.members):
            w[k, :m.batch_size] = 1.0 / m.batch_size
        g.weights = w
    return (per * g.weights).sum(1)


def _col(vals: Sequence[float], ref: torch.Tensor) -> torch.Tensor:
    """Per-member scalars as a ``[G, 1]`` tensor (dtype of ``ref``: the same float32 rounding
    torch applies to a Python-scalar optimizer argument)."""
    return torch.tensor(list(vals), dtype=ref.dtype, device=ref.device).view(-1, 1)


class PackedModel:
    """K models trained as one; see the module docstring. Build it with :func:`pack`.

    Members are identified by integer ids (``0..K-1`` for the models given to :func:`pack`,
    then increasing ids for :meth:`load`). :meth:`train_step` returns the losses in the order
    of :attr:`member_ids`.
    """

    def __init__(self, loss_fn: LossFn = nn.functional.cross_entropy, execution: str = "auto") -> None:
        check_choice("execution", execution, ("auto", "vmap"))
        self.loss_fn = loss_fn
        self.execution = execution
        self._members: dict[int, _Member] = {}
        self._groups: list[_Group] = []
        self._relax = True          # batch members differing only in activations (folded path)
        self._next_id = 0
        self.device: torch.device | None = None

    # -- public API --------------------------------------------------------------------------
    @property
    def member_ids(self) -> list[int]:
        return sorted(self._members)

    @property
    def batch_sizes(self) -> list[int]:
        return [self._members[i].batch_size for i in self.member_ids]

    @property
    def max_batch_size(self) -> int:
        return max(self.batch_sizes, default=0)

    def __len__(self) -> int:
        return len(self._members)

    def model(self, member: int) -> nn.Module:
        """Member's module; its parameters alias the pack's stacked storage (current weights)."""
        return self._get(member).model

    def optimizer(self, member: int) -> torch.optim.Optimizer:
        """Member's optimizer (its ``param_groups`` are live; its ``state`` is synced on free)."""
        return self._get(member).optimizer

    def groups(self) -> list[tuple[list[int], bool, str]]:
        """``(member ids, batched with vmap?, optimizer kind)`` of each execution group."""
        return [([m.id for m in g.members], g.batched,
                 "+".join(r.kind for r in g.runs) if g.batched else g.kind) for g in self._groups]

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int) -> int:
        """Add a member (the paper's ``load``); returns its id. Its weights, optimizer type,
        hyperparameters and state are taken over."""
        check_int("batch_size", batch_size, min_value=1)
        self._check_member(model, optimizer)
        self._flush()
        mid = self._add(model, optimizer, int(batch_size))
        self._build()
        return mid

    def _check_member(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        opt_ids = {id(p) for grp in optimizer.param_groups for p in grp["params"]}
        if not opt_ids or not opt_ids <= {id(p) for p in model.parameters()}:
            raise ValueError("optimizer must be built on the parameters of its model "
                             "(every optimized tensor must be one of model.parameters())")
        dev = next(model.parameters()).device
        if self.device is None:
            self.device = dev
        elif dev != self.device:
            raise ValueError(f"model device must be {self.device} like the other members, got {dev}")
        for m in self._members.values():
            if m.model is model:
                raise ValueError("model is already a member of this pack")

    def _add(self, model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int) -> int:
        mid = self._next_id
        self._next_id += 1
        self._members[mid] = _Member(mid, model, optimizer, batch_size, architecture_key(model),
                                     optimizer_kind(optimizer, model), batchable(model),
                                     structure_key(model), _activation_signature(model))
        return mid

    def free(self, member: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Remove a member (the paper's ``free``) and return its model and optimizer, holding
        the trained weights and optimizer state; the pack goes on with the rest."""
        m = self._get(member)
        self._flush()
        del self._members[member]
        self._build()
        return m.model, m.optimizer

    def sync(self) -> None:
        """Write the stacked weights and optimizer state back into every member's own module
        and optimizer (their ``state_dict``s are then current); the pack goes on."""
        self._flush()
        self._build()

    def free_all(self) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
        """Free every member (in :attr:`member_ids` order)."""
        self._flush()
        out = [(self._members[i].model, self._members[i].optimizer) for i in self.member_ids]
        self._members.clear()
        self._groups = []
        return out

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[float]:
        """One optimizer step of every member on one shared batch (returns K mean losses).

        ``inputs``/``targets`` hold at least ``max(batch_sizes)`` samples; member k trains on
        the first ``batch_sizes[k]`` of them (section 3.1.1).
        """
        losses = self.train_step_tensor(inputs, targets)
        return losses.tolist()

    def train_step_tensor(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`train_step` returning the losses as one detached 1-D tensor (no host sync)."""
        try:
            return self._train_step(inputs, targets)
        except _Regroup:                 # nothing was updated yet: regroup exactly and redo
            self._relax = False
            self._flush()
            self._build()
            return self._train_step(inputs, targets)

    def _train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self._members:
            raise ValueError("the pack has no members; load() one first")
        need = self.max_batch_size
        if inputs.shape[0] < need or targets.shape[0] < need:
            raise ValueError(f"inputs must hold at least max(batch_sizes) = {need} samples, "
                             f"got {inputs.shape[0]} inputs and {targets.shape[0]} targets")
        x = inputs.to(self.device, non_blocking=True)     # shared input stream: one copy
        y = targets.to(self.device, non_blocking=True)
        vectors: list[torch.Tensor] = []           # per group: its members' losses, [G]
        ids: list[int] = []                        # member id of every entry, in that order
        for g in self._groups:
            if g.batched:
                g.gflat.zero_()
                out = self._group_forward(g, x[:g.max_batch])        # [G, B_g, ...]
                if self.loss_fn is nn.functional.cross_entropy and out.dim() == 3:
                    vectors.append(_grouped_cross_entropy(out, y[:g.max_batch], g))
                else:
                    vectors.append(torch.stack([self.loss_fn(out[k, :m.batch_size], y[:m.batch_size])
                                                for k, m in enumerate(g.members)]))
            else:
                (m,) = g.members
                m.optimizer.zero_grad(set_to_none=True)
                b = m.batch_size
                vectors.append(self.loss_fn(m.model(x[:b]), y[:b]).reshape(1))
            ids.extend(m.id for m in g.members)
        flat = torch.cat(vectors) if len(vectors) > 1 else vectors[0]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LAYOUT_WARNING)
            flat.sum().backward()                  # members share nothing: sum = K separate losses
        with torch.no_grad():
            for g in self._groups:
                self._step_group(g)
        losses = flat.detach()
        if ids != self.member_ids:                 # report in member-id order
            pos = {mid: i for i, mid in enumerate(ids)}
            losses = losses[torch.tensor([pos[i] for i in self.member_ids], device=losses.device)]
        return losses

    # -- internals ---------------------------------------------------------------------------
    def _group_forward(self, g: _Group, xb: torch.Tensor) -> torch.Tensor:
        if g.checked:
            return g.folded(g.stacked, xb) if g.folded is not None else g.vmapped(g.stacked, xb)
        # first step after a (re)build: check the batched forward against every member's own
        # module (member k's params alias row k of the stacked tensors)
        out, ok = None, False
        if g.folded is not None:
            try:
                out = g.folded(g.stacked, xb)
                ok = self._agrees(g, out, xb)
            except (_NotFoldable, RuntimeError) as e:           # batch-dependent forward
                log.debug("folded execution not usable (%s)", e)
            if not ok:
                log.info("pack group %s: folded execution disagrees with the modules; using vmap",
                         [m.id for m in g.members])
                g.folded = None
                if len({m.arch for m in g.members}) > 1:        # vmap needs ONE architecture
                    raise _Regroup()
        if g.folded is None:
            out = g.vmapped(g.stacked, xb)
        g.checked = True
        return out

    @staticmethod
    def _agrees(g: _Group, out: torch.Tensor, xb: torch.Tensor) -> bool:
        with torch.no_grad():
            for k, m in enumerate(g.members):
                ref = m.model(xb)
                if out.shape[1:] != ref.shape or not torch.allclose(out[k].detach(), ref, rtol=1e-4, atol=1e-5):
                    return False
        return True

    def _get(self, member: int) -> _Member:
        if member not in self._members:
            raise ValueError(f"member must be one of {self.member_ids}, got {member!r}")
        return self._members[member]

    def _build(self) -> None:
        """Group members and stack each batched group's parameters and optimizer state.

        Batchable members sharing :func:`structure_key` (same layers, activations may differ)
        form one group when the structure can run folded; otherwise the exact
        :func:`architecture_key` decides. Inside a group members are ordered by (optimizer
        kind, activations, id) so that each optimizer kind is one contiguous run of rows.
        """
        buckets: dict[tuple, list[_Member]] = {}
        groups: list[_Group] = []
        for mid in self.member_ids:
            m = self._members[mid]
            if m.batchable:
                relaxed = self._relax and self.execution == "auto" and _foldable(m.model)
                buckets.setdefault(("s", m.structure) if relaxed else ("a", m.arch), []).append(m)
            else:
                groups.append(_Group([m], batched=False, kind=m.kind))
        for members in buckets.values():
            members = sorted(members, key=lambda m: (m.kind, m.acts, m.id))
            groups.append(self._stack(members))
        self._groups = groups
        log.debug("pack regrouped: %s", self.groups())

    def _stack(self, members: list[_Member]) -> _Group:
        g = _Group(members, batched=True, kind="batched")
        g.max_batch = max(m.batch_size for m in members)
        named = [dict(m.model.named_parameters()) for m in members]
        g.names = list(named[0])
        off = 0
        for n in g.names:
            t = named[0][n]
            g.layout[n] = (off, t.numel(), tuple(t.shape))
            off += t.numel()
        G = len(members)
        ref = named[0][g.names[0]]
        with torch.no_grad():
            g.flat = torch.empty(G, off, dtype=ref.dtype, device=ref.device)
            g.gflat = torch.zeros_like(g.flat)
            for k, d in enumerate(named):
                for n in g.names:
                    g.param_view(k, n).copy_(d[n])
                    d[n].data = g.param_view(k, n)       # member param aliases its slice
                    d[n].grad = None
            for n in g.names:
                o, c, shape = g.layout[n]
                leaf = g.flat[:, o:o + c].view(G, *shape).detach().requires_grad_(True)
                leaf.grad = g.gflat[:, o:o + c].view(G, *shape)   # backward accumulates here
                g.stacked[n] = leaf
        lo = 0
        for k in range(1, G + 1):                            # runs of equal optimizer kind
            if k == G or members[k].kind != members[lo].kind:
                run = _Run(members[lo].kind, lo, k)
                self._read_state(g, run, named)
                g.runs.append(run)
                lo = k
        template = members[0].model

        def fwd(params: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
            return functional_call(template, params, (xb,))

        g.vmapped = torch.vmap(fwd, in_dims=(0, None))
        g.folded = _build_folded([m.model for m in members], g.stacked) if self.execution == "auto" else None
        return g

    def _gather(self, g: _Group, run: _Run, named: list[dict[str, nn.Parameter]], key: str) -> torch.Tensor:
        """Stack optimizer slot ``key`` of the run's members into one ``[hi-lo, P]`` tensor."""
        out = torch.zeros(run.hi - run.lo, g.flat.shape[1], dtype=g.flat.dtype, device=g.flat.device)
        for r, k in enumerate(range(run.lo, run.hi)):
            o = g.members[k].optimizer
            for n in g.names:
                v = o.state.get(named[k][n], {}).get(key)
                if v is not None:
                    g.param_view(r, n, out).copy_(v)
        return out

    def _read_state(self, g: _Group, run: _Run, named: list[dict[str, nn.Parameter]]) -> None:
        """Take over the run's optimizer state as flat ``[hi-lo, P]`` slots."""
        ks = range(run.lo, run.hi)
        opts = {k: g.members[k].optimizer for k in ks}
        if run.kind.startswith("sgd") and run.kind != "sgd":
            status = {opts[k].state.get(named[k][n], {}).get("momentum_buffer") is not None
                      for n in g.names for k in ks}
            if len(status) > 1:
                # some members past their first step, some not: let each member's own optimizer
                # step (exact, rare: only when members join mid-training)
                run.kind = "generic"
                return
            run.has_buf = status == {True}
            run.state["buf"] = self._gather(g, run, named, "momentum_buffer")
        elif run.kind == "adam":
            run.steps = [self._step_of(opts[k], named[k]) for k in ks]
            run.state["m"] = self._gather(g, run, named, "exp_avg")
            run.state["v"] = self._gather(g, run, named, "exp_avg_sq")
        elif run.kind == "adagrad":
            run.steps = [self._step_of(opts[k], named[k]) for k in ks]
            run.state["sum"] = self._gather(g, run, named, "sum")

    @staticmethod
    def _step_of(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter]) -> int:
        counts = {int(float(opt.state.get(p, {}).get("step", 0))) for p in params.values()}
        if len(counts) != 1:
            raise ValueError(f"optimizer state must have one step count for all parameters, got {sorted(counts)}")
        return counts.pop()

    def _step_group(self, g: _Group) -> None:
        if not g.batched:
            g.members[0].optimizer.step()
            return
        for run in g.runs:
            self._step_run(g, run)

    def _step_run(self, g: _Group, run: _Run) -> None:
        members = g.members[run.lo:run.hi]
        hp = [m.optimizer.param_groups[0] for m in members]
        p, grad = g.flat.data[run.lo:run.hi], g.gflat[run.lo:run.hi]
        if run.kind == "generic":
            for k, m in zip(range(run.lo, run.hi), members):
                named = dict(m.model.named_parameters())
                for n in g.names:
                    named[n].grad = g.param_view(k, n, g.gflat)
                m.optimizer.step()
            return
        use_wd = any(h["weight_decay"] != 0 for h in hp)
        wd = _col([h["weight_decay"] for h in hp], p) if use_wd else None
        if run.kind.startswith("sgd"):
            moms = [h["momentum"] for h in hp]
            has_state = "buf" in run.state
            if not has_state and any(moms):                  # momentum switched on mid-pack
                run.state["buf"] = torch.zeros_like(p)
            if any(moms) and (not all(moms) or len({bool(h["nesterov"]) for h in hp}) != 1
                              or not has_state):
                self._sgd_mixed(run, p, grad, hp)
            elif any(moms):
                _sgd_step(p, grad, run.state["buf"], run.has_buf, _col([h["lr"] for h in hp], p),
                          _col(moms, p), _col([1 - h["dampening"] for h in hp], p), wd,
                          bool(hp[0]["nesterov"]))
                run.has_buf = True
            else:
                _sgd_step(p, grad, None, False, _col([h["lr"] for h in hp], p), None, None, wd, False)
        elif run.kind == "adam":
            run.steps = [s + 1 for s in run.steps]
            b1 = [h["betas"][0] for h in hp]
            b2 = [h["betas"][1] for h in hp]
            # Python-double scalar arithmetic exactly as torch's _single_tensor_adam
            step_size = [h["lr"] / (1 - bb1 ** t) for h, bb1, t in zip(hp, b1, run.steps)]
            bc2_sqrt = [(1 - bb2 ** t) ** 0.5 for bb2, t in zip(b2, run.steps)]
            _adam_step(p, grad, run.state["m"], run.state["v"], _col([1 - b for b in b1], p),
                       _col(b2, p), _col([1 - b for b in b2], p), _col(step_size, p),
                       _col(bc2_sqrt, p), _col([h["eps"] for h in hp], p), wd)
        elif run.kind == "adagrad":
            run.steps = [s + 1 for s in run.steps]
            clr = [h["lr"] / (1 + (t - 1) * h["lr_decay"]) for h, t in zip(hp, run.steps)]
            _adagrad_step(p, grad, run.state["sum"], _col(clr, p), _col([h["eps"] for h in hp], p), wd)

    @staticmethod
    def _sgd_mixed(run: _Run, p: torch.Tensor, grad: torch.Tensor, hp: list[dict]) -> None:
        """SGD run mixing momentum-0 / Nesterov / heavy-ball members: one row at a time."""
        buf = run.state["buf"]
        flags = run.row_has_buf = run.row_flags()

        def one(v: float) -> torch.Tensor:
            return torch.tensor(v, dtype=p.dtype, device=p.device)

        for r, h in enumerate(hp):
            wd = one(h["weight_decay"]) if h["weight_decay"] != 0 else None
            if h["momentum"] != 0:
                _sgd_step(p[r], grad[r], buf[r], flags[r], one(h["lr"]), one(h["momentum"]),
                          one(1 - h["dampening"]), wd, bool(h["nesterov"]))
                flags[r] = True
            else:
                _sgd_step(p[r], grad[r], None, False, one(h["lr"]), None, None, wd, False)
        run.has_buf = all(flags)

    def _flush(self) -> None:
        """Write stacked weights/state back into every member (params get their own storage)."""
        with torch.no_grad():
            for g in self._groups:
                if not g.batched:
                    continue
                for run in g.runs:
                    flags = run.row_flags()
                    for r, k in enumerate(range(run.lo, run.hi)):
                        m = g.members[k]
                        named = dict(m.model.named_parameters())
                        opt = m.optimizer
                        mom = opt.param_groups[0].get("momentum", 0)
                        for n in g.names:
                            p = named[n]
                            p.data = g.param_view(k, n).clone()
                            p.grad = g.param_view(k, n, g.gflat).clone()
                            if run.kind.startswith("sgd") and "buf" in run.state and flags[r] and mom != 0:
                                opt.state[p]["momentum_buffer"] = g.param_view(r, n, run.state["buf"]).clone()
                            elif run.kind == "adam" and run.steps[r] > 0:
                                st = opt.state[p]
                                st["step"] = torch.tensor(float(run.steps[r]), dtype=torch.float32)
                                st["exp_avg"] = g.param_view(r, n, run.state["m"]).clone()
                                st["exp_avg_sq"] = g.param_view(r, n, run.state["v"]).clone()
                            elif run.kind == "adagrad":
                                st = opt.state[p]
                                st["step"] = torch.tensor(float(run.steps[r]), dtype=torch.float32)
                                st["sum"] = g.param_view(r, n, run.state["sum"]).clone()
        self._groups = []


class _Regroup(Exception):
    """A relaxed group cannot run folded: rebuild with exact architectures and retry."""


def pack(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
         batch_sizes: Sequence[int], loss_fn: LossFn = nn.functional.cross_entropy,
         execution: str = "auto") -> PackedModel:
    """Pack K models (with their optimizers and batch sizes) into one :class:`PackedModel`.

    Member k gets id k. ``loss_fn(outputs, targets)`` must return the mean loss of a batch.
    ``execution``: ``"auto"`` (folded batched layers where possible, else vmap) or ``"vmap"``.
    """
    if not (len(models) == len(optimizers) == len(batch_sizes)):
        raise ValueError(f"models, optimizers and batch_sizes must have the same length, got "
                         f"{len(models)}, {len(optimizers)} and {len(batch_sizes)}")
    if len(models) == 0:
        raise ValueError("models must hold at least one model, got 0")
    p = PackedModel(loss_fn, execution)
    for k, (m, o, b) in enumerate(zip(models, optimizers, batch_sizes)):
        check_int(f"batch_sizes[{k}]", b, min_value=1)
        p._check_member(m, o)
        p._add(m, o, int(b))
    p._build()
    return p
