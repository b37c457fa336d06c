"""Burst-parallel execution of a DeepPool plan over a ``torch.distributed`` process group.

Implementation notes
--------------------
Paper: DeepPool, sections 3-4.  The planner
(``planners/burst``) gives every layer a GPU count ``g_i`` and, per branch/join block, which
lanes run on their own GPUs; ``BurstPlan.placement()`` turns that into rank ranges.  This
module runs one training iteration of such a plan on the G ranks of a process group:

* Model = the layers of its ``torch.fx`` graph (``engine/layer_trace.py``, the same layers the
  profiler measured and the planner planned).  Every rank holds the whole model; it runs only
  the layers placed on it.
* Data: layer i's ranks ``first .. first+g_i-1`` split the global batch B contiguously
  (``shard_bounds``: rank k of the layer gets samples ``bounds[k] .. bounds[k+1]``).  The
  input layer's ranks read the inputs of their shard, the output layer's ranks the targets of
  theirs (``BurstExecutor.shards``); over the G ranks every sample's input is read exactly
  once and its target exactly once.
* Forward, layer by layer in topological order: for each input edge u -> v the rows of u's
  output move from u's ranks to v's ranks (point-to-point ``isend``/``irecv``, gloo on CPU,
  NCCL on GPU; rows a rank already holds stay local); the received rows become a leaf tensor
  that requires grad, and the layer runs on it.  The output layer computes
  ``loss_fn(out_shard, y_shard) * len(shard) / B``, so the shard losses add up to the mean
  over the global batch (``loss_fn`` must be a mean over samples, like ``F.cross_entropy``).
  ``loss_fn`` may return ``(loss, {name: mean})``: training metrics of the shard, added by
  its row count (``engine.train_metrics``), so their sum over the ranks is the batch's.
* Backward, in reverse order: a rank back-propagates a layer from the gradient of its output
  (``torch.autograd.backward(out, grad)``), sends each input leaf's gradient rows back to the
  ranks that produced them (the same pieces, reversed), where they are summed into that
  layer's output gradient (a fork sums its consumers').  Then the layer's parameter gradients
  are summed over the ranks that ran it only (one flat all-reduce per layer on a subgroup
  created once per plan; none for g = 1).  Sum of shard gradients of the scaled losses = the
  gradient of the global-batch mean: the step equals a single-process step on the global batch.
* Parameters of layers a rank does not run keep ``grad = None``; torch's optimizers skip them,
  so each parameter is updated (identically) on exactly the ranks that run its layer, and its
  optimizer state lives there.  ``state_dict()`` collects every parameter and buffer from the
  first rank of its layer (a broadcast per layer: for checkpoints and plan changes, not per step).
* A short last batch (an epoch's remainder, ``train_step(..., batch=n)``) uses the same
  placement; a placed rank left without rows skips the layer's compute but still joins its
  all-reduce (with zero gradients), so parameters stay identical on the layer's ranks.
* Deadlock freedom: every rank walks the same global sequence of transfers and all-reduces and
  takes part in those that involve it, posting all its sends and receives of one transfer
  before waiting; a total order whose every operation is joined by all its participants at the
  same position cannot deadlock.  Ranks with no work in a layer wait in the blocking
  ``wait()`` of their next transfer (no spinning).
* Freed time (DeepPool section 5): with a :class:`~jabasray.engine.multiplex.BackgroundRunner`
  the background is held while this rank computes, all-reduces gradients or runs the
  optimizer, and let go while the rank waits for a transfer or for the end of the step (the
  gaps of layers it does not run).

Restrictions (checked up front by ``BurstExecutor.__init__``, one-line ``ValueError`` naming the
layer): one tensor input, one tensor output; every layer maps a batch of n samples to n samples
(batch dimension first; e.g. ``torch.flatten(x, 1)``, not ``x.view(x.size(0), -1)``, whose
``size`` is not a per-sample tensor); no parameter shared by two layers; the plan must name
exactly the traced layers and use the group's size.  BatchNorm normalises per rank shard (as in
data parallelism without SyncBatchNorm), so with BatchNorm the step equals data parallelism on
the same shards, not a single-process step.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import fx, nn

from ..validation import check_int
from .layer_trace import fetch_attr, layer_structure, trace_module
from .step import split_step_output
from .train_metrics import add_step_metrics

log = logging.getLogger(__name__)

__all__ = ["BurstExecutor", "BurstStepStats", "shard_bounds", "transfer_pieces"]


def shard_bounds(batch: int, parts: int) -> list[int]:
    """Contiguous split of ``batch`` samples over ``parts`` ranks: rank k gets samples
    ``bounds[k] .. bounds[k+1]``; the first ``batch % parts`` ranks get one sample more."""
    base, extra = divmod(batch, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def transfer_pieces(src: tuple[int, int], dst: tuple[int, int], batch: int
                    ) -> list[tuple[int, int, int, int]]:
    """Rows that move when a tensor sharded over ranks ``src = (first, count)`` is re-sharded
    over ``dst``: ``(src_rank, dst_rank, lo, hi)`` for global samples ``lo .. hi`` (non-empty
    overlaps, including those a rank keeps, ``src_rank == dst_rank``)."""
    sb, db = shard_bounds(batch, src[1]), shard_bounds(batch, dst[1])
    out = []
    for i in range(src[1]):
        for j in range(dst[1]):
            lo, hi = max(sb[i], db[j]), min(sb[i + 1], db[j + 1])
            if lo < hi:
                out.append((src[0] + i, dst[0] + j, lo, hi))
    return out


@dataclass
class BurstStepStats:
    """What one iteration did on this rank (seconds are this rank's wall time)."""

    loss: float                 # global-batch mean loss (same on every rank)
    step_s: float = 0.0         # the whole iteration, optimizer included
    compute_s: float = 0.0      # forward + backward of the layers this rank runs
    allreduce_s: float = 0.0    # parameter-gradient all-reduces among a layer's ranks
    wait_s: float = 0.0         # blocked in transfers and the end-of-step loss sum: idle time
    layers_run: int = 0         # layers placed on this rank
    local_grad: torch.Tensor | None = None   # keep_local_grad: see BurstExecutor.train_step
    metric_sums: dict = field(default_factory=dict)    # loss_fn's (loss, {name: mean}) metrics on
                                                       # this rank's output rows: mean x rows
    metric_counts: dict = field(default_factory=dict)  # rows behind each sum (.train_metrics)


@dataclass
class _Layer:
    """One layer of the plan as this executor runs it."""

    name: str
    node: fx.Node | None                  # None: the input layer (the forward argument)
    inputs: list[str]
    first: int                            # ranks first .. first+count-1 run it
    count: int
    params: list[nn.Parameter] = field(default_factory=list)
    feature_shape: tuple[int, ...] = ()   # output shape without the batch dimension
    dtype: torch.dtype = torch.float32
    group: Any = None                     # all-reduce subgroup (count > 1 and parameters)
    inplace: bool = False                 # the layer may write into its inputs

    def runs_on(self, rank: int) -> bool:
        return self.first <= rank < self.first + self.count


class BurstExecutor:
    """Runs training iterations of a burst plan on this rank of a process group.

    Args:
        model: the module (shared, not copied: its parameters are the ones trained).
        plan: a ``planners.burst.BurstPlan`` for this model's layer graph and ``total_gpus``
            equal to the group size (used through ``plan.layers`` and ``plan.placement()``).
        example_input: a batch of inputs (>= 2 samples) for tracing and checks.
        global_batch: B, samples per iteration over all ranks (>= the largest layer count).
        loss_fn: ``loss_fn(output, target) -> scalar``, a mean over the samples.
        optimizer: the user's optimizer over ``model.parameters()``; stepped by ``train_step``.
        process_group: the job's group (default: the world).
        background: optional ``BackgroundRunner`` that gets this rank's waiting time.
    """

    def __init__(self, model: nn.Module, plan: Any, example_input: torch.Tensor, global_batch: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer, process_group: Any = None,
                 background: Any = None) -> None:
        self.global_batch = check_int("global_batch", global_batch, min_value=1)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group if process_group is not None else (dist.group.WORLD if distributed else None)
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        self.background = background
        self.device = next((p.device for p in model.parameters()), example_input.device)
        self.gm = trace_module(model, example_input)
        self.layers = self._bind(plan, self.gm)
        saved = {k: v.clone() for k, v in self.gm.state_dict().items()}
        try:                                  # the check run moves BatchNorm statistics
            self._check_layers(example_input.to(self.device))
        finally:
            self.gm.load_state_dict(saved)
        self.by_name = {layer.name: layer for layer in self.layers}
        self.source, self.sink = self.layers[0], self.layers[-1]
        self._runner = fx.Interpreter(self.gm)
        self._global = [dist.get_global_rank(self.group, r)
                        if self.group not in (None, dist.group.WORLD) else r for r in range(self.world)]
        edges = [(u, layer.name) for layer in self.layers for u in layer.inputs]
        self._tags = {edge: 2 * i for i, edge in enumerate(edges)}   # backward: tag + 1
        self._batch = self.global_batch        # samples of the current iteration
        self._keep_local: dict[str, torch.Tensor] | None = None
        self._piece_cache: dict[tuple[tuple[str, str], int], list] = {}
        self._make_groups()
        self._attrs = {n.name: fetch_attr(self.gm, str(n.target))
                       for n in self.gm.graph.nodes if n.op == "get_attr"}
        log.debug("burst executor rank %d/%d: runs %d of %d layers", self.rank, self.world,
                  sum(layer.runs_on(self.rank) for layer in self.layers), len(self.layers))

    # ------------------------------------------------------------------ setup and checks
    def _span(self, name: str) -> tuple[int, int]:
        layer = self.by_name[name]
        return layer.first, layer.count

    def _bind(self, plan: Any, gm: fx.GraphModule) -> list[_Layer]:
        """Match the plan's layers with the traced ones (same names, same order)."""
        structure = layer_structure(gm)
        traced = [name for name, _, _ in structure]
        if traced[-1] == "output":
            raise ValueError("layer output: the model returns several tensors; burst execution "
                             "needs a single output tensor")
        planned = [lp.name for lp in plan.layers]
        if sorted(planned) != sorted(traced):
            missing = [n for n in traced if n not in planned]
            extra = [n for n in planned if n not in traced]
            what = (f"layer {missing[0]!r} of the model is not in the plan" if missing else
                    f"plan layer {extra[0]!r} is not a layer of the model" if extra else
                    "the plan lists a layer twice")
            raise ValueError(f"plan is for a different model: {what} "
                             f"(model has {len(traced)} layers, plan {len(planned)})")
        if plan.total_gpus != self.world:
            raise ValueError(f"plan.total_gpus must equal the process group size {self.world}, "
                             f"got {plan.total_gpus}")
        placement = plan.placement()
        nodes = {n.name: n for n in gm.graph.nodes}
        layers: list[_Layer] = []
        owner: dict[int, str] = {}
        for i, (name, inputs, _) in enumerate(structure):
            first, count = placement[name]
            if count > self.global_batch:
                raise ValueError(f"layer {name}: runs on {count} GPUs but global_batch is "
                                 f"{self.global_batch}; every GPU needs at least one sample")
            node = None if i == 0 else nodes[name]
            params: list[nn.Parameter] = []
            if node is not None and node.op == "call_module":
                params = [p for p in gm.get_submodule(str(node.target)).parameters() if p.requires_grad]
            elif node is not None:
                params = [v for d in node.all_input_nodes if d.op == "get_attr"
                          for v in [fetch_attr(gm, str(d.target))]
                          if isinstance(v, nn.Parameter) and v.requires_grad]
            for p in params:
                if id(p) in owner:
                    raise ValueError(f"layer {name}: shares a parameter with layer {owner[id(p)]}; "
                                     "burst execution needs every parameter in one layer")
                owner[id(p)] = name
            layers.append(_Layer(name, node, list(inputs), first, count, params,
                                 inplace=node is not None and _is_inplace(node, gm)))
        return layers

    def _check_layers(self, example: torch.Tensor) -> None:
        """Run the graph once on ``example`` (no grad): every layer must map n samples to n and
        output one tensor; record per-layer output shapes for the receive buffers."""
        n = len(example)
        if n < 2:
            raise ValueError(f"example_input must hold at least 2 samples, got {n}")
        values: dict[str, Any] = {}
        by_name = {layer.name: layer for layer in self.layers}
        with torch.no_grad():
            runner = fx.Interpreter(self.gm)
            env: dict[fx.Node, Any] = {}
            for node in self.gm.graph.nodes:
                if node.op == "placeholder":
                    env[node] = example
                elif node.op == "output":
                    break
                else:
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
                    env[node] = getattr(runner, node.op)(node.target, args, kwargs)
                values[node.name] = env[node]
        for layer in self.layers:
            out = values[layer.name]
            if not isinstance(out, torch.Tensor) or out.dim() < 1 or out.shape[0] != n:
                what = (f"a {type(out).__name__}" if not isinstance(out, torch.Tensor)
                        else f"a tensor of shape {tuple(out.shape)}")
                target = layer.node.target if layer.node is not None else "input"
                raise ValueError(f"layer {layer.name} ({getattr(target, '__name__', target)}): output "
                                 f"is {what} for a batch of {n}; burst execution needs every layer "
                                 "to map a batch of n samples to n samples (batch dimension first)")
            by_name[layer.name].feature_shape = tuple(out.shape[1:])
            by_name[layer.name].dtype = out.dtype

    def _make_groups(self) -> None:
        """One all-reduce subgroup per distinct rank range of layers with parameters (every
        rank must create every group, in the same order)."""
        groups: dict[tuple[int, int], Any] = {}
        for layer in self.layers:
            if layer.params and layer.count > 1:
                span = (layer.first, layer.count)
                if span not in groups:
                    if span == (0, self.world):
                        groups[span] = self.group
                    else:
                        ranks = [self._global[r] for r in range(layer.first, layer.first + layer.count)]
                        groups[span] = dist.new_group(ranks=ranks)
                layer.group = groups[span]

    # ------------------------------------------------------------------ data
    def shards(self, rank: int | None = None, batch: int | None = None
               ) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((lo, hi), (lo, hi))``: the rows of an iteration's ``batch`` samples (default:
        the global batch) whose inputs and whose targets ``rank`` (default: this one) reads;
        an empty range ``(k, k)`` if it reads none."""
        rank = self.rank if rank is None else rank
        batch = self.global_batch if batch is None else batch
        return self._rows(self.source, rank, batch), self._rows(self.sink, rank, batch)

    def _rows(self, layer: _Layer, rank: int, batch: int | None = None) -> tuple[int, int]:
        if not layer.runs_on(rank):
            return (0, 0)
        bounds = shard_bounds(self._batch if batch is None else batch, layer.count)
        k = rank - layer.first
        return bounds[k], bounds[k + 1]

    def _active(self, layer: _Layer) -> bool:
        """This rank computes the layer in this iteration (placed there and has rows; a short
        last batch can leave a placed rank without rows: it then only joins the all-reduce)."""
        lo, hi = self._rows(layer, self.rank)
        return hi > lo

    def _pieces(self, edge: tuple[str, str]) -> list[tuple[int, int, int, int]]:
        key = (edge, self._batch)
        hit = self._piece_cache.get(key)
        if hit is None:
            hit = self._piece_cache[key] = transfer_pieces(self._span(edge[0]), self._span(edge[1]),
                                                           self._batch)
        return hit

    # ------------------------------------------------------------------ background hand-off
    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """This rank is idle (blocked on a transfer): the background may use the device."""
        if self.background is None:
            yield
            return
        self.background.resume()
        try:
            yield
        finally:
            self.background.pause()

    # ------------------------------------------------------------------ transfers
    def _exchange(self, edge: tuple[str, str], tag: int, backward: bool,
                  local: dict[tuple[int, int], torch.Tensor],
                  want: tuple[int, int], feature: tuple[int, ...], dtype: torch.dtype,
                  stats: BurstStepStats) -> list[tuple[int, torch.Tensor]]:
        """Move the pieces of ``edge`` (forward: u's ranks -> v's ranks; backward: the
        reverse).  ``local[(lo, hi)]`` holds the rows this rank sends/keeps; returns the
        ``(lo, piece)`` it receives or keeps for ``want``'s rows, in sample order."""
        ops, received = [], []
        for src, dst, lo, hi in self._pieces(edge):
            if backward:
                src, dst = dst, src
            if src == self.rank and dst == self.rank:
                received.append((lo, local[(lo, hi)]))
            elif src == self.rank:
                ops.append(dist.P2POp(dist.isend, local[(lo, hi)].contiguous(), self._global[dst],
                                      self.group, tag))
            elif dst == self.rank:
                buf = torch.empty((hi - lo, *feature), dtype=dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, self._global[src], self.group, tag))
                received.append((lo, buf))
        if ops:
            t0 = time.perf_counter()
            with self._waiting():
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            stats.wait_s += time.perf_counter() - t0
        received.sort(key=lambda item: item[0])
        return received

    def _local_pieces(self, edge: tuple[str, str], backward: bool, rows: tuple[int, int],
                      tensor: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
        """Slices of ``tensor`` (this rank's ``rows``) for the pieces it sends or keeps."""
        out = {}
        for src, dst, lo, hi in self._pieces(edge):
            if (dst if backward else src) == self.rank:
                out[(lo, hi)] = tensor[lo - rows[0]:hi - rows[0]]
        return out

    # ------------------------------------------------------------------ one iteration
    def train_step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                   batch: int | None = None, keep_local_grad: bool = False) -> BurstStepStats:
        """One iteration: ``inputs`` are this rank's rows of the iteration's samples for the
        input layer, ``targets`` its rows for the output layer (``shards()``; None where it
        reads none).  ``batch``: samples in this iteration (default: the global batch; a short
        last batch of an epoch is allowed).  Runs forward, backward, the per-layer gradient
        all-reduces and the optimizer.  ``keep_local_grad``: ``stats.local_grad`` is this rank's
        gradient sum before the all-reduces, flattened over the parameters of the layers that
        run on 2 or more ranks (zeros where this rank has no rows), the same layout on every
        rank (JABAS's two-group similarity; single-rank layers have no second group)."""
        stats = BurstStepStats(loss=0.0)
        self._keep_local = {} if keep_local_grad else None
        t_step = time.perf_counter()
        self._batch = check_int("batch", self.global_batch if batch is None else batch, min_value=1)
        in_rows, out_rows = self.shards(batch=self._batch)
        for rows, value, what in ((in_rows, inputs, "inputs"), (out_rows, targets, "targets")):
            if rows[1] > rows[0] and (value is None or len(value) != rows[1] - rows[0]):
                got = "None" if value is None else f"{len(value)} rows"
                raise ValueError(f"{what} must hold rows {rows[0]}..{rows[1]} of the global batch "
                                 f"({rows[1] - rows[0]} rows) on rank {self.rank}, got {got}")
        if self.background is not None:
            self.background.pause()
        try:
            for p in self.gm.parameters():
                p.grad = None
            outputs, leaves, loss = self._forward(inputs, targets, stats)
            self._backward(outputs, leaves, loss, stats)
            if self._keep_local is not None:
                parts = [self._keep_local.get(layer.name) if layer.name in self._keep_local else
                         torch.zeros(sum(p.numel() for p in layer.params), device=self.device)
                         for layer in self.layers if layer.group is not None]
                stats.local_grad = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
            t0 = time.perf_counter()
            self.optimizer.step()
            stats.compute_s += time.perf_counter() - t0
            total = torch.tensor([float(loss.detach()) if loss is not None else 0.0],
                                 dtype=torch.float64, device=self.device)
            if self.world > 1:          # also where ranks without work wait for the step's end
                t0 = time.perf_counter()
                with self._waiting():
                    dist.all_reduce(total, group=self.group)
                stats.wait_s += time.perf_counter() - t0
            stats.loss = float(total)
        finally:
            if self.background is not None:
                self.background.resume()
        stats.layers_run = sum(layer.runs_on(self.rank) for layer in self.layers)
        stats.step_s = time.perf_counter() - t_step
        return stats

    def _forward(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                 stats: BurstStepStats) -> tuple[dict, dict, torch.Tensor | None]:
        outputs: dict[str, torch.Tensor] = {}
        leaves: dict[tuple[str, str], torch.Tensor] = {}
        loss = None
        for layer in self.layers:
            mine = self._active(layer)
            if layer.node is None:
                if mine:
                    outputs[layer.name] = inputs.to(self.device)
                continue
            args: dict[str, torch.Tensor] = {}
            for u in layer.inputs:
                edge = (u, layer.name)
                src = self.by_name[u]
                local = (self._local_pieces(edge, False, self._rows(src, self.rank), outputs[u])
                         if self._active(src) else {})
                got = self._exchange(edge, self._tags[edge], False, local,
                                     self._rows(layer, self.rank), src.feature_shape, src.dtype, stats)
                if mine:
                    x = torch.cat([piece for _, piece in got]) if len(got) > 1 else got[0][1]
                    x = x.detach()
                    if x.is_floating_point() and u != self.source.name:
                        x.requires_grad_(True)
                    leaves[edge] = x
                    args[u] = x.clone() if layer.inplace else x   # in place must not hit a leaf
            if not mine:
                continue
            t0 = time.perf_counter()
            out = self._run_node(layer.node, args)
            if layer is self.sink:
                loss, metrics = split_step_output(self.loss_fn(out, targets.to(self.device)), "loss_fn")
                if metrics:     # training metrics of this rank's output rows (.train_metrics)
                    add_step_metrics(stats.metric_sums, stats.metric_counts, metrics, len(out),
                                     self.device)
                loss = loss * (len(out) / self._batch)
            stats.compute_s += time.perf_counter() - t0
            outputs[layer.name] = out
        return outputs, leaves, loss

    def _run_node(self, node: fx.Node, args: dict[str, torch.Tensor]) -> torch.Tensor:
        def value(arg: fx.Node) -> Any:
            if arg.name in args:
                return args[arg.name]
            if arg.name in self._attrs:
                return self._attrs[arg.name]
            raise ValueError(f"layer {node.name}: input {arg.name} ({arg.op}) is neither a layer "
                             "nor an attribute")  # pragma: no cover - layer_structure covers all
        a, k = fx.node.map_arg((node.args, node.kwargs), value)
        return getattr(self._runner, node.op)(node.target, a, k)

    def _backward(self, outputs: dict, leaves: dict, loss: torch.Tensor | None,
                  stats: BurstStepStats) -> None:
        grads: dict[str, torch.Tensor] = {}
        for layer in reversed(self.layers):
            mine = self._active(layer)
            if layer.node is None:
                continue
            if mine:
                t0 = time.perf_counter()
                out = outputs[layer.name]
                if layer is self.sink:
                    torch.autograd.backward(loss)
                elif layer.name in grads and out.requires_grad:
                    torch.autograd.backward(out, grads.pop(layer.name))
                stats.compute_s += time.perf_counter() - t0
            if layer.group is not None and layer.runs_on(self.rank):
                self._allreduce(layer, stats)
            for u in reversed(layer.inputs):
                if u == self.source.name:
                    continue                       # nobody needs the gradient of the data
                edge = (u, layer.name)
                src = self.by_name[u]
                local: dict[tuple[int, int], torch.Tensor] = {}
                if mine:
                    leaf = leaves[edge]
                    g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    local = self._local_pieces(edge, True, self._rows(layer, self.rank), g)
                got = self._exchange(edge, self._tags[edge] + 1, True, local,
                                     self._rows(src, self.rank), src.feature_shape, src.dtype, stats)
                if self._active(src):
                    lo0 = self._rows(src, self.rank)[0]
                    acc = grads.get(u)
                    if acc is None:
                        acc = grads[u] = torch.zeros_like(outputs[u])
                    for lo, piece in got:
                        acc[lo - lo0:lo - lo0 + len(piece)] += piece

    def _allreduce(self, layer: _Layer, stats: BurstStepStats) -> None:
        """Sum the layer's parameter gradients over the ranks that ran it (one flat buffer)."""
        t0 = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in layer.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self._keep_local is not None:
            self._keep_local[layer.name] = flat.clone()
        dist.all_reduce(flat, group=layer.group)
        offset = 0
        for p in layer.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        stats.allreduce_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state on every rank: each layer's parameters and buffers are
        broadcast from the first rank of that layer (collective: call on all ranks)."""
        owner: dict[str, int] = {}
        for layer in self.layers:
            if layer.node is not None and layer.node.op == "call_module":
                sub = str(layer.node.target)
                for key, _ in self.gm.get_submodule(sub).state_dict().items():
                    owner[f"{sub}.{key}"] = layer.first
            elif layer.node is not None:
                for d in layer.node.all_input_nodes:
                    if d.op == "get_attr":
                        owner[str(d.target)] = layer.first
        state = self.gm.state_dict()
        for key in sorted(state):
            tensor = state[key]
            root = owner.get(key, 0)
            if self.world > 1:
                buf = tensor.detach().clone()
                dist.broadcast(buf, self._global[root], group=self.group)
                state[key] = buf
        return state

    def consolidated_state(self) -> dict[str, Any]:
        """``{"model": state_dict(), "optimizer": the optimizer's state_dict}`` with every
        parameter's optimizer state taken from the first rank of its layer, the same on every
        rank (collective; for checkpoints and plan changes: each rank can then run any layer)."""
        model = self.state_dict()
        opt = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        mine = {}
        for layer in self.layers:
            if layer.first == self.rank:
                for p in layer.params:
                    i = index.get(id(p))
                    if i is not None and i in opt["state"]:
                        mine[i] = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                                   for k, v in opt["state"][i].items()}
        everyone = [mine]
        if self.world > 1:
            everyone = [None] * self.world
            dist.all_gather_object(everyone, mine, group=self.group)
        opt["state"] = {i: s for part in everyone for i, s in part.items()}
        return {"model": model, "optimizer": opt}


def _is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether a layer may modify its input tensors (``inplace=True`` modules or keyword,
    ``x.add_(...)``-style methods, ``x += y``)."""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.kwargs.get("inplace"):
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name in (
        "iadd", "isub", "imul", "itruediv")


def layer_names(model: nn.Module, example_input: torch.Tensor) -> list[str]:
    """The layer names the executor expects a plan to list, in order (no measurement)."""
    return [name for name, _, _ in layer_structure(trace_module(model, example_input))]
