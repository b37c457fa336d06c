"""Ray Tune ``param_space`` -> what packing needs to know about it.

* :func:`normalised_space`: the :class:`~jabasray.planners.pack_opt.NormalisedSpace` that
  packing measures distances on. Every Tune domain is accepted: ``tune.uniform`` /
  ``tune.quniform`` (a numeric range), ``tune.loguniform`` / ``tune.lograndint`` (a numeric
  range on a log scale), ``tune.randint`` (a numeric range), ``tune.choice`` /
  ``tune.grid_search`` of numbers (an ordinal value list: the paper's index distance) or of
  anything else (categorical). Constants and nested dicts carry no distance.
* :func:`largest_value`: the largest value a key can take (the chunk of the shared input
  stream is the largest batch size of the space).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from jabasray.planners.pack_opt import Feature, NormalisedSpace

__all__ = ["normalised_space", "largest_value", "listed_values", "upper_value"]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def listed_values(spec: Any) -> list | None:
    """The values a ``tune.choice`` / ``tune.grid_search`` domain lists, None for any other
    domain or constant (one rule for every reader of a Tune param space)."""
    from .tune_internals import sample_classes
    if isinstance(spec, Mapping) and set(spec) == {"grid_search"}:
        return list(spec["grid_search"])
    if isinstance(spec, sample_classes().Categorical):
        return list(spec.categories)
    return None


def _feature(key: str, spec: Any) -> Feature | None:
    from .tune_internals import sample_classes
    t = sample_classes()
    Float, Integer, LogUniform = t.Float, t.Integer, t.LogUniform

    values = listed_values(spec)
    if values is None:
        if not isinstance(spec, (Float, Integer)):
            return None                                       # constant / nested / custom domain
        return Feature(key, "numeric", float(spec.lower), float(max(upper_value(spec), spec.lower)),
                       log=isinstance(spec.get_sampler(), LogUniform))
    if values and all(_is_number(v) for v in values):
        return Feature(key, "ordinal", values=sorted(values))
    return Feature(key, "categorical")


def normalised_space(param_space: Mapping[str, Any]) -> NormalisedSpace:
    """The distance dimensions of a Tune ``param_space`` (see the module docstring)."""
    if not isinstance(param_space, Mapping):
        raise ValueError(f"param_space must be a dict, got {type(param_space).__name__}")
    return NormalisedSpace([f for k, v in param_space.items() if (f := _feature(k, v)) is not None])


def upper_value(spec: Any) -> Any:
    """The largest value a numeric range domain can take (``tune.randint``'s upper bound is
    exclusive), a constant itself, or any other domain as it is."""
    from .tune_internals import sample_classes
    t = sample_classes()
    if isinstance(spec, t.Integer):
        return spec.upper - 1
    if isinstance(spec, t.Float):
        return spec.upper
    return spec


def largest_value(param_space: Mapping[str, Any], key: str) -> int:
    """Largest integer ``param_space[key]`` can take (ValueError naming the key otherwise)."""
    if key not in param_space:
        raise ValueError(f"param_space must hold the batch-size key {key!r} (or pass "
                         f"stream_batch=...), got keys {sorted(param_space)}")
    spec = param_space[key]
    values = listed_values(spec)
    if values is None:
        values = [upper_value(spec)]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"param_space[{key!r}] must take positive integers (tune.choice, "
                         f"tune.randint, grid_search or a constant), got {spec!r}")
    return max(values)
