"""Argument checks shared by every layer.

Each check raises a one-line ``ValueError`` that names the field, echoes the bad value and
states what is allowed, e.g. ``num_vsw must be an integer >= 1, got 0``. Use these instead of
``assert`` for anything a user can pass in.
"""
from __future__ import annotations

import math
from typing import Any, Iterable


def check_int(name: str, value: Any, *, min_value: int | None = None,
              max_value: int | None = None) -> int:
    """Return ``value`` if it is an integer within ``[min_value, max_value]``, else raise."""
    allowed = _range_text("an integer", min_value, max_value)
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np  # numpy ints are fine
            if isinstance(value, np.integer):
                value = int(value)
            else:
                raise TypeError
        except (ImportError, TypeError):
            raise ValueError(f"{name} must be {allowed}, got {value!r}") from None
    if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def check_float(name: str, value: Any, *, min_value: float | None = None,
                max_value: float | None = None, min_exclusive: bool = False,
                max_exclusive: bool = False) -> float:
    """Return ``float(value)`` if it is a finite number in the given range, else raise."""
    lo = "(" if min_exclusive else "["
    hi = ")" if max_exclusive else "]"
    if min_value is None and max_value is None:
        allowed = "a finite number"
    else:
        allowed = (f"a number in {lo}{'-inf' if min_value is None else min_value}, "
                   f"{'inf' if max_value is None else max_value}{hi}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {allowed}, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(f):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if min_value is not None and (f < min_value or (min_exclusive and f == min_value)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if max_value is not None and (f > max_value or (max_exclusive and f == max_value)):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return f


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``choices``, else raise naming the allowed values."""
    choices = list(choices)
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {shown}, got {value!r}")
    return value


def _range_text(kind: str, lo: Any, hi: Any) -> str:
    if lo is not None and hi is not None:
        return f"{kind} in [{lo}, {hi}]"
    if lo is not None:
        return f"{kind} >= {lo}"
    if hi is not None:
        return f"{kind} <= {hi}"
    return kind


def check_steps_or_epochs(steps: Any, epochs: Any) -> None:
    """A training budget is given as exactly one of ``steps`` and ``epochs`` (each >= 1)."""
    if (steps is None) == (epochs is None):
        raise ValueError(f"exactly one of steps and epochs must be given, got "
                         f"steps={steps!r}, epochs={epochs!r}")
    if steps is not None:
        check_int("steps", steps, min_value=1)
    if epochs is not None:
        check_int("epochs", epochs, min_value=1)
