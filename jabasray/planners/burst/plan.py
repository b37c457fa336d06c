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

    def placement(self) -> dict[str, tuple[int, int]]:
        """Where each layer runs: ``name -> (first, count)``, ranks ``first .. first+count-1`` of
        the job's ``total_gpus`` ranks.

        The layout the planner's costs assume: a layer uses the first ``count`` ranks of its
        lane (so consecutive layers re-shard over the same first ranks, ``rescale_fraction``);
        in a block whose lanes run in parallel, the k-th lane moved to its own GPUs (k = 1, 2,
        ... in lane order) is shifted by ``k * lane_gpu_cap`` ranks, disjoint from the lanes
        that stay (``disjoint_fraction``).  Blocks are listed outer first, so the shifts of
        nested blocks add up.
        """
        first = {lp.name: 0 for lp in self.layers}
        for block in self.blocks:
            moved = 0
            for lane, is_parallel in zip(block.lanes, block.parallel):
                if is_parallel:
                    moved += 1
                    for name in lane:
                        first[name] += moved * block.lane_gpu_cap
        out = {lp.name: (first[lp.name], lp.gpus) for lp in self.layers}
        for name, (start, count) in out.items():
            if start + count > self.total_gpus:
                raise ValueError(f"plan places layer {name!r} on ranks {start}..{start + count - 1}, "
                                 f"beyond total_gpus={self.total_gpus}")
        return out

    @classmethod
    def uniform(cls, names: list[str], gpus: int) -> "BurstPlan":
        """Every layer on all ``gpus`` ranks: plain data parallelism as a burst plan (no
        prediction attached: times 0, limit inf)."""
        layers = [LayerPlan(name, gpus, 0.0, 0.0, 0.0, 0.0) for name in names]
        return cls(0.0, 0.0, gpus, float("inf"), [gpus], layers, [])


@dataclass
class Evaluation(JsonMixin):
    """Cost of one explicit assignment (``evaluate_assignment``)."""

    iteration_time: float             # inf when infeasible
    feasible: bool
    reason: str                       # why infeasible ("" when feasible)
    layers: list[LayerPlan]

