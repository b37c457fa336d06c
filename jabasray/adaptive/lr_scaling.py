"""Learning-rate scaling with the global batch size (JABAS section 2.1 and 6.1).

When adaptive batching moves B_G, the learning rate follows by a scaling rule [Goyal et al.,
Krizhevsky]: with base learning rate eta_0 tuned for base batch B_0,

    linear:  eta(B) = eta_0 * B / B_0
    sqrt:    eta(B) = eta_0 * sqrt(B / B_0)      (the rule JABAS' implementation applies to SimiGrad)
    none:    eta(B) = eta_0

Optional linear warm-up over the first W iterations (iteration counted from 0):

    eta_t = eta(B) * min(1, (t + 1) / W)

so the first step already moves (eta_0 / W instead of 0) and iteration W - 1 reaches eta(B).
"""
from __future__ import annotations

import math

from ..config import LR_SCALING_RULES
from ..validation import check_choice, check_float, check_int


def lr_factor(base_batch: int, batch: int, rule: str, iteration: int = 0,
              warmup_iterations: int = 0) -> float:
    """eta_t / eta_0 (module docstring: rules and warm-up): the multiplier the batch-size rule
    and the warm-up apply to the user's LR (their optimizer's, as their scheduler moves it).

    Args:
        base_batch: B_0 >= 1 (the job's initial global batch).
        batch: the current global batch B_G >= 1.
        rule: "linear", "sqrt" or "none".
        iteration: global iteration counter (>= 0), only used for warm-up.
        warmup_iterations: W >= 0; 0 disables warm-up.
    """
    check_int("base_batch", base_batch, min_value=1)
    check_int("batch", batch, min_value=1)
    check_choice("rule", rule, LR_SCALING_RULES)
    check_int("iteration", iteration, min_value=0)
    check_int("warmup_iterations", warmup_iterations, min_value=0)
    ratio = batch / base_batch
    f = ratio if rule == "linear" else math.sqrt(ratio) if rule == "sqrt" else 1.0
    if warmup_iterations and iteration < warmup_iterations:
        f *= (iteration + 1) / warmup_iterations
    return f


def scaled_lr(base_lr: float, base_batch: int, batch: int, rule: str,
              iteration: int = 0, warmup_iterations: int = 0) -> float:
    """``base_lr * lr_factor(...)``: the learning rate for global batch ``batch``."""
    base_lr = check_float("base_lr", base_lr, min_value=0.0, min_exclusive=True)
    return base_lr * lr_factor(base_batch, batch, rule, iteration, warmup_iterations)
