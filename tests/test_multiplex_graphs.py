"""CUDA-graph capturability of a background job's optimizer: the pure decision, checked
on CPU against torch 2.13's rules. The capture itself (no extra training step, graphed ==
eager) is checked on a GPU in tests/test_cuda.py."""
from __future__ import annotations

import pytest
import torch

from jabasray.engine.multiplex import GRAPH_WARMUP_STEPS, graph_capture_blocker


def _params():
    return [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    lambda p: torch.optim.Adam(p, lr=1e-3, capturable=True),
    lambda p: torch.optim.AdamW(p, lr=1e-3, capturable=True),
    lambda p: torch.optim.RMSprop(p, lr=1e-3, capturable=True),
], ids=["sgd", "sgd_momentum", "adam_capturable", "adamw_capturable", "rmsprop_capturable"])
def test_capturable_optimizers(make):
    assert graph_capture_blocker(make(_params())) is None


@pytest.mark.parametrize("make,why", [
    (lambda p: torch.optim.Adam(p, lr=1e-3), r"^Adam param group\(s\) \[0\] have capturable=False"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), r"^AdamW param group\(s\) \[0\] have capturable=False"),
    (lambda p: torch.optim.Adagrad(p, lr=0.1), r"^Adagrad is not known to be CUDA-graph capturable"),
    (lambda p: torch.optim.LBFGS(p), r"^LBFGS is not known to be CUDA-graph capturable"),
], ids=["adam", "adamw", "adagrad", "lbfgs"])
def test_non_capturable_optimizers_say_why(make, why):
    reason = graph_capture_blocker(make(_params()))
    assert reason is not None
    assert __import__("re").match(why, reason), reason


def test_one_non_capturable_group_blocks_capture():
    a, b = _params()
    opt = torch.optim.Adam([{"params": [a], "capturable": True}, {"params": [b]}], lr=1e-3)
    assert "[1] have capturable=False" in graph_capture_blocker(opt)


def test_a_subclass_of_sgd_is_not_assumed_capturable():
    class MySGD(torch.optim.SGD):
        pass
    assert "MySGD is not known" in graph_capture_blocker(MySGD(_params(), lr=0.1))
    assert GRAPH_WARMUP_STEPS >= 1
