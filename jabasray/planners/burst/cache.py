"""Burst plans per global batch: DeepPool plans for a fixed B_G (strong scaling); with adaptive
batching B_G moves, and the plan for each B_G is computed once and reused (pure; the layer
graph for a B_G comes from the caller, e.g. ``profiler.layer_graph.build_layer_graph``)."""
from __future__ import annotations

from typing import Callable

from ...validation import check_float, check_int
from .costs import NetworkModel
from .graph import LayerGraph
from .plan import BurstPlan
from .search import plan_burst


class BurstPlanCache:
    """``plan(global_batch)``: the burst plan for that B_G, computed on first use.

    Args:
        graph_for_batch: ``B_G -> LayerGraph`` with ``comp_time[g]`` measured at per-GPU batch
            ``B_G / g`` (called once per distinct B_G).
        network: the network model of the job's GPUs.
        total_gpus: G.
        amplification_limit: the job's limit (>= 1).
    """

    def __init__(self, graph_for_batch: Callable[[int], LayerGraph], network: NetworkModel,
                 total_gpus: int, amplification_limit: float, powers_of_two: bool = True) -> None:
        self.graph_for_batch = graph_for_batch
        self.network = network
        self.total_gpus = check_int("total_gpus", total_gpus, min_value=1)
        self.amplification_limit = check_float("amplification_limit", amplification_limit, min_value=1.0)
        self.powers_of_two = powers_of_two
        self.plans: dict[int, BurstPlan] = {}
        self.misses = 0

    def plan(self, global_batch: int) -> BurstPlan:
        check_int("global_batch", global_batch, min_value=1)
        hit = self.plans.get(global_batch)
        if hit is None:
            self.misses += 1
            hit = self.plans[global_batch] = plan_burst(
                self.graph_for_batch(global_batch), self.network, self.total_gpus,
                self.amplification_limit, powers_of_two=self.powers_of_two)
        return hit
