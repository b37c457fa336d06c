"""Planner outputs: the per-layer GPU counts of a burst plan and the evaluation of one assignment."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...serialization import JsonMixin

@dataclass
class LayerPlan(JsonMixin):
    """Per-layer outcome: the GPU count and the terms of ``T[i][g]``."""

    name: str
    gpus: int
    comp_time: float
    sync_time: float
    comm_in_time: float      # all transfers into this layer (fwd activation + bwd gradient)
    amplification: float     # max over incoming edges of (comm + comp + sync) * g / comp(i,1)


@dataclass
class BlockPlan(JsonMixin):
    """One branch/join block: which lanes run in parallel on their own GPUs."""

    branch: str                  # branching layer s
    join: str                    # joining layer t
    lanes: list[list[str]]       # layer names inside each lane ([] = direct edge s -> t)
    parallel: list[bool]         # lane runs on a separate GPU set, concurrently
    lane_gpu_cap: int            # max GPU count of any layer inside the block


@dataclass
class BurstPlan(JsonMixin):
    """Planner output (§4): per-layer GPU counts minimising the iteration time."""

    iteration_time: float
    gpu_sec: float                       # sum over layers of g * (comm_in + comp + sync)
    total_gpus: int
    amplification_limit: float
    candidate_gpu_counts: list[int]
    layers: list[LayerPlan]
    blocks: list[BlockPlan] = field(default_factory=list)

    @property
    def gpu_counts(self) -> dict[str, int]:
        return {lp.name: lp.gpus for lp in self.layers}

    @property
    def max_amplification(self) -> float:
        return max(lp.amplification for lp in self.layers)


@dataclass
class Evaluation(JsonMixin):
    """Cost of one explicit assignment (``evaluate_assignment``)."""

    iteration_time: float             # inf when infeasible
    feasible: bool
    reason: str                       # why infeasible ("" when feasible)
    layers: list[LayerPlan]

