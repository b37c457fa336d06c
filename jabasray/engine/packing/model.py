"""``PackedModel`` and ``pack``: K models trained as one (see :mod:`jabasray.engine.packing`)."""
from __future__ import annotations

import logging
import warnings
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.func import functional_call

from jabasray.config import CUDA_GRAPH_MODES
from jabasray.engine.packing.folded import NotFoldable, build_folded, foldable
from jabasray.engine.packing.graphed import PackGraphs
from jabasray.engine.packing.keys import (activation_signature, architecture_key, batchable,
                                          optimizer_kind, structure_key)
from jabasray.engine.packing.state import (_Group, _Member, _Run, flush_run,
                                           grouped_cross_entropy, read_state, write_member)
from jabasray.engine.packing.update import advance_run, columns, member_hps, step_run
from jabasray.validation import check_choice, check_int

log = logging.getLogger(__name__)

# A stacked leaf is a column block of the flat [K_g, P] storage (row stride P): its gradient is
# accumulated in place into the matching block of ``gflat`` (what we want); autograd merely
# notes that such a strided grad "may impair performance". Silenced around our backward only.
_LAYOUT_WARNING = "grad and param do not obey the gradient layout contract"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["PackedModel", "pack"]


class PackedModel:
    """K models trained as one; see the module docstring. Build it with :func:`pack`.

    Members are identified by integer ids (``0..K-1`` for the models given to :func:`pack`,
    then increasing ids for :meth:`load`). :meth:`train_step` returns the losses in the order
    of :attr:`member_ids`.

    ``cuda_graphs``: ``"auto"`` (default) replays the packed step as ONE CUDA graph on a CUDA
    device while the pack's membership and batch shape stay the same (re-captured after every
    restack; an eager fallback with one log line where it cannot be captured), ``"off"``: always
    eager. See :mod:`jabasray.engine.packing.graphed` for what is captured and what invalidates
    a graph.
    """

    def __init__(self, loss_fn: LossFn = nn.functional.cross_entropy, execution: str = "auto",
                 cuda_graphs: str = "auto") -> None:
        check_choice("execution", execution, ("auto", "vmap"))
        check_choice("cuda_graphs", cuda_graphs, CUDA_GRAPH_MODES)
        self.loss_fn = loss_fn
        self.execution = execution
        self._graphs = PackGraphs(self, cuda_graphs)
        self._members: dict[int, _Member] = {}
        self._groups: list[_Group] = []
        self._relax = True          # batch members differing only in activations (folded path)
        self._next_id = 0
        self._order: torch.Tensor | None = None    # losses -> member-id order, per (re)build
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

    @property
    def cuda_graphs(self) -> str:
        """The CUDA-graph mode: ``"auto"`` or ``"off"``."""
        return self._graphs.mode

    @property
    def last_step_graphed(self) -> bool:
        """Whether the last :meth:`train_step` was a replay of a captured CUDA graph."""
        return self._graphs.last_graphed

    def graph_fallback_reason(self) -> str | None:
        """Why packed steps run eagerly (``None``: they are, or will be, captured as a graph)."""
        return self._graphs.fallback_reason()

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
                                     structure_key(model), activation_signature(model))
        return mid

    def free(self, member: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Remove a member (the paper's ``free``) and return its model and optimizer, holding
        the trained weights and optimizer state; the pack goes on with the rest."""
        m = self._get(member)
        self._flush()
        del self._members[member]
        self._build()
        return m.model, m.optimizer

    def update(self, free: Sequence[int] = (),
               load: Sequence[tuple[nn.Module, torch.optim.Optimizer, int]] = ()) -> list[int]:
        """Free the members ``free`` and load the ``(model, optimizer, batch_size)`` members
        ``load`` with ONE write-back and ONE restack (joins and leaves of a unit boundary
        applied together); returns the new members' ids. The freed members' modules and
        optimizers hold their trained state, as after :meth:`free`."""
        for mid in free:
            self._get(mid)
        for k, (model, optimizer, b) in enumerate(load):
            check_int(f"load[{k}] batch_size", b, min_value=1)
            self._check_member(model, optimizer)
        self._flush()
        for mid in free:
            del self._members[mid]
        ids = [self._add(model, optimizer, int(b)) for model, optimizer, b in load]
        self._build()
        return ids

    def _flush(self) -> None:
        """Write stacked weights/state back into every member (params get their own storage)."""
        with torch.no_grad():
            for g in self._groups:
                if g.batched:
                    for run in g.runs:
                        flush_run(g, run)
        self._groups = []
        self._graphs.invalidate()           # the stacked tensors a graph read are gone

    def sync(self) -> None:
        """Write the stacked weights and optimizer state back into every member's own module
        and optimizer (their ``state_dict``s are then current); the pack goes on."""
        self._flush()
        self._build()

    def member_state(self, member: int) -> tuple[dict, dict]:
        """``(model.state_dict(), optimizer.state_dict())`` of one member, read from its rows
        of the stacked storage WITHOUT a restack (the pack goes on untouched). Every tensor is
        a copy owning its storage: a saved state holds this member's tensors only, whatever
        the pack's size (a view into the stacked ``[K_g, P]`` storage would save all of it)."""
        m = self._get(member)
        with torch.no_grad():
            for g in self._groups:
                if g.batched and m in g.members:
                    k = g.members.index(m)
                    run = next(r for r in g.runs if r.lo <= k < r.hi)
                    write_member(g, run, k - run.lo, weights=False)
            return _owned(m.model.state_dict()), _owned(m.optimizer.state_dict())

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
        return self._graphs.step(inputs, targets)

    def _eager_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One packed step, eagerly: :meth:`_step_body`, then :meth:`_advance`."""
        losses = self._step_body(inputs, targets)
        self._advance()
        return losses

    def _step_body(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The device work of one packed step (what a CUDA graph captures): every group's
        forward, the summed loss, ONE backward, every group's optimizer update; returns the
        losses in member-id order. Host bookkeeping of the step (step counts, momentum-buffer
        flags) is left to :meth:`_advance`, so a replay can advance it without this body."""
        x = inputs.to(self.device, non_blocking=True)     # shared input stream: one copy
        y = targets.to(self.device, non_blocking=True)
        vectors: list[torch.Tensor] = []           # per group: its members' losses, [K_g]
        ids: list[int] = []                        # member id of every entry, in that order
        for g in self._groups:
            if g.batched:
                g.gflat.zero_()
                out = self._group_forward(g, x[:g.max_batch])        # [K_g, B_g, ...]
                if self.loss_fn is nn.functional.cross_entropy and out.dim() == 3:
                    vectors.append(grouped_cross_entropy(out, y[:g.max_batch], g))
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
            if self._order is None or self._order.device != losses.device:   # once per (re)build
                self._order = torch.tensor([pos[i] for i in self.member_ids], device=losses.device)
            losses = losses[self._order]
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
            except (NotFoldable, RuntimeError) as e:           # batch-dependent forward
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
                relaxed = self._relax and self.execution == "auto" and foldable(m.model)
                buckets.setdefault(("s", m.structure) if relaxed else ("a", m.arch), []).append(m)
            else:
                groups.append(_Group([m], batched=False, kind=m.kind))
        for members in buckets.values():
            members = sorted(members, key=lambda m: (m.kind, m.acts, m.id))
            groups.append(self._stack(members))
        self._groups = groups
        self._order = None
        self._graphs.invalidate()
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
        K_g = len(members)
        ref = named[0][g.names[0]]
        with torch.no_grad():
            g.flat = torch.empty(K_g, off, dtype=ref.dtype, device=ref.device)
            g.gflat = torch.zeros_like(g.flat)
            for k, d in enumerate(named):
                for n in g.names:
                    g.param_view(k, n).copy_(d[n])
                    d[n].data = g.param_view(k, n)       # member param aliases its slice
                    d[n].grad = None
            for n in g.names:
                o, c, shape = g.layout[n]
                leaf = g.flat[:, o:o + c].view(K_g, *shape).detach().requires_grad_(True)
                leaf.grad = g.gflat[:, o:o + c].view(K_g, *shape)   # backward accumulates here
                g.stacked[n] = leaf
        lo = 0
        for k in range(1, K_g + 1):                            # runs of equal optimizer kind
            if k == K_g or members[k].kind != members[lo].kind:
                run = _Run(members[lo].kind, lo, k)
                read_state(g, run, named)
                g.runs.append(run)
                lo = k
        template = members[0].model

        def fwd(params: dict[str, torch.Tensor], xb: torch.Tensor) -> torch.Tensor:
            return functional_call(template, params, (xb,))

        g.vmapped = torch.vmap(fwd, in_dims=(0, None))
        g.folded = build_folded([m.model for m in members], g.stacked) if self.execution == "auto" else None
        return g


    def _step_group(self, g: _Group) -> None:
        if not g.batched:
            g.members[0].optimizer.step()
            return
        for run in g.runs:
            step_run(g, run)

    def _fused_runs(self) -> Iterator[tuple[_Group, _Run]]:
        """``(group, run)`` of every run updated by the fused optimizer step."""
        for g in self._groups:
            if g.batched:
                yield from ((g, run) for run in g.runs if run.kind != "generic")

    def _advance(self) -> None:
        """The host bookkeeping of one packed step (after its device work, eager or replayed)."""
        for g, run in self._fused_runs():
            advance_run(run, member_hps(g, run))

    def _refill_columns(self) -> None:
        """Bring every fused run's device columns up to date (refilled in place)."""
        for g, run in self._fused_runs():
            columns(run, member_hps(g, run), g.flat.data[run.lo:run.hi])


def _owned(tree):
    """A copy of a (nested) state dict whose tensors own their storage (detached clones)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return type(tree)((k, _owned(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_owned(v) for v in tree)
    return tree


class _Regroup(Exception):
    """A relaxed group cannot run folded: rebuild with exact architectures and retry."""


def pack(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
         batch_sizes: Sequence[int], loss_fn: LossFn = nn.functional.cross_entropy,
         execution: str = "auto", cuda_graphs: str = "auto") -> PackedModel:
    """Pack K models (with their optimizers and batch sizes) into one :class:`PackedModel`.

    Member k gets id k. ``loss_fn(outputs, targets)`` must return the mean loss of a batch.
    ``execution``: ``"auto"`` (folded batched layers where possible, else vmap) or ``"vmap"``.
    ``cuda_graphs``: ``"auto"`` (the packed step replayed as a CUDA graph where possible) or
    ``"off"`` (see :class:`PackedModel`).
    """
    if not (len(models) == len(optimizers) == len(batch_sizes)):
        raise ValueError(f"models, optimizers and batch_sizes must have the same length, got "
                         f"{len(models)}, {len(optimizers)} and {len(batch_sizes)}")
    if len(models) == 0:
        raise ValueError("models must hold at least one model, got 0")
    p = PackedModel(loss_fn, execution, cuda_graphs)
    for k, (m, o, b) in enumerate(zip(models, optimizers, batch_sizes)):
        check_int(f"batch_sizes[{k}]", b, min_value=1)
        p._check_member(m, o)
        p._add(m, o, int(b))
    p._build()
    return p
