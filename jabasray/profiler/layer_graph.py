"""Layer graph of an ``nn.Module`` for the burst-parallel planner (DeepPool §4.1, "the planner
initially profiles each layer with different batch sizes").

``build_layer_graph`` traces the module with ``torch.fx`` (falling back to fx's meta-tensor
tracer, which resolves shape-dependent ``if``s such as ``if x.dim() == 2`` for the example input),
turns every ``call_module`` / ``call_function`` / ``call_method`` node into a layer of a
:class:`~jabasray.planners.burst.LayerGraph`, and measures each layer's forward + backward time
``comp(i, g)`` at per-GPU batch ``ceil(global_batch / g)`` for every requested GPU count ``g``.

Measurement: an ``fx.Interpreter`` runs the whole graph once per per-GPU batch size; at every
layer node it takes the real inputs, makes detached copies that require grad, and times the node
alone ``repeats`` times (forward, then ``torch.autograd.grad`` of the outputs w.r.t. inputs and
parameters with a ones gradient, so nothing accumulates into ``.grad``), keeping the minimum.
On CUDA the device is synchronised around each timed region.  Input copies are cloned before the
timer starts so in-place layers (``ReLU(inplace=True)``) work; the backward of that clone is a
copy and counts towards the layer (negligible next to real layers).

Per layer the graph records: activation bytes of its output for the *global* batch (measured
bytes per sample x global batch), parameter bytes (parameters of the called submodule, or those
fetched with ``get_attr`` by a function node), and its input layers.  The single tensor input
becomes a zero-cost input layer named after the ``forward`` argument; a module returning several
tensors gets a zero-cost ``output`` layer joining them.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx, nn

from ..engine.layer_trace import LAYER_OPS, layer_structure, tensor_bytes, trace_module
from ..planners.burst import LayerGraph, LayerSpec
from ..serialization import JsonMixin
from ..validation import check_int

log = logging.getLogger(__name__)

__all__ = ["trace_module", "build_layer_graph", "LayerMeasurement"]


@dataclass
class LayerMeasurement(JsonMixin):
    """Raw timings of one layer (seconds) per GPU count, kept for inspection."""

    name: str
    op: str
    target: str
    fwd: dict[int, float] = field(default_factory=dict)
    bwd: dict[int, float] = field(default_factory=dict)


def build_layer_graph(module: nn.Module, example_input: torch.Tensor, global_batch: int,
                      gpu_counts: Sequence[int], repeats: int = 3, device: str | torch.device = "cpu",
                      measurements: list[LayerMeasurement] | None = None) -> LayerGraph:
    """Trace ``module`` and measure every layer at per-GPU batch ``ceil(global_batch / g)``.

    The module is moved to ``device``; its state (e.g. BatchNorm running statistics, which
    tracing and timing update) is restored afterwards.

    Args:
        module: the model (left in its current train/eval mode).
        example_input: a batch of inputs (batch dimension first); per-GPU batches are made by
            cycling through its samples.
        global_batch: samples per iteration over all GPUs (>= 1).
        gpu_counts: the GPU counts ``g`` the planner will consider, each in ``[1, global_batch]``.
        repeats: timed runs per layer and batch size; the minimum is kept (>= 1).
        device: where to run the measurement ("cpu" or a CUDA device).
        measurements: if given, a list that receives one :class:`LayerMeasurement` per layer.
    """
    check_int("global_batch", global_batch, min_value=1)
    check_int("repeats", repeats, min_value=1)
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1 or len(example_input) < 1:
        raise ValueError("example_input must be a tensor with a non-empty batch dimension, "
                         f"got {type(example_input).__name__}")
    counts = sorted({check_int("gpu_counts[]", g, min_value=1, max_value=global_batch)
                     for g in gpu_counts})
    if not counts:
        raise ValueError("gpu_counts must name at least one GPU count, got []")
    device = torch.device(device)
    module = module.to(device)
    saved = copy.deepcopy(module.state_dict())   # tracing and timing may update BatchNorm stats
    try:
        gm = trace_module(module, example_input)
        structure = layer_structure(gm)
        timings, out_bytes = _measure(gm, structure[0][0], example_input, global_batch, counts,
                                      repeats, device)
    finally:
        module.load_state_dict(saved)
    layers = []
    for name, inputs, pbytes in structure:
        rec = timings.get(name)
        comp = {g: (rec.fwd[g] + rec.bwd[g]) if rec else 0.0 for g in counts}
        layers.append(LayerSpec(name, comp, float(out_bytes.get(name, 0.0)), float(pbytes), inputs))
    if measurements is not None:
        measurements.extend(timings[n] for n, _, _ in structure if n in timings)
    log.debug("layer graph of %s: %d layers, counts %s", type(module).__name__, len(layers), counts)
    return LayerGraph(layers)


def _measure(gm: fx.GraphModule, input_name: str, example_input: torch.Tensor, global_batch: int,
             counts: list[int], repeats: int, device: torch.device
             ) -> tuple[dict[str, LayerMeasurement], dict[str, float]]:
    """Run the graph once per per-GPU batch ``ceil(global_batch / g)`` and time every layer
    (after one untimed warm-up pass at the largest per-GPU batch: the first run of a graph pays
    one-time costs - allocator growth, kernel selection - that no training iteration pays)."""
    timings: dict[str, LayerMeasurement] = {}
    out_bytes: dict[str, float] = {input_name: tensor_bytes(example_input[:1]) * global_batch}
    warm = torch.arange(math.ceil(global_batch / counts[0])) % len(example_input)
    _TimingInterpreter(gm, 1, device).run(example_input[warm].to(device))
    for g in counts:
        b = math.ceil(global_batch / g)
        idx = torch.arange(b) % len(example_input)
        runner = _TimingInterpreter(gm, repeats, device)
        runner.run(example_input[idx].to(device))
        for name, (fwd, bwd, nbytes, op, target) in runner.results.items():
            rec = timings.setdefault(name, LayerMeasurement(name, op, target))
            rec.fwd[g], rec.bwd[g] = fwd, bwd
            out_bytes.setdefault(name, nbytes / b * global_batch)
    return timings, out_bytes


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    return []


class _TimingInterpreter(fx.Interpreter):
    """Runs the graph and times every layer node in isolation (forward + backward)."""

    def __init__(self, gm: fx.GraphModule, repeats: int, device: torch.device) -> None:
        super().__init__(gm)
        self.repeats = repeats
        self.cuda = device.type == "cuda"
        self.results: dict[str, tuple[float, float, float, str, str]] = {}

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in LAYER_OPS:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        fn = getattr(self, n.op)
        params: list[torch.Tensor] = []
        if n.op == "call_module":
            params = [p for p in self.module.get_submodule(str(n.target)).parameters() if p.requires_grad]
        best_f = best_b = math.inf
        result: Any = None
        for _ in range(self.repeats):
            leaves: list[torch.Tensor] = []

            def prep(v: Any) -> Any:
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    leaf = v.detach().requires_grad_(True)
                    leaves.append(leaf)
                    return leaf.clone()          # clone: in-place layers must not hit a leaf
                return v

            a = fx.node.map_aggregate(args, prep)
            k = fx.node.map_aggregate(kwargs, prep)
            self._sync()
            t0 = time.perf_counter()
            out = fn(n.target, a, k)
            self._sync()
            t1 = time.perf_counter()
            outs = [t for t in _leaves(out) if t.requires_grad]
            wrt = leaves + params
            if outs and wrt:
                grads = [torch.ones_like(t) for t in outs]
                self._sync()
                t2 = time.perf_counter()
                torch.autograd.grad(outs, wrt, grads, allow_unused=True)
                self._sync()
                best_b = min(best_b, time.perf_counter() - t2)
            else:
                best_b = 0.0
            best_f = min(best_f, t1 - t0)
            result = out
        nbytes = sum(tensor_bytes(t) for t in _leaves(result))
        self.results[n.name] = (best_f, best_b, nbytes, n.op, _target_name(n.target))
        return fx.node.map_aggregate(result, lambda v: v.detach() if isinstance(v, torch.Tensor) else v)


def _target_name(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))
