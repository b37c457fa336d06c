"""The packed step as ONE CUDA graph, replayed while the pack's membership and batch stay the same.

What is captured (:meth:`PackGraphs._capture`): one whole packed step of a
:class:`~jabasray.engine.packing.PackedModel` on static input buffers -- every batched group's
gradient reset (``gflat.zero_()``), its forward (folded layers or ``vmap(functional_call)``),
the per-member losses, the ONE backward of their sum and every run's fused optimizer update
(:mod:`.fused`). The updates read their hyper-parameters from the run's device columns and
Adam's/Adagrad's bias corrections from the run's device step counter ``t``, which the graph
itself increments (torch's ``capturable`` semantics); the gradients accumulate into the static
``gflat`` storage. The losses (member-id order) are the graph's static output: each step
returns a device copy of them (nothing is read on the host).

The recipe is :mod:`jabasray.engine.graphs`' (PyTorch's whole-network capture), whose parts are
reused: :class:`~jabasray.engine.graphs.GraphCache` (keys, warm-up counts, LRU of one graph,
thrash check), :func:`~jabasray.engine.graphs.captured_for` (warm-up / memory check / capture
/ failure -> eager for good), :func:`~jabasray.engine.graphs.cuda_capture`. The eager warm-up
steps of a key run on a side stream (:func:`side_stream`); capture records and executes
nothing, so the step it was captured for is run by the first replay. A replay copies the batch
into the static buffers (``copy_``), replays, then advances the host bookkeeping the eager step
advances (Adam/Adagrad step counts, SGD momentum-buffer flags: :meth:`PackedModel._advance`).

Hyper-parameters: :func:`.update.columns` refills a run's device columns IN PLACE when a
value changes (an LR scheduler, a changed weight decay value), before the key is taken: the
replay reads the new values from the tensors the graph was captured with; no re-capture.

What invalidates a graph (:func:`pack_graph_key`): a restack (``load``/``free``/``update``/
``sync``, a regroup: the cache is cleared and the build counter is part of the key), another
input shape, dtype or device, a hyper-parameter change that changes the update's code path
rather than a column's value (momentum or weight decay switched on/off, Nesterov, a new set of
columns), a change of the momentum-buffer flags, a group switching from folded to vmap.

Where the packed step cannot be captured it runs eagerly and ONE log line names the reason
(:func:`pack_device_blocker`: ``cuda_graphs="off"``, not a CUDA device;
:func:`pack_groups_blocker`: a member run unbatched (buffers or dropout), a run stepped through
the members' own ``optimizer.step()``; and from the cache: a failed capture, too little memory,
keys changing too often).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from jabasray.engine import graphs, streams
from jabasray.engine.packing.state import _Group

if TYPE_CHECKING:                                     # pragma: no cover
    from jabasray.engine.packing.model import PackedModel

log = logging.getLogger(__name__)

__all__ = ["PackGraphs", "CapturedPack", "pack_device_blocker", "pack_groups_blocker",
           "pack_graph_key", "run_structure", "side_stream"]

EAGER_LINE = "pack: eager packed step (no CUDA graph: %s)"


def pack_device_blocker(mode: str, device: torch.device | None) -> str | None:
    """Why no packed step of this pack is captured (the mode, the device), or ``None``."""
    if mode == "off":
        return "cuda_graphs='off'"
    if device is None or torch.device(device).type != "cuda":
        return f"device {device} is not CUDA"
    return None


def pack_groups_blocker(groups: Sequence[_Group]) -> str | None:
    """Why the packed step of these groups cannot be captured, or ``None``: a member run
    unbatched (its own module: buffers or dropout) or a run whose members step through their
    own ``optimizer.step()`` (host-side optimizer state, Python-number hyper-parameters)."""
    for g in groups:
        ids = [m.id for m in g.members]
        if not g.batched:
            return (f"member {ids[0]} runs unbatched (buffers or dropout) with its own "
                    "optimizer.step()")
        for run in g.runs:
            if run.kind == "generic":
                return (f"members {ids[run.lo:run.hi]} step through their own optimizer.step() "
                        "(an optimizer or state the fused update does not cover)")
    return None


def run_structure(run: Any, hp: Sequence[dict]) -> tuple:
    """What a run's captured update depends on besides its column VALUES: its kind, the set
    and generation of its device columns (a rebuilt column is a new tensor), its stacked
    slots, its momentum-buffer flags and each member's code-path flags (momentum on, Nesterov,
    weight decay on)."""
    flags = tuple((h.get("momentum", 0) != 0, bool(h.get("nesterov", False)),
                   h.get("weight_decay", 0) != 0) for h in hp)
    return (run.kind, tuple(sorted(run.cols)), run.cols_gen, tuple(sorted(run.state)),
            run.has_buf, tuple(run.row_flags()), flags)


def pack_graph_key(build: int, inputs: torch.Tensor, targets: torch.Tensor,
                   groups: Sequence[_Group]) -> tuple:
    """The key of a captured packed step (module notes: what invalidates a graph)."""
    def sig(t: torch.Tensor) -> tuple:
        return (tuple(t.shape), t.dtype, t.device.type)
    parts = []
    for g in groups:
        parts.append(("group", g.folded is not None, len(g.members)))
        for run in g.runs:
            parts.append(run_structure(run, [m.optimizer.param_groups[0]
                                             for m in g.members[run.lo:run.hi]]))
    return (build, sig(inputs), sig(targets), tuple(parts))


@contextlib.contextmanager
def side_stream(stream: Any) -> Iterator[None]:
    """Run the block on ``stream``, ordered after the current stream's work and before its
    later work (PyTorch's capture recipe: warm-up steps on a side stream). Tensors the block
    allocates and the current stream later uses (losses, lazily built columns) need no
    ``record_stream``: every block on ``stream`` starts after the current stream's pending
    work, so a block freed there is reused only after that work."""
    cur = torch.cuda.current_stream(stream.device)
    stream.wait_stream(cur)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        cur.wait_stream(stream)


@dataclass
class CapturedPack:
    """One captured packed step: the graph, its static inputs and its static losses."""

    graph: Any                            # torch.cuda.CUDAGraph
    inputs: torch.Tensor
    targets: torch.Tensor
    losses: torch.Tensor                  # [K] in member-id order, rewritten by every replay

    def replay(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Refill the static inputs in place, replay, return a device copy of the losses."""
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        self.graph.replay()
        return self.losses.clone()


class PackGraphs:
    """The graph state of one :class:`PackedModel` (module notes): its mode, the cache, the
    side stream, the restack counter and the fallback lines already logged."""

    def __init__(self, pm: "PackedModel", mode: str) -> None:
        self.pm, self.mode = pm, mode
        self.cache = graphs.GraphCache(on_drop=self._wait)
        self.stream: Any = None
        self.build = 0                    # restacks so far (part of every key)
        self.last_graphed = False         # whether the last step was a replay
        self._logged: set[str] = set()

    def invalidate(self) -> None:
        """A restack: the stacked tensors the graphs read are gone; forget every graph."""
        self.build += 1
        self.cache.clear()

    def fallback_reason(self) -> str | None:
        """Why packed steps run eagerly now (``None``: they are, or will be, captured)."""
        return self._blocker() or self.cache.disabled

    def _blocker(self) -> str | None:
        """Why this pack, as it is now, cannot be captured (its mode, device or groups)."""
        return pack_device_blocker(self.mode, self.pm.device) or pack_groups_blocker(self.pm._groups)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One packed step: a replay of the captured graph when one is due or exists, else
        eager (warm-up on the side stream, or a fallback whose reason is logged once)."""
        pm = self.pm
        self.last_graphed = False
        why = self._blocker()
        if why is not None:
            self._say(why)
            return pm._eager_step(inputs, targets)
        if not all(g.checked for g in pm._groups):   # first step after a (re)build: the batched
            return self._eager(inputs, targets)       # forward is checked, lazy state is built
        pm._refill_columns()                          # an LR change is a refill, not a new key
        key = pack_graph_key(self.build, inputs, targets, pm._groups)
        cap = graphs.captured_for(self.cache, key, pm.device,
                                  lambda: self._capture(inputs, targets), self._say)
        if cap is None:
            return self._eager(inputs, targets)
        losses = cap.replay(inputs, targets)
        pm._advance()                                 # host bookkeeping of the replayed step
        self.last_graphed = True
        return losses

    def _eager(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with side_stream(self._stream()):
            return self.pm._eager_step(inputs, targets)

    def _stream(self) -> Any:
        if self.stream is None:
            self.stream = streams.new_stream(self.pm.device)
        return self.stream

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> CapturedPack:
        """Capture :meth:`PackedModel._step_body` on static copies of the batch (nothing runs;
        the host bookkeeping is left to each replay)."""
        pm = self.pm
        x = torch.empty(inputs.shape, dtype=inputs.dtype, device=pm.device)
        y = torch.empty(targets.shape, dtype=targets.dtype, device=pm.device)
        x.copy_(inputs)
        y.copy_(targets)
        graph, losses = graphs.cuda_capture(lambda: pm._step_body(x, y), self._stream())
        log.info("pack: packed step captured as a CUDA graph (%d members, batch %s)",
                 len(pm), tuple(inputs.shape))
        return CapturedPack(graph, x, y, losses)

    def _wait(self) -> None:
        """Before graphs are dropped: let their pending replays finish (their memory pool is
        released); once per restack or eviction."""
        dev = self.pm.device
        if dev is not None and torch.device(dev).type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def _say(self, why: str) -> None:
        line = EAGER_LINE % why
        if line not in self._logged:
            self._logged.add(line)
            log.info(line)
