"""torch.fx layer-graph helper: structure, sizes, per-GPU batches, and that the planner runs on it."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from jabasray.models import DigitsCNN
from jabasray.planners.burst import BurstProblem, NetworkModel, evaluate_assignment, plan_burst
from jabasray.profiler.layer_graph import LayerMeasurement, build_layer_graph

COUNTS = [1, 2, 4]


class Branchy(nn.Module):
    """stem -> {a ; b1 -> b2} -> add -> cat with the stem output -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.a = nn.Linear(16, 16)
        self.b1 = nn.Linear(16, 8)
        self.b2 = nn.Linear(8, 16)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.stem(x))
        y = self.a(h) + self.b2(self.b1(h))
        return self.head(torch.cat([y, h], dim=1))


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.h1 = nn.Linear(4, 2)
        self.h2 = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor):
        z = self.body(x)
        return self.h1(z), self.h2(z)


def _param_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def test_digits_cnn_chain_sizes_and_times():
    torch.manual_seed(0)
    model = DigitsCNN(batch_norm=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 1, 8, 8)
    global_batch = 16
    meas: list[LayerMeasurement] = []
    graph = build_layer_graph(model, x, global_batch, COUNTS, repeats=1, measurements=meas)
    names = [l.name for l in graph.layers]
    # forward has `if x.dim() == 2`: traced through the meta tracer for the 4-D example input
    assert names[0] == "x" and names[1:] == [f"features_{i}" for i in range(7)] + \
        [f"classifier_{i}" for i in range(4)]
    for prev, layer in zip(graph.layers, graph.layers[1:]):
        assert layer.inputs == [prev.name]                      # a chain
    assert sum(l.param_bytes for l in graph.layers) == _param_bytes(model)
    # output activation bytes of the global batch, reference from forward hooks at batch 1
    sizes: dict[str, int] = {}
    hooks = [mod.register_forward_hook(lambda m, i, o, n=n: sizes.__setitem__(n, o.numel() * o.element_size()))
             for n, mod in model.named_modules() if n.count(".") == 1]
    model.eval()
    with torch.no_grad():
        model(x[:1])
    for h in hooks:
        h.remove()
    for layer in graph.layers[1:]:
        assert layer.activation_bytes == sizes[layer.name.replace("_", ".")] * global_batch
    assert graph.layers[0].activation_bytes == 64 * 4 * global_batch
    for layer in graph.layers:
        assert set(layer.comp_time) == set(COUNTS) and min(layer.comp_time.values()) >= 0.0
    assert [m.name for m in meas] == names[1:]
    assert all(m.bwd[g] > 0 for m in meas if m.name == "features_0" for g in COUNTS)
    # measuring leaves the model's state (BatchNorm running stats) as it was
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    plan = plan_burst(graph, NetworkModel(1e9, 1e-5), 4, 2.0)
    prob = BurstProblem(graph, NetworkModel(1e9, 1e-5), 4, 2.0)
    assert evaluate_assignment(prob, plan.gpu_counts).iteration_time == pytest.approx(plan.iteration_time)


def test_flat_input_takes_the_view_branch():
    graph = build_layer_graph(DigitsCNN(), torch.randn(4, 64), 8, [1, 2], repeats=1)
    assert [l.name for l in graph.layers][:3] == ["x", "view", "features_0"]


def test_branchy_module_structure_and_per_gpu_batches():
    torch.manual_seed(0)
    model = Branchy()
    seen: list[int] = []
    hook = model.b1.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].shape[0]) if args[0].device.type != "meta" else None)
    graph = build_layer_graph(model, torch.randn(5, 8), 10, [1, 2, 4], repeats=2)
    hook.remove()
    inputs = {l.name: l.inputs for l in graph.layers}
    assert inputs == {"x": [], "stem": ["x"], "act": ["stem"], "a": ["act"], "b1": ["act"],
                      "b2": ["b1"], "add": ["a", "b2"], "cat": ["add", "act"], "head": ["cat"]}
    # one untimed warm-up pass at 10, then per-GPU batch = ceil(10 / g) = 10, 5, 3, each timed twice
    assert seen == [10, 10, 10, 5, 5, 3, 3]
    assert {l.name: l.param_bytes for l in graph.layers}["b1"] == _param_bytes(model.b1)
    prob = BurstProblem(graph, NetworkModel(1e8, 1e-5), 4, 3.0)
    blocks = {(s, t): lanes for s, t, lanes in prob.blocks()}
    assert blocks == {("act", "add"): [["a"], ["b1", "b2"]], ("act", "cat"): [[], ["a", "b1", "b2", "add"]]}
    plan = plan_burst(graph, NetworkModel(1e8, 1e-5), 4, 3.0)
    assert plan.max_amplification <= 3.0 * (1 + 1e-9)
    assert math.isfinite(plan.iteration_time)


def test_several_outputs_join_in_an_output_layer():
    graph = build_layer_graph(TwoHeads(), torch.randn(2, 4), 4, [1, 2], repeats=1)
    last = graph.layers[-1]
    assert last.name == "output" and sorted(last.inputs) == ["h1", "h2"]
    assert all(t == 0.0 for t in last.comp_time.values())
    plan_burst(graph, NetworkModel(1e8), 2, 2.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(global_batch=0), "global_batch"),
    (dict(gpu_counts=[1, 32]), "gpu_counts"),
    (dict(gpu_counts=[]), "gpu_counts"),
    (dict(repeats=0), "repeats"),
])
def test_bad_arguments(kwargs, match):
    args = dict(module=TwoHeads(), example_input=torch.randn(2, 4), global_batch=8, gpu_counts=[1, 2])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_layer_graph(**args)
