"""Reference computations: the cost of one explicit assignment by a scalar walk over the graph
(what the tests' exhaustive search scores with), and a literal transcription of the paper's
Algorithm 1 (kept for comparison; see the package docstring for why the search deviates)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .costs import BurstProblem, amplification
from .graph import Edge, Series, SPTree
from .plan import Evaluation, LayerPlan

_INF = math.inf


def evaluate_assignment(problem: BurstProblem, counts: dict[str, int],
                        parallel: dict[tuple[str, str], Sequence[bool]] | None = None,
                        enforce_limit: bool = True) -> Evaluation:
    """Iteration time of an explicit plan, by walking the SP tree with scalar arithmetic.

    ``counts`` gives every layer's GPU count; ``parallel[(branch, join)]`` says per lane (in
    ``BlockPlan.lanes`` order) whether it runs on its own GPUs (default: all serial).  This is
    the reference the search is checked against (exhaustive search = enumerate + evaluate).
    ``enforce_limit=False`` still reports each layer's amplification but does not call a plan
    over the limit infeasible (to price e.g. plain data parallelism on all G GPUs).
    """
    p = problem
    parallel = parallel or {}
    idx = {g: i for i, g in enumerate(p.counts)}
    for name in p.order:
        if name not in counts or counts[name] not in idx:
            raise ValueError(f"counts[{name}] must be one of {p.counts}, got {counts.get(name)!r}")
    comm_in = {n: 0.0 for n in p.order}
    amp = {n: 0.0 for n in p.order}
    problems: list[str] = []

    def work(v: str) -> float:
        return float(p.work[v][idx[counts[v]]])

    def check_amp(u: str | None, v: str, comm: float) -> None:
        g = counts[v]
        t = comm + work(v)
        amp[v] = max(amp[v], amplification(t, g, p.edge_reference(u, v)))
        if enforce_limit and t * g > p.edge_budget(u, v):
            problems.append(f"Amp({v}, {g}) exceeds {p.limit}")

    def lane_time(tree: SPTree, disjoint_in: bool, disjoint_out: bool, cap: int) -> float:
        if isinstance(tree, Edge):
            comm = p.comm_matrix(tree.start, disjoint_in or disjoint_out)
            c = float(comm[idx[counts[tree.start]], idx[counts[tree.end]]])
            comm_in[tree.end] += c
            check_amp(tree.start, tree.end, c)
            return c
        if isinstance(tree, Series):
            total = 0.0
            last = len(tree.parts) - 1
            for i, part in enumerate(tree.parts):
                total += lane_time(part, disjoint_in and i == 0, disjoint_out and i == last, cap)
                if i < last:
                    m = tree.mids[i]
                    if counts[m] > cap:
                        problems.append(f"{m} uses {counts[m]} GPUs > lane cap {cap}")
                    total += work(m)
            return total
        flags = list(parallel.get((tree.start, tree.end), [False] * len(tree.lanes)))
        if len(flags) != len(tree.lanes) or all(flags):
            raise ValueError(f"parallel[({tree.start!r}, {tree.end!r})] must have {len(tree.lanes)} flags, "
                             f"not all True, got {flags}")
        if not any(flags):
            return sum(lane_time(lane, disjoint_in, disjoint_out, cap) for lane in tree.lanes)
        sub = p.split_cap(cap, sum(flags) + 1)
        if sub is None or not p.parallel_branches:
            problems.append(f"block {tree.start}->{tree.end} cannot run {sum(flags) + 1} lanes in parallel")
            return _INF
        main = sum(lane_time(lane, disjoint_in, disjoint_out, sub)
                   for lane, f in zip(tree.lanes, flags) if not f)
        side = max(lane_time(lane, True, True, sub) for lane, f in zip(tree.lanes, flags) if f)
        return max(main, side)

    total = work(p.source)
    check_amp(None, p.source, 0.0)
    if p.tree is not None:
        total += lane_time(p.tree, False, False, p.total_gpus) + work(p.sink)
    feasible = not problems
    layers = [LayerPlan(n, counts[n], float(p.comp[n][idx[counts[n]]]), float(p.sync[n][idx[counts[n]]]),
                        comm_in[n], amp[n]) for n in p.order]
    return Evaluation(total if feasible else _INF, feasible, "; ".join(problems[:3]), layers)


# --------------------------------------------------------------------------- paper transcription


def search_linear_paper(comp: np.ndarray, comm: np.ndarray, sync: np.ndarray,
                        counts: Sequence[int], amp_limit: float) -> tuple[float, list[int]]:
    """Literal transcription of Algorithm 1 (for comparison only; see module docstring).

    ``comp[i, g]``, ``sync[i, g]``: (L, n) over count indices; ``counts[g]`` the GPU count of
    index g (``counts[0] == 1``); ``comm[i, h, g]``: (L, n, n) transfer into layer i from count
    index h of layer i-1 (``comm[0]`` unused).  Returns (S at the best final count,
    count index per layer); the final layer picks argmin S among states within the limit
    (or overall argmin if none is).
    """
    L, n = comp.shape
    S = np.zeros((L, n))
    T = np.zeros((L, n))
    back = np.zeros((L, n), dtype=int)
    for i in range(L):
        for g in range(n):
            if i == 0:                               # S[0][g] = 0: no predecessor transfer
                S[i, g] = comp[i, g] + sync[i, g]
                T[i, g] = S[i, g]
                continue
            best_amp = best_s = best_t = _INF
            for h in range(n):
                a = amplification(T[i - 1, h], counts[h], comp[i - 1, 0])
                cand = S[i - 1, h] + comm[i, h, g]
                if a <= max(best_amp, amp_limit) and cand <= best_s:
                    best_s, best_t = cand, comm[i, h, g]
                    best_amp = min(best_amp, a)
                    back[i, g] = h
            S[i, g] = best_s + comp[i, g] + sync[i, g]
            T[i, g] = best_t + comp[i, g] + sync[i, g]
    amps = np.array([amplification(T[L - 1, g], counts[g], comp[L - 1, 0]) for g in range(n)])
    pool = np.where(amps <= amp_limit)[0]
    end = int(pool[np.argmin(S[L - 1, pool])]) if len(pool) else int(np.argmin(S[L - 1]))
    path = [end]
    for i in range(L - 1, 0, -1):
        path.append(int(back[i, path[-1]]))
    return float(S[L - 1, end]), path[::-1]
