"""Learning-rate scaling with the global batch size (JABAS section 2.1 and 6.1).

When adaptive batching moves B_G, the learning rate may follow by a scaling rule. With eta_0 the
user's LR at the base batch B_0 (``JobConfig.initial_global_batch``):

    none:    eta(B) = eta_0                      (the default, see below)
    sqrt:    eta(B) = eta_0 * sqrt(B / B_0)      (what the JABAS and SimiGrad implementations apply)
    linear:  eta(B) = eta_0 * B / B_0            (Goyal et al. 2017, section 2.1)

Optional linear warm-up over the first W iterations (iteration counted from 0):

    eta_t = eta(B) * min(1, (t + 1) / W)

so the first step already moves (eta_0 / W instead of 0) and iteration W - 1 reaches eta(B).

Why the default is "none" (a documented deviation from the JABAS and SimiGrad code). JABAS
section 2.1 asks for a rule that adjusts the LR by the factor of the B_G change (it cites
AdaScale and Krizhevsky's rules), and both implementations multiply the user's scheduled LR by
sqrt(B / B_0) (SimiGrad's also has switches to damp or disable it). Every such rule raises the
LR whenever B_G grows. They are derived for the regime where gradient noise limits the step;
Goyal et al. (section 2.2) note that the linear rule breaks down early in training, when the
network changes rapidly, and pair it with a warm-up of several epochs, as JABAS' and SimiGrad's
example scripts do. What bounds the step there is the curvature, not the batch: SGD with
momentum beta is stable along a direction of curvature lambda only while
eta * lambda < 2 (1 + beta), and training sharpens the loss until lambda_max approaches that
limit for the LR it runs at (Cohen et al. 2021, "edge of stability"; SGD settles below it, the
closer the larger the batch). A tuned LR thus has little headroom early on. SimiGrad's rule
grows B_G on the initial loss plateau, where the gradient is noise-dominated (Phi < gamma, as
it should), and a rule that scales the LR with it raises the step just as the loss leaves the
plateau and the curvature rises: the step diverges. With "none", B_G still adapts, and a larger
B_G lowers the gradient noise as an LR decay would (Smith et al. 2018, "Don't decay the
learning rate, increase the batch size": noise scale g = eta N / (B (1 - m))), while the LR
never exceeds the one the user validated. "sqrt" and "linear" stay available for jobs whose
base LR has that headroom (a warm-up that covers the early phase, a base LR from a large-batch
recipe). AdaScale's gain ratio (:mod:`.noise`), which raises the LR only as far as the gradient
noise allows, was measured against these on the adaptive benchmark's job in plain PyTorch
(``benchmarks/adaptive_reference.py``): no rule closed the accuracy gap to static small
beyond the seeds' spread, so none replaces "none" and the gain is not a choice here.
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
