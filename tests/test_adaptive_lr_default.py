"""The default LR rule under adaptive batching: B_G moves, the LR stays the user's.

Why (jabasray.adaptive.lr_scaling): SGD with momentum beta is stable on a direction of
curvature lambda only while eta * lambda < 2 (1 + beta), whatever the batch; a user's tuned LR
sits close to that limit early in training, so a rule that raises the LR with B_G (sqrt,
linear) can cross it, while the default never exceeds the user's LR. These tests check the
default against the closed-form reference of the rule and, for the stability argument, the
heavy-ball iteration (torch.optim.SGD) against the spectral radius of its iteration matrix.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jabasray.adaptive import AdaptiveBatchController, lr_factor, scaled_lr
from jabasray.config import JobConfig

BETA = 0.9            # the momentum of jabasray's default optimizer (SGD, momentum 0.9)
WINDOW = 5            # iterations per adaptation window (p)
# B_G* the plan ran per window in a benchmark run whose loss diverged once the loss left its
# initial plateau (digits, B_G 64 -> 96 within four windows under Phi < gamma)
APPLIED = [64, 64, 80, 80, 96, 96, 96]


def _job(**kw) -> JobConfig:
    base = dict(initial_global_batch=64, min_global_batch=64, max_global_batch=512,
                min_local_batch=8, adapt_interval=WINDOW, alpha=0.1, gamma=0.5, lr=0.1,
                warmup_iterations=10)
    base.update(kw)
    return JobConfig(**base)


def test_default_rule_keeps_the_users_lr_whatever_b_g():
    job = _job()
    assert job.lr_scaling == "none" and JobConfig().lr_scaling == "none"
    for batch in (1, 8, 63, 64, 65, 70, 96, 103, 128, 511, 512, 4096):
        for it in range(0, 40, 3):
            # reference: only the warm-up ramp eta_t / eta_0 = min(1, (t + 1) / W)
            assert lr_factor(64, batch, job.lr_scaling, iteration=it,
                             warmup_iterations=job.warmup_iterations) == min(1.0, (it + 1) / 10)
    # the controller grows B_G on noisy windows; its LR stays the user's, the opt-in sqrt rule's
    # follows sqrt(B_G / B_0)
    ctl, ctl_sqrt = AdaptiveBatchController(job), AdaptiveBatchController(_job(lr_scaling="sqrt"))
    for _ in range(5):
        ctl.update(0.0)
        ctl_sqrt.update(0.0)
    assert ctl.global_batch == ctl_sqrt.global_batch == 103          # 64 70 77 85 94 103
    assert [ctl.lr(it) for it in (0, 4, 9, 30)] == pytest.approx([0.01, 0.05, 0.1, 0.1], rel=1e-15)
    assert ctl_sqrt.lr(30) == pytest.approx(0.1 * math.sqrt(103 / 64), rel=1e-15)


def _spectral_radius(eta: float, lam: float) -> float:
    """torch.optim.SGD with momentum on f(x) = lam x^2 / 2: buf' = beta buf + lam x,
    x' = x - eta buf', i.e. (x', buf') = M (x, buf) with M below."""
    m = np.array([[1.0 - eta * lam, -eta * BETA], [lam, BETA]])
    return float(max(abs(np.linalg.eigvals(m))))


def _run_heavy_ball(rule: str, eta0: float, lam: float) -> list[float]:
    """x_t of torch.optim.SGD(momentum=BETA) on lam x^2 / 2 from x = 1, the LR of each window
    set by the rule for the window's applied B_G (warm-up done)."""
    x = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = torch.optim.SGD([x], lr=eta0, momentum=BETA)
    xs = []
    for batch in APPLIED:
        for g in opt.param_groups:
            g["lr"] = scaled_lr(eta0, 64, batch, rule)
        for _ in range(WINDOW):
            opt.zero_grad()
            (0.5 * lam * x * x).sum().backward()
            opt.step()
            xs.append(float(x.detach()))
    return xs


@pytest.mark.parametrize("rule", ["none", "sqrt", "linear"])
def test_raising_the_lr_with_b_g_crosses_the_momentum_stability_limit(rule):
    lam = 1.0
    limit = 2.0 * (1.0 + BETA) / lam                 # eta * lam < 2 (1 + beta)
    eta0 = 0.97 * limit                              # a tuned LR: stable, close to the limit
    etas = [scaled_lr(eta0, 64, b, rule) for b in APPLIED]
    radii = [_spectral_radius(eta, lam) for eta in etas]
    # reference: the iteration is stable iff eta * lam < 2 (1 + beta)
    assert all((r < 1.0) == (eta * lam < limit) for r, eta in zip(radii, etas))
    xs = _run_heavy_ball(rule, eta0, lam)
    if rule == "none":
        assert max(radii) < 1.0 and abs(xs[-1]) < 0.5     # never above the user's LR: contracts
    else:
        assert etas[2] > eta0 and radii[2] > 1.0          # the first grow (64 -> 80) crosses it
        assert abs(xs[-1]) > 1e3                          # and the iterate diverges
        # after 15 iterations at the last LR the growth per step is the spectral radius
        assert abs(xs[-1] / xs[-2]) == pytest.approx(radii[-1], rel=1e-3)
