"""Layers of an ``nn.Module`` as ``torch.fx`` sees them: the one definition of "a layer" shared
by the profiler's layer graph (``profiler/layer_graph.py``, what the burst planner plans) and
the burst-parallel executor (``engine/burst.py``, what runs the plan).

A layer is every ``call_module`` / ``call_function`` / ``call_method`` node of the traced graph,
plus the input (the ``forward`` argument) and, for a module returning several tensors, a joining
``output`` layer.  Torch only.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import fx, nn

__all__ = ["LAYER_OPS", "trace_module", "layer_structure", "fetch_attr", "tensor_bytes"]

LAYER_OPS = ("call_module", "call_function", "call_method")


def trace_module(module: nn.Module, example_input: torch.Tensor) -> fx.GraphModule:
    """``torch.fx`` graph of ``module``; shape-dependent control flow is resolved for the shape
    of ``example_input`` via fx's meta tracer when plain symbolic tracing fails."""
    try:
        return fx.symbolic_trace(module)
    except Exception as plain_error:  # noqa: BLE001 - any trace failure -> try the meta tracer
        from torch.fx.experimental import meta_tracer
        names = _placeholder_names(module)
        if len(names) != 1:
            raise ValueError(f"module forward must take exactly one tensor input, got {names}") from None
        meta = torch.empty(tuple(example_input.shape), dtype=example_input.dtype, device="meta")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return meta_tracer.symbolic_trace(module, meta_args={names[0]: meta})
        except Exception as meta_error:  # noqa: BLE001
            raise ValueError(f"module cannot be traced with torch.fx: {_first_line(plain_error)}; "
                             f"meta tracer: {_first_line(meta_error)}") from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _placeholder_names(module: nn.Module) -> list[str]:
    params = inspect.signature(module.forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def layer_structure(gm: fx.GraphModule) -> list[tuple[str, list[str], float]]:
    """The layers of a traced module: (layer name, input layer names, parameter bytes) in graph
    order.  The single tensor input is the first layer (named after the ``forward`` argument);
    every ``call_module`` / ``call_function`` / ``call_method`` node is a layer; a module
    returning several tensors gets a last layer ``output`` joining them; layers whose result
    never reaches the output are dropped."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ValueError(f"module forward must take exactly one tensor input, got "
                         f"{[n.name for n in placeholders]}")
    layer_names = {placeholders[0].name}
    attr_bytes: dict[str, float] = {}
    out: list[tuple[str, list[str], float]] = [(placeholders[0].name, [], 0.0)]
    claimed: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = fetch_attr(gm, str(node.target))
            attr_bytes[node.name] = tensor_bytes(value) if isinstance(value, nn.Parameter) else 0.0
        elif node.op in LAYER_OPS:
            deps: list[str] = []
            pbytes = 0.0
            for dep in node.all_input_nodes:
                if dep.name in layer_names and dep.name not in deps:
                    deps.append(dep.name)
                elif dep.op == "get_attr" and dep.name not in claimed:
                    pbytes += attr_bytes.get(dep.name, 0.0)
                    claimed.add(dep.name)
            if node.op == "call_module":
                sub = gm.get_submodule(str(node.target))
                pbytes += sum(tensor_bytes(p) for p in sub.parameters())
            if not deps:   # e.g. a constant computed from attributes only: hang it on the input
                deps = [placeholders[0].name]
            out.append((node.name, deps, pbytes))
            layer_names.add(node.name)
        elif node.op == "output":
            srcs = [d.name for d in node.all_input_nodes if d.name in layer_names]
            if len(srcs) > 1:
                out.append(("output", srcs, 0.0))
    return _prune_dead(out)


def _prune_dead(layers: list[tuple[str, list[str], float]]) -> list[tuple[str, list[str], float]]:
    """Drop layers whose result never reaches the final layer (they would be extra sinks)."""
    used = {layers[-1][0]}
    for name, deps, _ in reversed(layers):
        if name in used:
            used.update(deps)
    return [entry for entry in layers if entry[0] in used]


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """The attribute ``target`` (dotted path) of ``gm``."""
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def tensor_bytes(t: torch.Tensor) -> float:
    """Bytes held by ``t``'s elements."""
    return float(t.numel() * t.element_size())
