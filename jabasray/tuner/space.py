"""Ray Tune ``param_space`` -> :class:`~jabasray.planners.pack_opt.SearchSpace`.

pack_opt measures distances on declared value lists (Pack paper 5.3), so every entry of the
param space must be discrete: ``tune.choice([...])``, ``tune.grid_search([...])``, a plain
list/tuple, or a constant (a one-value dimension). Continuous domains (``tune.uniform``,
``tune.loguniform`` ...), nested dicts and non-scalar values are refused with a one-line
``ValueError`` naming the key.
"""
from __future__ import annotations

from typing import Any, Mapping

from jabasray.planners.pack_opt import Dimension, SearchSpace, _infer_kind

__all__ = ["search_space_from_param_space"]


def _values(key: str, spec: Any) -> list[Any]:
    from ray.tune.search.sample import Categorical, Domain

    if isinstance(spec, Categorical):
        return list(spec.categories)
    if isinstance(spec, Domain):
        raise ValueError(f"param_space[{key!r}] must be a discrete choice (tune.choice, "
                         f"tune.grid_search or a list) so pack_opt can measure distances, "
                         f"got {type(spec).__name__} domain {spec!r}")
    if isinstance(spec, Mapping):
        if set(spec) == {"grid_search"}:
            return list(spec["grid_search"])
        raise ValueError(f"param_space[{key!r}] must be a discrete choice, a list or a constant, "
                         f"got a nested dict {dict(spec)!r}")
    if isinstance(spec, (list, tuple)):
        return list(spec)
    return [spec]


def search_space_from_param_space(param_space: Mapping[str, Any],
                                  kinds: Mapping[str, str] | None = None) -> SearchSpace:
    """Declared value lists of every key; kinds inferred (numbers -> numeric, strings/booleans
    -> categorical) unless given in ``kinds``."""
    if not isinstance(param_space, Mapping) or not param_space:
        raise ValueError(f"param_space must be a non-empty dict, got {param_space!r}")
    kinds = dict(kinds or {})
    dims = []
    for key, spec in param_space.items():
        vals = _values(key, spec)
        try:
            kind = kinds.pop(key, None) or _infer_kind(key, vals)
            dims.append(Dimension(key, vals, kind))
        except ValueError as e:
            raise ValueError(f"param_space[{key!r}]: {e}") from None
    if kinds:
        raise ValueError(f"kinds names keys not in param_space: {sorted(kinds)}")
    return SearchSpace(dims)
