"""Gradient noise from the two similarity groups, and AdaScale's gain ratio (JABAS section 2.1).

JABAS section 2.1 asks for an LR rule that follows the batch and cites AdaScale; Pollux uses
the same quantity. AdaScale's gain ratio for a batch S times the base batch B_0 is

    r = (sigma^2 + |g|^2) / (sigma^2 / S + |g|^2),      1 <= r <= S

(Johnson et al. 2020, "AdaScale SGD", the gain ratio)

with |g|^2 the squared norm of the true gradient and sigma^2 the variance (trace of the
covariance) of a gradient estimated on B_0 samples: sigma^2 = tr(Sigma) / B_0 for the per-sample
covariance Sigma. r = S where the noise dominates (the LR scales with the batch: the
linear rule), r = 1 where the gradient is exact (a larger batch buys nothing: keep the LR).
With B = S B_0, r = (1 + B_noise / B_0) / (1 + B_noise / B) for the noise scale
B_noise = tr(Sigma) / |g|^2 (McCandlish et al. 2018).

Estimates from the two groups SimiGrad already forms (no extra gradient): the groups' mean
gradients g_A, g_B over b samples each are independent, unbiased estimates of g with
covariance Sigma / b, so

    E |g_A - g_B|^2       = 2 tr(Sigma) / b
    E |(g_A + g_B) / 2|^2 = |g|^2 + tr(Sigma) / (2 b)

give the unbiased estimates tr(Sigma)^ = b |g_A - g_B|^2 / 2 and
|g|^2^ = |(g_A + g_B) / 2|^2 - tr(Sigma)^ / (2 b) (the second can come out negative on one
draw; AdaScale and Pollux smooth both estimates over steps, and :func:`gain_ratio` clamps a
negative |g|^2 at zero, i.e. r = S).
Everything needs only |g_A|^2, |g_B|^2 and <g_A, g_B>: what the similarity reduction computes.

Status: ``benchmarks/adaptive_reference.py`` compares this gain as an LR rule with the others
on the benchmark's job in plain PyTorch; it did not pay there (``benchmarks/RESULTS.md``,
"adaptive"), so it is not a ``JobConfig.lr_scaling`` choice.
"""
from __future__ import annotations

from ..validation import check_float, check_int


def noise_estimates(sq_a: float, sq_b: float, dot: float, group_batch: int) -> tuple[float, float]:
    """Unbiased estimates ``(tr(Sigma), |g|^2)`` from two independent group gradients.

    Args:
        sq_a, sq_b: |g_A|^2 and |g_B|^2, the squared norms of the groups' MEAN gradients
            (mean over each group's samples; a sum over samples must be divided first).
        dot: <g_A, g_B>.
        group_batch: b >= 1, the samples behind each group's mean (B_G / 2).

    Returns:
        ``(trace, sq_norm)``: tr(Sigma)^ = b |g_A - g_B|^2 / 2 (per-sample covariance trace)
        and |g|^2^ = |(g_A + g_B)/2|^2 - tr(Sigma)^ / (2 b), which may be negative on one draw.
    """
    sq_a = check_float("sq_a", sq_a, min_value=0.0)
    sq_b = check_float("sq_b", sq_b, min_value=0.0)
    dot = check_float("dot", dot)
    check_int("group_batch", group_batch, min_value=1)
    diff = max(sq_a + sq_b - 2.0 * dot, 0.0)     # |g_A - g_B|^2 (>= 0 up to rounding)
    trace = group_batch * diff / 2.0
    sq_norm = (sq_a + sq_b + 2.0 * dot) / 4.0 - trace / (2.0 * group_batch)
    return trace, sq_norm


def gain_ratio(trace: float, sq_norm: float, batch: int, base_batch: int) -> float:
    """AdaScale's gain r = (tr/B_0 + |g|^2) / (tr/B + |g|^2) (module docstring).

    Args:
        trace: tr(Sigma) >= 0, the per-sample gradient covariance trace (smoothed estimate).
        sq_norm: |g|^2 (smoothed estimate); a negative estimate is clamped at 0 (pure noise).
        batch: B >= 1, the current global batch; base_batch: B_0 >= 1, the batch of the
            user's LR.

    Returns:
        r, in [1, B / B_0] for B >= B_0 (in [B / B_0, 1] for B < B_0); 1.0 when both
        estimates are zero.
    """
    trace = check_float("trace", trace, min_value=0.0)
    sq_norm = max(check_float("sq_norm", sq_norm), 0.0)
    check_int("batch", batch, min_value=1)
    check_int("base_batch", base_batch, min_value=1)
    den = trace / batch + sq_norm
    if den == 0.0:
        return 1.0
    return (trace / base_batch + sq_norm) / den
