"""Burst-parallel planner (DeepPool §4): exhaustive search agrees with the DP, limits hold.

Reference = enumerate every per-layer GPU count (and every serial/parallel choice of every
branch/join block) and score it with ``evaluate_assignment``, the scalar walk over the graph;
``evaluate_assignment`` itself is checked against a hand-computed example first.
"""
from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from jabasray.planners.burst import (BurstPlan, BurstProblem, LayerGraph, LayerSpec, NetworkModel,
                                     candidate_gpu_counts, disjoint_fraction, evaluate_assignment,
                                     plan_burst, rescale_fraction, search_linear_paper)

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers
def random_graph(rng: np.random.Generator, edges: list[tuple[str, str]], counts: list[int],
                 names: list[str] | None = None) -> LayerGraph:
    """Layers with Amdahl-style times comp(g) = base * (p/g + 1 - p), random sizes."""
    names = names or sorted({x for e in edges for x in e})
    layers = []
    for n in names:
        base, p = rng.uniform(0.2, 2.0), rng.uniform(0.0, 1.0)
        comp = {g: float(base * (p / g + 1 - p)) for g in counts}
        params = float(rng.choice([0.0, rng.uniform(0.0, 2.0)]))
        layers.append(LayerSpec(n, comp, float(rng.uniform(0.0, 2.0)), params,
                                [u for u, v in edges if v == n]))
    return LayerGraph(layers)


def chain_edges(n: int) -> list[tuple[str, str]]:
    return [(f"l{i}", f"l{i + 1}") for i in range(n - 1)]


def exhaustive(prob: BurstProblem) -> tuple[float, dict[str, int]]:
    """Best feasible iteration time over all assignments and lane choices."""
    blocks = prob.blocks()
    choices = [[f for f in itertools.product([False, True], repeat=len(lanes)) if not all(f)]
               for _, _, lanes in blocks]
    best, arg = math.inf, {}
    for combo in itertools.product(prob.counts, repeat=len(prob.order)):
        counts = dict(zip(prob.order, combo))
        for flags in itertools.product(*choices):
            par = {(s, t): f for (s, t, _), f in zip(blocks, flags)}
            ev = evaluate_assignment(prob, counts, par)
            if ev.iteration_time < best:
                best, arg = ev.iteration_time, counts
    return best, arg


def paper_arrays(prob: BurstProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(comp, comm, sync)`` of a chain problem in the layout ``search_linear_paper`` takes."""
    comp = np.array([prob.comp[n] for n in prob.order])
    sync = np.array([prob.sync[n] for n in prob.order])
    comm = np.stack([np.zeros((prob.n, prob.n))] + [prob.comm_matrix(u, False) for u in prob.order[:-1]])
    return comp, comm, sync


def assert_plan_consistent(plan: BurstPlan, prob: BurstProblem) -> None:
    """The plan's own numbers re-evaluate to its iteration time and respect the limit."""
    par = {(b.branch, b.join): b.parallel for b in plan.blocks}
    ev = evaluate_assignment(prob, plan.gpu_counts, par)
    assert ev.feasible, ev.reason
    assert ev.iteration_time == pytest.approx(plan.iteration_time, rel=1e-12)
    for lp in plan.layers:
        assert lp.amplification <= plan.amplification_limit * (1 + 1e-9), lp
        assert lp.gpus in plan.candidate_gpu_counts


# --------------------------------------------------------------------------- cost model
def test_rescale_fraction_matches_per_gpu_simulation():
    """Closed form == max over GPUs of bytes sent/received under contiguous re-sharding."""
    for g, h in itertools.product(range(1, 10), repeat=2):
        worst = 0.0
        for k in range(max(g, h)):
            src = (k / g, (k + 1) / g) if k < g else (0.0, 0.0)
            dst = (k / h, (k + 1) / h) if k < h else (0.0, 0.0)
            kept = max(0.0, min(src[1], dst[1]) - max(src[0], dst[0]))
            worst = max(worst, src[1] - src[0] - kept, dst[1] - dst[0] - kept)
        assert float(rescale_fraction(g, h)) == pytest.approx(worst, abs=1e-12), (g, h)
        assert float(disjoint_fraction(g, h)) >= float(rescale_fraction(g, h))


def test_evaluate_hand_computed_example():
    """G=2, B=10 B/s, d=0.5 s; l0 on 2 GPUs, l1 on 1 GPU.
    comm = 2 (f(2,1)=0.5 * 10/10 + 0.5) = 2; sync(l0,2) = 2*(1/2)*20/10 + 0.5 = 2.5;
    time = comp(l0,2)=2 + 2.5 + 2 + comp(l1,1)=1 = 7.5; Amp(l0)=(2+2.5)*2/4=2.25, Amp(l1)=3."""
    graph = LayerGraph([LayerSpec("l0", {1: 4.0, 2: 2.0}, 10.0, 20.0),
                        LayerSpec("l1", {1: 1.0, 2: 1.0}, 1.0, 0.0, ["l0"])])
    prob = BurstProblem(graph, NetworkModel(10.0, 0.5), 2, 3.0)
    ev = evaluate_assignment(prob, {"l0": 2, "l1": 1})
    assert ev.feasible and ev.iteration_time == pytest.approx(7.5)
    assert [lp.amplification for lp in ev.layers] == pytest.approx([2.25, 3.0])
    assert [lp.comm_in_time for lp in ev.layers] == pytest.approx([0.0, 2.0])
    tight = BurstProblem(graph, NetworkModel(10.0, 0.5), 2, 2.9)
    assert not evaluate_assignment(tight, {"l0": 2, "l1": 1}).feasible


# --------------------------------------------------------------------------- chains
@pytest.mark.parametrize("total_gpus,powers,length", [(8, True, 5), (6, False, 4), (5, True, 6)])
def test_chain_matches_exhaustive_search(total_gpus, powers, length):
    rng = np.random.default_rng(total_gpus * 10 + length)
    net = NetworkModel(8.0, 0.02)
    counts = candidate_gpu_counts(total_gpus, powers)
    for _ in range(4):
        graph = random_graph(rng, chain_edges(length), counts)
        limit = float(rng.uniform(1.0, 4.0))
        prob = BurstProblem(graph, net, total_gpus, limit, powers_of_two=powers)
        plan = plan_burst(graph, net, total_gpus, limit, powers_of_two=powers)
        best, _ = exhaustive(prob)
        assert plan.iteration_time == pytest.approx(best, rel=1e-12)
        assert_plan_consistent(plan, prob)


def test_limit_one_keeps_every_layer_on_one_gpu():
    """Perfect scaling but g>1 adds sync: Amp(i,g) = (c/g + sync) g / c > 1, so limit 1 forces
    the single-GPU plan, time = sum of comp(i,1)."""
    counts = candidate_gpu_counts(8)
    graph = LayerGraph([LayerSpec(f"l{i}", {g: (i + 1.0) / g for g in counts}, 1.0, 1.0,
                                  [f"l{i - 1}"] if i else []) for i in range(4)])
    plan = plan_burst(graph, NetworkModel(1e3, 1e-4), 8, 1.0)
    assert set(plan.gpu_counts.values()) == {1}
    assert plan.iteration_time == pytest.approx(1 + 2 + 3 + 4)


def test_free_network_and_linear_scaling_uses_all_gpus():
    """No parameters, ideal scaling: Amp = 1 at every g, so every layer bursts to G."""
    counts = candidate_gpu_counts(16)
    graph = LayerGraph([LayerSpec(f"l{i}", {g: 2.0 / g for g in counts}, 5.0, 0.0,
                                  [f"l{i - 1}"] if i else []) for i in range(3)])
    plan = plan_burst(graph, NetworkModel(1.0, 0.0), 16, 1.0)
    assert set(plan.gpu_counts.values()) == {16}
    assert plan.iteration_time == pytest.approx(3 * 2.0 / 16)


def test_paper_algorithm1_transcription_can_break_the_limit():
    """Literal Algorithm 1 accepts the first predecessor whatever its Amp (bestAmp = inf) and
    filters states, not edges; on this chain it returns a plan over the limit, the edge-wise DP
    returns the exhaustive optimum within it (the deviation documented in burst.py)."""
    graph = LayerGraph([
        LayerSpec("l0", {1: 1.65, 2: 0.982, 4: 0.648}, 2.1, 0.6),
        LayerSpec("l1", {1: 0.3, 2: 0.243, 4: 0.214}, 1.6, 0.1, ["l0"]),
        LayerSpec("l2", {1: 0.29, 2: 0.145, 4: 0.072}, 2.6, 0.5, ["l1"])])
    net, limit = NetworkModel(10.0, 0.05), 1.65
    prob = BurstProblem(graph, net, 4, limit)
    _, path = search_linear_paper(*paper_arrays(prob), prob.counts, limit)
    literal = evaluate_assignment(prob, {n: prob.counts[k] for n, k in zip(prob.order, path)})
    assert not literal.feasible
    plan = plan_burst(graph, net, 4, limit)
    assert plan.iteration_time == pytest.approx(exhaustive(prob)[0], rel=1e-12)
    assert_plan_consistent(plan, prob)


def test_paper_transcription_agrees_when_the_limit_never_binds():
    """With a limit no plan reaches, Algorithm 1 is a plain shortest path: same optimum."""
    rng = np.random.default_rng(11)
    counts = candidate_gpu_counts(8)
    net = NetworkModel(6.0, 0.01)
    for _ in range(5):
        graph = random_graph(rng, chain_edges(6), counts)
        prob = BurstProblem(graph, net, 8, 1e9)
        best, path = search_linear_paper(*paper_arrays(prob), prob.counts, 1e9)
        plan = plan_burst(graph, net, 8, 1e9)
        assert plan.iteration_time == pytest.approx(best, rel=1e-12)
        literal = evaluate_assignment(prob, {n: prob.counts[k] for n, k in zip(prob.order, path)})
        assert literal.iteration_time == pytest.approx(best, rel=1e-12)


# --------------------------------------------------------------------------- branch / join
GRAPHS = {
    # three lanes, one of them the direct edge a -> j (residual shortcut)
    "three_lanes": [("a", "b"), ("b", "c"), ("a", "d"), ("c", "j"), ("d", "j"), ("a", "j")],
    # nested block b -> {c, d} -> e inside lane a -> ... -> j
    "nested": [("a", "b"), ("b", "c"), ("b", "d"), ("c", "e"), ("d", "e"), ("e", "j"),
               ("a", "f"), ("f", "j")],
    # two residual blocks back to back (join of the first is the branch of the second)
    "two_residuals": [("a", "b"), ("b", "j"), ("a", "j"), ("j", "k"), ("k", "m"), ("j", "m")],
    # Inception-E shape: a lane that forks again and joins at the block's own join
    "fork_into_join": [("a", "b"), ("b", "c"), ("b", "d"), ("c", "j"), ("d", "j"), ("a", "e"),
                       ("e", "j")],
}


@pytest.mark.parametrize("name,total_gpus", [(n, 4) for n in sorted(GRAPHS)] + [("three_lanes", 8)])
def test_branch_join_matches_exhaustive_search(name, total_gpus):
    """G=8 with three lanes exercises the lane caps: 2 lanes side by side get <= 4 GPUs each,
    3 lanes <= 2 each."""
    rng = np.random.default_rng(sum(map(ord, name)) + total_gpus)
    counts = candidate_gpu_counts(total_gpus)
    for trial in range(2 if name == "nested" else 3):   # nested: 3^7 assignments x 9 lane choices
        net = NetworkModel(float(rng.uniform(2.0, 50.0)), float(rng.uniform(0.0, 0.05)))
        graph = random_graph(rng, GRAPHS[name], counts)
        limit = float(rng.uniform(1.0, 5.0))
        prob = BurstProblem(graph, net, total_gpus, limit)
        plan = plan_burst(graph, net, total_gpus, limit)
        best, _ = exhaustive(prob)
        assert plan.iteration_time == pytest.approx(best, rel=1e-12), trial
        assert_plan_consistent(plan, prob)


def test_serial_only_option_matches_exhaustive_serial_search():
    rng = np.random.default_rng(7)
    counts = candidate_gpu_counts(4)
    net = NetworkModel(5.0, 0.01)
    graph = random_graph(rng, GRAPHS["three_lanes"], counts)
    prob = BurstProblem(graph, net, 4, 3.0, parallel_branches=False)
    plan = plan_burst(graph, net, 4, 3.0, parallel_branches=False)
    best = min(evaluate_assignment(prob, dict(zip(prob.order, combo))).iteration_time
               for combo in itertools.product(prob.counts, repeat=len(prob.order)))
    assert plan.iteration_time == pytest.approx(best, rel=1e-12)
    assert not any(any(b.parallel) for b in plan.blocks)


def test_non_scaling_lanes_run_in_parallel_on_half_the_gpus():
    """Two lanes whose layers do not speed up (comp = 1 s at any g) on a fast network: running
    them side by side costs 1 s + transfers instead of 2 s; each lane gets <= G/2 GPUs."""
    counts = candidate_gpu_counts(8)
    flat = {g: 1.0 for g in counts}
    tiny = {g: 1e-3 for g in counts}
    graph = LayerGraph([LayerSpec("a", tiny, 1.0), LayerSpec("x", flat, 1.0, 0.0, ["a"]),
                        LayerSpec("y", flat, 1.0, 0.0, ["a"]), LayerSpec("j", tiny, 1.0, 0.0, ["x", "y"])])
    net = NetworkModel(1e6, 1e-6)
    plan = plan_burst(graph, net, 8, 10.0)
    assert plan.iteration_time < 1.01 and plan.iteration_time > 1.0
    (block,) = plan.blocks
    assert block.parallel.count(True) == 1 and block.lane_gpu_cap == 4
    assert plan.gpu_counts["x"] <= 4 and plan.gpu_counts["y"] <= 4
    serial = plan_burst(graph, net, 8, 10.0, parallel_branches=False)
    assert serial.iteration_time > 2.0


# --------------------------------------------------------------------------- data + errors
def test_plan_and_graph_round_trip_json(tmp_path):
    rng = np.random.default_rng(3)
    graph = random_graph(rng, GRAPHS["nested"], candidate_gpu_counts(8))
    plan = plan_burst(graph, NetworkModel(10.0, 0.01), 8, 2.5)
    assert BurstPlan.from_json(plan.to_json()) == plan
    assert LayerGraph.from_json(graph.to_json()) == graph
    plan.save(tmp_path / "plan.json")
    assert BurstPlan.load(tmp_path / "plan.json") == plan
    assert plan.gpu_sec == pytest.approx(sum(lp.gpus * (lp.comm_in_time + lp.comp_time + lp.sync_time)
                                             for lp in plan.layers))


def _chain(times=None, inputs=None):
    times = times or {1: 1.0, 2: 0.6}
    return LayerGraph([LayerSpec("a", dict(times), 1.0, 1.0),
                       LayerSpec("b", {1: 1.0, 2: 0.6}, 1.0, 1.0, inputs or ["a"])])


@pytest.mark.parametrize("kwargs,match", [
    (dict(graph=LayerGraph([])), "graph.layers"),
    (dict(graph=_chain({1: -1.0, 2: 0.5})), r"layers\[a\].comp_time\[1\]"),
    (dict(graph=_chain({1: 1.0})), r"layers\[a\].comp_time is missing GPU count 2"),
    (dict(graph=_chain(inputs=["zz"])), "unknown layer 'zz'"),
    (dict(total_gpus=0), "total_gpus"),
    (dict(amplification_limit=0.5), "amplification_limit"),
])
def test_bad_input_names_the_field(kwargs, match):
    args = dict(graph=_chain(), network=NetworkModel(1.0), total_gpus=2, amplification_limit=2.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_burst(**args)


def test_bad_graph_shapes_are_rejected():
    t = {1: 1.0}
    net = NetworkModel(1.0)
    cycle = LayerGraph([LayerSpec("s", t), LayerSpec("a", t, inputs=["s", "b"]),
                        LayerSpec("b", t, inputs=["a"]), LayerSpec("z", t, inputs=["b"])])
    with pytest.raises(ValueError, match="cycle"):
        plan_burst(cycle, net, 1, 1.0)
    two_sinks = LayerGraph([LayerSpec("s", t), LayerSpec("a", t, inputs=["s"]), LayerSpec("b", t, inputs=["s"])])
    with pytest.raises(ValueError, match="exactly one output layer"):
        plan_burst(two_sinks, net, 1, 1.0)
    dup = LayerGraph([LayerSpec("s", t), LayerSpec("s", t)])
    with pytest.raises(ValueError, match="unique"):
        plan_burst(dup, net, 1, 1.0)
    # the "N" graph a->c, a->d, b->d, s->a, s->b, c,d->z is not series-parallel
    n_graph = LayerGraph([LayerSpec("s", t), LayerSpec("a", t, inputs=["s"]), LayerSpec("b", t, inputs=["s"]),
                          LayerSpec("c", t, inputs=["a"]), LayerSpec("d", t, inputs=["a", "b"]),
                          LayerSpec("z", t, inputs=["c", "d"])])
    with pytest.raises(ValueError, match="series-parallel"):
        plan_burst(n_graph, net, 1, 1.0)
    with pytest.raises(ValueError, match="network.bandwidth"):
        NetworkModel(0.0)


def test_evaluate_rejects_unknown_counts_and_bad_flags():
    rng = np.random.default_rng(2)
    prob = BurstProblem(random_graph(rng, GRAPHS["three_lanes"], [1, 2, 4]), NetworkModel(1.0), 4, 2.0)
    counts = {n: 1 for n in prob.order}
    with pytest.raises(ValueError, match=r"counts\[a\] must be one of \[1, 2, 4\]"):
        evaluate_assignment(prob, {**counts, "a": 3})
    with pytest.raises(ValueError, match="flags"):
        evaluate_assignment(prob, counts, {("a", "j"): [True, True, True]})


def test_single_layer_graph():
    """Amp(only, 4) = 1.5 * 4 / 4 = 1.5 > 1.2, Amp(only, 2) = 2 * 2 / 4 = 1: two GPUs win."""
    graph = LayerGraph([LayerSpec("only", {1: 4.0, 2: 2.0, 4: 1.5}, 0.0, 0.0)])
    plan = plan_burst(graph, NetworkModel(1.0), 4, 1.2)
    assert plan.gpu_counts == {"only": 2} and plan.iteration_time == pytest.approx(2.0)
    assert plan_burst(graph, NetworkModel(1.0), 4, 1.5).gpu_counts == {"only": 4}


# --------------------------------------------------------------------------- benchmark graphs
def _model_graphs():
    spec = importlib.util.spec_from_file_location("model_graphs", ROOT / "benchmarks" / "model_graphs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("model_graphs", mod)   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_graphs_have_torchvision_parameter_counts_and_plan():
    mg = _model_graphs()
    expected = {"vgg16": 138_357_544, "wide_resnet101_2": 126_886_696, "inception_v3": 23_834_568}
    net = NetworkModel(12.5e9, 5e-6)
    for name, build in mg.MODELS.items():
        nodes = build()
        assert mg.param_count(nodes) == expected[name]
        graph = mg.to_layer_graph(nodes, 256, candidate_gpu_counts(8))
        plan = plan_burst(graph, net, 8, 2.0)
        prob = BurstProblem(graph, net, 8, 2.0)
        assert_plan_consistent(plan, prob)
        uniform = min(evaluate_assignment(prob, {n: g for n in prob.order}).iteration_time
                      for g in prob.counts)
        assert plan.iteration_time <= uniform * (1 + 1e-12)


# --------------------------------------------------------------------------- zero-compute layers
def inception_like(branch_times: dict[int, float], counts: list[int], act: float = 1.0) -> LayerGraph:
    """stem -> four branches (two of them two layers deep) -> concat (comp 0) -> head; the
    stem and head scale perfectly, every branch layer takes ``branch_times[g]``."""
    zero = {g: 0.0 for g in counts}
    ideal = {g: 1.0 / g for g in counts}
    layers = [LayerSpec("stem", ideal, act), LayerSpec("b1", dict(branch_times), act, 0.0, ["stem"]),
              LayerSpec("b2a", dict(branch_times), act, 0.0, ["stem"]),
              LayerSpec("b2b", dict(branch_times), act, 0.0, ["b2a"]),
              LayerSpec("b3", dict(branch_times), act, 0.0, ["stem"]),
              LayerSpec("b4a", dict(branch_times), act, 0.0, ["stem"]),
              LayerSpec("b4b", dict(branch_times), act, 0.0, ["b4a"]),
              LayerSpec("cat", zero, 4 * act, 0.0, ["b1", "b2b", "b3", "b4b"]),
              LayerSpec("head", ideal, act, 0.0, ["cat"])]
    return LayerGraph(layers)


def test_zero_compute_concat_lets_branches_run_on_their_own_gpus():
    """Branch layers that do not scale (1 s at any g) on a fast network: running the four
    branches side by side on their own GPUs pays off (about 2 s of branches instead of 6 s).
    The concat costs 0: under the literal Amp = T g / comp(cat, 1) every transfer into it is
    infinitely amplified and no branch could move; with the reference-work rule the transfers
    into the concat are judged against the branch layers' 1 s, well within limit 4."""
    counts = candidate_gpu_counts(8)
    graph = inception_like({g: 1.0 for g in counts}, counts)
    net = NetworkModel(1e6, 1e-6)
    plan = plan_burst(graph, net, 8, 4.0)
    (block,) = plan.blocks
    assert block.parallel.count(True) == 3 and block.lane_gpu_cap == 2
    assert plan.iteration_time < 2.0 + 2 * 0.125 + 0.01
    serial = plan_burst(graph, net, 8, 4.0, parallel_branches=False)
    assert serial.iteration_time > 6.0
    prob = BurstProblem(graph, net, 8, 4.0)
    assert_plan_consistent(plan, prob)
    # the concat's amplification is reported against the branch layers' work (1 s)
    cat = next(lp for lp in plan.layers if lp.name == "cat")
    assert math.isfinite(cat.amplification) and cat.amplification <= 4.0
    assert prob.edge_reference("b1", "cat") == 1.0 and prob.edge_reference(None, "stem") == 1.0


def test_zero_compute_concat_keeps_branches_serial_where_parallel_does_not_pay():
    """Branches that scale perfectly gain nothing from their own GPUs (the disjoint transfers
    only add time): every lane stays on the shared GPUs and bursts to all 8."""
    counts = candidate_gpu_counts(8)
    graph = inception_like({g: 1.0 / g for g in counts}, counts)
    plan = plan_burst(graph, NetworkModel(50.0, 1e-3), 8, 4.0)
    (block,) = plan.blocks
    assert not any(block.parallel)
    assert {plan.gpu_counts[n] for n in ("b1", "b2a", "b2b", "b3", "b4a", "b4b")} == {8}


def test_zero_compute_reference_work_hand_computed():
    """in (0) -> a (comp 2) -> cat (0) -> out (0) on G=2, B=1 B/s, d=0, A_a=1: moving a's data
    from 2 GPUs to 1 costs comm = 2 * (1/2 * 1 / 1) = 1; T(cat, 1) = 1, judged against
    comp(a, 1) = 2: Amp(cat) = 1 * 1 / 2 = 0.5.  ``out`` (zero, fed by cat) inherits a's 2."""
    graph = LayerGraph([LayerSpec("in", {1: 0.0, 2: 0.0}, 1.0),
                        LayerSpec("a", {1: 2.0, 2: 1.0}, 1.0, 0.0, ["in"]),
                        LayerSpec("cat", {1: 0.0, 2: 0.0}, 1.0, 0.0, ["a"]),
                        LayerSpec("out", {1: 0.0, 2: 0.0}, 0.0, 0.0, ["cat"])])
    prob = BurstProblem(graph, NetworkModel(1.0, 0.0), 2, 1.0)
    assert prob.reference_work == {"in": 0.0, "a": 2.0, "cat": 2.0, "out": 2.0}
    ev = evaluate_assignment(prob, {"in": 2, "a": 2, "cat": 1, "out": 1})
    amps = {lp.name: lp.amplification for lp in ev.layers}
    assert amps == pytest.approx({"in": 0.0, "a": 1.0, "cat": 0.5, "out": 0.0})
    assert ev.feasible and ev.iteration_time == pytest.approx(1.0 + 1.0)


@pytest.mark.parametrize("name", ["three_lanes", "fork_into_join", "nested"])
def test_zero_compute_joins_match_exhaustive_search(name):
    """Random graphs whose joins (and the input layer) cost 0 at every count: the DP still
    finds the exhaustive optimum under the same rule, and some plans do run lanes in parallel."""
    rng = np.random.default_rng(sum(map(ord, name)) + 99)
    counts = candidate_gpu_counts(4)
    joins = {v for v in {e[1] for e in GRAPHS[name]} if sum(1 for e in GRAPHS[name] if e[1] == v) > 1}
    any_parallel = False
    for trial in range(2 if name == "nested" else 4):
        graph = random_graph(rng, GRAPHS[name], counts)
        for spec in graph.layers:
            if spec.name in joins or spec.name == "a":
                spec.comp_time = {g: 0.0 for g in counts}
                spec.param_bytes = 0.0
        net = NetworkModel(float(rng.uniform(20.0, 200.0)), float(rng.uniform(0.0, 0.01)))
        limit = float(rng.uniform(2.0, 6.0))
        prob = BurstProblem(graph, net, 4, limit)
        plan = plan_burst(graph, net, 4, limit)
        assert plan.iteration_time == pytest.approx(exhaustive(prob)[0], rel=1e-12), trial
        assert_plan_consistent(plan, prob)
        any_parallel |= any(any(b.parallel) for b in plan.blocks)
    assert any_parallel, "test should exercise parallel lanes into a zero-compute join"


def test_plan_cache_plans_each_global_batch_once():
    """Per-GPU work shrinks with B_G / g: the cache asks for one graph per distinct B_G and
    returns the same plan as planning that graph directly."""
    from jabasray.planners.burst import BurstPlanCache
    counts = candidate_gpu_counts(4)
    asked = []

    def graph_for(batch):
        asked.append(batch)
        return LayerGraph([LayerSpec(f"l{i}", {g: batch / g * 1e-3 + 1e-3 for g in counts}, batch * 10.0,
                                     1e3 * i, [f"l{i - 1}"] if i else []) for i in range(3)])
    net = NetworkModel(1e5, 1e-4)
    cache = BurstPlanCache(graph_for, net, 4, 2.0)
    for batch in (32, 64, 32, 64, 128):
        assert cache.plan(batch) == plan_burst(graph_for(batch), net, 4, 2.0)
    assert cache.misses == 3 and asked.count(32) == 3   # 1 miss + 2 direct calls in the test
    with pytest.raises(ValueError, match="global_batch"):
        cache.plan(0)
