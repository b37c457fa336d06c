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

__all__ = ["normalised_space", "largest_value"]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _feature(key: str, spec: Any) -> Feature | None:
    from .tune_internals import sample_classes
    t = sample_classes()
    Categorical, Float, Integer, LogUniform = t.Categorical, t.Float, t.Integer, t.LogUniform

    if isinstance(spec, Mapping) and set(spec) == {"grid_search"}:
        values = list(spec["grid_search"])
    elif isinstance(spec, Categorical):
        values = list(spec.categories)
    elif isinstance(spec, (Float, Integer)):
        hi = spec.upper - 1 if isinstance(spec, Integer) else spec.upper
        return Feature(key, "numeric", float(spec.lower), float(max(hi, spec.lower)),
                       log=isinstance(spec.get_sampler(), LogUniform))
    else:
        return None                                           # constant / nested / custom domain
    if values and all(_is_number(v) for v in values):
        return Feature(key, "ordinal", values=sorted(values))
    return Feature(key, "categorical")


def normalised_space(param_space: Mapping[str, Any]) -> NormalisedSpace:
    """The distance dimensions of a Tune ``param_space`` (see the module docstring)."""
    if not isinstance(param_space, Mapping):
        raise ValueError(f"param_space must be a dict, got {type(param_space).__name__}")
    return NormalisedSpace([f for k, v in param_space.items() if (f := _feature(k, v)) is not None])


def largest_value(param_space: Mapping[str, Any], key: str) -> int:
    """Largest integer ``param_space[key]`` can take (ValueError naming the key otherwise)."""
    from .tune_internals import sample_classes
    t = sample_classes()
    Categorical, Integer = t.Categorical, t.Integer

    if key not in param_space:
        raise ValueError(f"param_space must hold the batch-size key {key!r} (or pass "
                         f"stream_batch=...), got keys {sorted(param_space)}")
    spec = param_space[key]
    if isinstance(spec, Mapping) and set(spec) == {"grid_search"}:
        values = list(spec["grid_search"])
    elif isinstance(spec, Categorical):
        values = list(spec.categories)
    elif isinstance(spec, Integer):
        values = [spec.upper - 1]
    else:
        values = [spec]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"param_space[{key!r}] must take positive integers (tune.choice, "
                         f"tune.randint, grid_search or a constant), got {spec!r}")
    return max(values)
