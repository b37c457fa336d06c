"""Hyperband bracket arithmetic (Li et al., JMLR 2017, Algorithm 1) -- pure, no Ray.

Implementation notes
--------------------
Inputs: R, the maximum resource one configuration may receive, and eta >= 2, the halving
rate. With ``s_max = floor(log_eta R)`` and ``B = (s_max + 1) R`` (the budget of one bracket):

* bracket s (s = s_max, ..., 0; most exploratory first) starts with
  ``n = ceil(B / R * eta^s / (s + 1))`` configurations at ``r = R * eta^-s`` units;
* rung i (i = 0..s) trains ``n_i = floor(n * eta^-i)`` configurations to ``r_i = r * eta^i``
  units, then keeps the best ``n_{i+1} = floor(n_i / eta)`` (successive halving).

Worked example, R = 81, eta = 3 (Li et al., Table 1): s_max = 4, B = 405.

    s = 4: n = ceil(5 * 81 / 5) = 81, r = 1   -> (81, 1) (27, 3) (9, 9) (3, 27) (1, 81)
    s = 3: n = ceil(5 * 27 / 4) = 34, r = 3   -> (34, 3) (11, 9) (3, 27) (1, 81)
    s = 2: n = ceil(5 * 9 / 3)  = 15, r = 9   -> (15, 9) (5, 27) (1, 81)
    s = 1: n = ceil(5 * 3 / 2)  = 8,  r = 27  -> (8, 27) (2, 81)
    s = 0: n = ceil(5 * 1 / 1)  = 5,  r = 81  -> (5, 81)

Tune's ``HyperBandScheduler`` uses the same ``s_max``, ``n`` and ``r`` (for R a power of eta)
but keeps ``ceil(n_i / eta)`` configurations per halving where Li et al. keep
``floor(n_i / eta)`` (Tune's ``_Bracket.successive_halving``): for R = 81, eta = 3, s = 3 Tune
trains 34 -> 12 -> 4 -> 2 configurations, Li et al. 34 -> 11 -> 3 -> 1. ``halving="ceil"``
gives Tune's rungs, the default ``"floor"`` Li et al.'s.

All arithmetic is exact (integers and fractions): ``s_max`` is the largest s with
``eta^s <= R`` (no floating-point log), and r_i is an int whenever it is integral.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from jabasray.serialization import JsonMixin
from jabasray.validation import check_choice, check_int

__all__ = ["Rung", "Bracket", "hyperband_brackets", "hyperband_schedule"]


@dataclass(frozen=True)
class Rung(JsonMixin):
    """Rung i of a bracket: ``n`` configurations trained to ``r`` resource units in total."""
    n: int
    r: float


@dataclass(frozen=True)
class Bracket(JsonMixin):
    """Bracket ``s``: its rungs in order (``rungs[i]`` = (n_i, r_i))."""
    s: int
    rungs: list[Rung]

    @property
    def num_configs(self) -> int:
        return self.rungs[0].n

    def keep(self, i: int) -> int:
        """How many configurations of rung i continue to rung i + 1 (0 after the last rung)."""
        return self.rungs[i + 1].n if i + 1 < len(self.rungs) else 0


def _s_max(R: int, eta: int) -> int:
    s = 0
    while eta ** (s + 1) <= R:
        s += 1
    return s


def _number(x: Fraction) -> float:
    return int(x) if x.denominator == 1 else float(x)


def hyperband_schedule(R: int, eta: int = 3, halving: str = "floor") -> list[Bracket]:
    """All brackets of one Hyperband run, largest ``s`` first (see the module docstring).
    ``halving``: ``"floor"`` (Li et al., Algorithm 1) or ``"ceil"`` (Tune's HyperBandScheduler)."""
    check_int("R", R, min_value=1)
    check_int("eta", eta, min_value=2)
    check_choice("halving", halving, ("floor", "ceil"))
    s_max = _s_max(R, eta)
    B = (s_max + 1) * R
    out = []
    for s in range(s_max, -1, -1):
        # n = ceil(B/R * eta^s / (s+1)) computed on integers: B/R = s_max + 1 exactly
        num, den = (B // R) * eta ** s, s + 1
        n = -(-num // den)
        r = Fraction(R, eta ** s)
        sizes = [n]
        for _ in range(s):
            sizes.append(sizes[-1] // eta if halving == "floor" else -(-sizes[-1] // eta))
        # floor(floor(n / eta) / eta) == floor(n / eta^2): Li et al.'s n * eta^-i, floored
        rungs = [Rung(sizes[i], _number(r * eta ** i)) for i in range(s + 1)]
        out.append(Bracket(s, rungs))
    return out


def tune_hyperband_schedule(R: int, eta: int) -> list[Bracket]:
    """The brackets Tune's ``HyperBandScheduler(max_t=R, reduction_factor=eta)`` runs
    (``halving="ceil"``). Tune rounds ``log_eta R``, so they are the ones listed only where R
    is a power of eta; any other R is refused."""
    brackets = hyperband_schedule(R, eta, halving="ceil")
    if R != eta ** (len(brackets) - 1):
        raise ValueError(f"R must be a power of eta (Tune's HyperBandScheduler rounds log_eta R, "
                         f"so its brackets are the ones listed only then), got R={R}, eta={eta}")
    return brackets


def hyperband_brackets(R: int = 81, eta: int = 3, halving: str = "floor") -> list[list[tuple[int, float]]]:
    """Brackets as plain lists of ``(n_i, r_i)`` rungs, largest ``s`` first.

    >>> hyperband_brackets(81, 3)[-1]
    [(5, 81)]
    """
    return [[(rung.n, rung.r) for rung in b.rungs] for b in hyperband_schedule(R, eta, halving)]
