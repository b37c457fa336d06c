"""Gradient-noise estimates from the two similarity groups and AdaScale's gain ratio.

The estimates (jabasray.adaptive.noise) are claimed unbiased for two independent group means of
b i.i.d. samples each: E[tr^] = tr(Sigma) and E[|g|^2^] = |g|^2. The first test proves it
exactly on a small population by enumerating every equally likely draw; the others check the
gain against its closed form r = (tr/B_0 + |g|^2) / (tr/B + |g|^2) and its limits.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from jabasray.adaptive.noise import gain_ratio, noise_estimates


@pytest.mark.parametrize("b", [1, 2])
def test_estimates_are_unbiased_over_every_draw(b):
    # a population of 3 per-sample gradients in R^2; a draw picks 2b of them i.i.d. uniformly
    pop = np.array([[1.0, 0.0], [0.0, 2.0], [-1.5, 0.5]])
    g = pop.mean(axis=0)
    sigma = ((pop - g).T @ (pop - g)) / len(pop)              # per-sample covariance
    traces, norms = [], []
    for draw in itertools.product(range(len(pop)), repeat=2 * b):
        ga, gb = pop[list(draw[:b])].mean(axis=0), pop[list(draw[b:])].mean(axis=0)
        t, n = noise_estimates(ga @ ga, gb @ gb, ga @ gb, b)
        traces.append(t)
        norms.append(n)
    assert np.mean(traces) == pytest.approx(np.trace(sigma), rel=1e-12)
    assert np.mean(norms) == pytest.approx(g @ g, rel=1e-12)


def test_estimates_of_identical_groups_have_no_noise():
    t, n = noise_estimates(4.0, 4.0, 4.0, 16)       # g_A = g_B, |g|^2 = 4
    assert (t, n) == (0.0, 4.0)


@pytest.mark.parametrize("trace,sq_norm,batch,base", [
    (10.0, 0.5, 128, 64), (3.0, 2.0, 96, 64), (100.0, 0.01, 512, 64), (1.0, 1.0, 64, 64),
    (5.0, 0.2, 32, 64),
])
def test_gain_is_the_closed_form(trace, sq_norm, batch, base):
    expected = (trace / base + sq_norm) / (trace / batch + sq_norm)
    assert gain_ratio(trace, sq_norm, batch, base) == pytest.approx(expected, rel=1e-15)
    # the same written with the noise scale B_noise = tr / |g|^2
    b_noise = trace / sq_norm
    assert gain_ratio(trace, sq_norm, batch, base) == pytest.approx(
        (1 + b_noise / base) / (1 + b_noise / batch), rel=1e-12)


def test_gain_limits():
    assert gain_ratio(0.0, 3.0, 256, 64) == 1.0              # exact gradient: keep the LR
    assert gain_ratio(7.0, 0.0, 256, 64) == pytest.approx(4.0)   # pure noise: linear rule
    assert gain_ratio(7.0, -0.3, 256, 64) == pytest.approx(4.0)  # negative estimate clamped
    assert gain_ratio(0.0, 0.0, 256, 64) == 1.0
    for trace, sq in itertools.product([0.1, 1.0, 30.0], [0.01, 0.5, 4.0]):
        for batch in (64, 80, 200, 512):
            assert 1.0 <= gain_ratio(trace, sq, batch, 64) <= batch / 64 + 1e-12


@pytest.mark.parametrize("call,field", [
    (lambda: noise_estimates(-1.0, 1.0, 0.0, 4), "sq_a"),
    (lambda: noise_estimates(1.0, 1.0, float("nan"), 4), "dot"),
    (lambda: noise_estimates(1.0, 1.0, 0.0, 0), "group_batch"),
    (lambda: gain_ratio(-1.0, 1.0, 64, 64), "trace"),
    (lambda: gain_ratio(1.0, 1.0, 0, 64), "batch"),
    (lambda: gain_ratio(1.0, 1.0, 64, 0), "base_batch"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()
