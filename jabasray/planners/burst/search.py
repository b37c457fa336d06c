"""The search (DeepPool Algorithm 1 + the branch/join graph reduction of section 4.2), vectorised
as min-plus products over GPU-count indices; see the package docstring for the algorithm."""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field

import numpy as np

from .costs import BurstProblem, NetworkModel
from .graph import Edge, LayerGraph, Parallel, Series, SPTree, blocks_of
from .plan import BlockPlan, BurstPlan
from .reference import evaluate_assignment

log = logging.getLogger(__name__)

_INF = math.inf
# A block with k lanes has 2^k - 1 serial/parallel choices, all enumerated for k <= 8 (Inception
# has at most 4).  Wider blocks only consider moving ONE lane to its own GPUs (search stays
# polynomial; the optimum over all choices is then not guaranteed for such blocks).
_MAX_ENUMERATED_LANES = 8


@dataclass
class StepRecord:
    """Backtrace record of one propagation step.  Argmins are not stored: the backtrace
    recomputes ``argmin_g v_in[row, g] + mat[g, col]`` for the one cell it visits."""

    v_in: np.ndarray | None = None         # rows of the step's input (None: identity start)
    mat: np.ndarray | None = None          # edge cost or block transition tau
    parts: list["StepRecord"] = field(default_factory=list)    # series: one per part
    values: list[np.ndarray] = field(default_factory=list)  # parallel: tau of each option
    options: list[tuple] = field(default_factory=list)    # parallel: per option, per lane (key, is_par)

    def start_index(self, row: int, col: int) -> int:
        """Count index of the step's start layer on the best path to ``(row, col)``."""
        if self.v_in is None:
            return row
        return int(np.argmin(self.v_in[row] + self.mat[:, col]))


@dataclass
class ChainRecord:
    """Backtrace record of a chain lane computed for several variants at once."""

    steps: list[tuple[np.ndarray, np.ndarray]]   # per inner layer: (input rows, next edge), stacked
    variant: int                                  # index on the stacked axis


def min_plus(v: np.ndarray | None, mat: np.ndarray) -> np.ndarray:
    """``out[r, h] = min_g v[r, g] + mat[g, h]``; ``v is None`` is the min-plus identity."""
    if v is None:
        return mat
    return (v[:, :, None] + mat[None, :, :]).min(axis=1)


class LaneSearch:
    """Vectorised DP over the SP tree (Algorithm 1 + graph reduction)."""

    def __init__(self, prob: BurstProblem) -> None:
        self.problem = prob
        self.memo: dict[tuple, tuple[np.ndarray, StepRecord]] = {}

    def lane(self, tree: SPTree, disjoint_in: bool, disjoint_out: bool,
             cap: int) -> tuple[np.ndarray, StepRecord]:
        """Cost matrix ``M[g_start, g_end]`` of a lane (memoised per variant).  ``disjoint_in``
        / ``disjoint_out``: the lane runs on its own GPUs, so the transfer from its start layer
        / into its end layer moves all data (disjoint fraction); ``cap``: max count inside."""
        key = (id(tree), disjoint_in, disjoint_out, cap)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.propagate(tree, None, disjoint_in, disjoint_out, cap)
            self.memo[key] = hit
        return hit

    def lanes_for(self, tree: SPTree, keys: list[tuple[bool, bool, int]]) -> None:
        """Memoise every variant ``keys`` of a lane.  A plain chain (no nested block) is done
        for all variants at once, stacked on a leading axis, so numpy calls do not grow with
        the number of variants."""
        todo = [key for key in dict.fromkeys(keys) if (id(tree), *key) not in self.memo]
        if not todo:
            return
        if isinstance(tree, Edge):
            parts, mids = [tree], []
        elif isinstance(tree, Series) and all(isinstance(p, Edge) for p in tree.parts):
            parts, mids = tree.parts, tree.mids
        else:
            for key in todo:
                self.lane(tree, *key)
            return
        last = len(parts) - 1

        def edges(i: int) -> np.ndarray:
            flags = [(into and i == 0) or (out_of and i == last) for into, out_of, _ in todo]
            return self.problem.edge_matrices(parts[i].start, parts[i].end, flags)

        caps = [cap for _, _, cap in todo]
        mat = edges(0)
        steps: list[tuple[np.ndarray, np.ndarray]] = []
        for i, mid in enumerate(mids):
            v_in = mat + self.problem.node_costs(mid, caps)[:, None, :]
            e = edges(i + 1)
            steps.append((v_in, e))
            mat = (v_in[:, :, :, None] + e[:, None, :, :]).min(axis=2)
        for vi, key in enumerate(todo):
            self.memo[(id(tree), *key)] = (mat[vi], ChainRecord(steps, vi))

    def propagate(self, tree: SPTree, v: np.ndarray | None, disjoint_in: bool, disjoint_out: bool,
                  cap: int) -> tuple[np.ndarray, StepRecord]:
        """``out[r, h] = min_g v[r, g] + cost_tree[g, h]``; ``disjoint_in`` / ``disjoint_out``:
        the edges touching the tree's start / end layer are transfers between disjoint GPU sets."""
        if isinstance(tree, Edge):
            mat = self.problem.edge_matrix(tree.start, tree.end, disjoint_in or disjoint_out)
            return min_plus(v, mat), StepRecord(v, mat)
        if isinstance(tree, Series):
            recs = []
            last = len(tree.parts) - 1
            for i, part in enumerate(tree.parts):
                v, rec = self.propagate(part, v, disjoint_in and i == 0, disjoint_out and i == last, cap)
                recs.append(rec)
                if i < last:
                    v = v + self.problem.node_costs(tree.mids[i], [cap])
            return v, StepRecord(parts=recs)
        return self.parallel(tree, v, disjoint_in, disjoint_out, cap)

    def parallel(self, tree: Parallel, v: np.ndarray | None, disjoint_in: bool, disjoint_out: bool,
                 cap: int) -> tuple[np.ndarray, StepRecord]:
        """Branch/join reduction: ``tau[g, h]`` over serial / parallel lane choices."""
        k = len(tree.lanes)
        options: list[tuple] = []
        values: list[np.ndarray] = []
        serial_key = (disjoint_in, disjoint_out, cap)
        max_side = (k - 1 if k <= _MAX_ENUMERATED_LANES else 1) if self.problem.parallel_branches else 0
        sub_caps: list[int] = []          # sub_caps[size - 1]: lane cap with size lanes moved
        for size in range(1, max_side + 1):
            sub_cap = self.problem.split_cap(cap, size + 1)
            if sub_cap is None:           # cap // lanes only shrinks as lanes are added
                break
            sub_caps.append(sub_cap)
        keys = [serial_key] + [key for sc in sub_caps
                               for key in ((disjoint_in, disjoint_out, sc), (True, True, sc))]
        for lane in tree.lanes:
            self.lanes_for(lane, keys)
        options.append(tuple((serial_key, False) for _ in range(k)))
        values.append(sum(self.lane(lane, *serial_key)[0] for lane in tree.lanes))
        for size, sub_cap in enumerate(sub_caps, start=1):
            main_key, par_key = (disjoint_in, disjoint_out, sub_cap), (True, True, sub_cap)
            for par in itertools.combinations(range(k), size):
                main = sum(self.lane(tree.lanes[i], *main_key)[0] for i in range(k) if i not in par)
                side = np.maximum.reduce([self.lane(tree.lanes[i], *par_key)[0] for i in par])
                options.append(tuple((par_key, True) if i in par else (main_key, False)
                                     for i in range(k)))
                values.append(np.maximum(main, side))
        tau = np.minimum.reduce(values) if len(values) > 1 else values[0]
        return min_plus(v, tau), StepRecord(v, tau, values=values, options=options)

    # -- backtrace
    def backtrace(self, tree: SPTree, rec: StepRecord, row: int, col: int,
                  assign: dict[str, int], blocks: dict[tuple[str, str], tuple]) -> int:
        """Fill ``assign`` (layer -> count index) for the inner layers; return the start column."""
        if isinstance(rec, ChainRecord):
            cur = col
            for i in range(len(rec.steps) - 1, -1, -1):
                v_in, e = rec.steps[i]
                cur = int(np.argmin(v_in[rec.variant, row] + e[rec.variant, :, cur]))
                assign[tree.mids[i]] = cur
            return row
        if isinstance(tree, Edge):
            return rec.start_index(row, col)
        if isinstance(tree, Series):
            cur = col
            for i in range(len(tree.parts) - 1, -1, -1):
                cur = self.backtrace(tree.parts[i], rec.parts[i], row, cur, assign, blocks)
                if i > 0:
                    assign[tree.mids[i - 1]] = cur
            return cur
        start = rec.start_index(row, col)
        option = rec.options[int(np.argmin([val[start, col] for val in rec.values]))]
        for lane, (key, _) in zip(tree.lanes, option):
            _, lane_rec = self.memo[(id(lane), *key)]
            got = self.backtrace(lane, lane_rec, start, col, assign, blocks)
            if got != start:  # pragma: no cover - internal invariant
                raise RuntimeError("burst planner backtrace lost the branch layer's GPU count")
        blocks[(tree.start, tree.end)] = (tuple(is_par for _, is_par in option), option[0][0][2])
        return start


def plan_burst(graph: LayerGraph, network: NetworkModel, total_gpus: int,
               amplification_limit: float, powers_of_two: bool = True,
               parallel_branches: bool = True) -> BurstPlan:
    """Find per-layer GPU counts minimising the iteration time under the amplification limit.

    Args:
        graph: layer DAG (single input and output layer, series-parallel) with
            ``comp_time[g]`` for every candidate count ``g``.
        network: per-GPU bandwidth and propagation delay (§4.1).
        total_gpus: G, GPUs available to the job (>= 1).
        amplification_limit: max ``Amp(i, g) = T[i][g] * g / comp(i, 1)`` of any layer (>= 1).
        powers_of_two: consider only GPU counts that are powers of two (Table 3's setting).
        parallel_branches: allow non-critical branches to run concurrently on their own GPUs.

    Returns:
        the optimal :class:`BurstPlan` under the cost model of the module docstring.
    """
    prob = BurstProblem(graph, network, total_gpus, amplification_limit, powers_of_two,
                        parallel_branches)
    search = LaneSearch(prob)
    src, snk = prob.source, prob.sink
    # Source layer: no incoming transfer, Amp(src, g) = (comp + sync) * g / comp(src, 1).
    src_ok = prob.work[src] * prob.cs <= prob.edge_budget(None, src)
    v0 = np.where(src_ok, prob.work[src], _INF)[None, :]
    assign: dict[str, int] = {}
    blocks: dict[tuple[str, str], tuple] = {}
    if prob.tree is None:                      # a single layer
        final = v0[0]
        end = int(np.argmin(final))
        assign[src] = end
    else:                                      # S vector through the whole reduced chain
        vt, rec = search.propagate(prob.tree, v0, False, False, prob.total_gpus)
        final = vt[0] + prob.work[snk]
        end = int(np.argmin(final))
        assign[snk] = end
        assign[src] = search.backtrace(prob.tree, rec, 0, end, assign, blocks)
    best = float(final[end])
    counts = {name: prob.counts[idx] for name, idx in assign.items()}
    decisions = {key: val[0] for key, val in blocks.items()}
    ev = evaluate_assignment(prob, counts, decisions)
    if not ev.feasible or not math.isclose(ev.iteration_time, best, rel_tol=1e-9, abs_tol=1e-15):
        raise RuntimeError(f"burst planner inconsistency: DP {best} vs evaluation "
                           f"{ev.iteration_time} ({ev.reason})")  # pragma: no cover
    block_plans = [BlockPlan(s, t, [lane.nodes() for lane in tree.lanes], list(blocks[(s, t)][0]),
                             int(blocks[(s, t)][1]))
                   for s, t, tree in blocks_of(prob.tree) if (s, t) in blocks]
    gpu_sec = sum(lp.gpus * (lp.comm_in_time + lp.comp_time + lp.sync_time) for lp in ev.layers)
    log.debug("burst plan: %d layers, G=%d, limit=%.3g -> %.6g s", len(ev.layers),
              prob.total_gpus, prob.limit, best)
    return BurstPlan(iteration_time=best, gpu_sec=float(gpu_sec), total_gpus=prob.total_gpus,
                     amplification_limit=prob.limit, candidate_gpu_counts=list(prob.counts),
                     layers=ev.layers, blocks=block_plans)


