"""DeepPool burst-parallel planner: a GPU count for every layer under a GPU-sec amplification limit.

Implements §4 of DeepPool: Algorithm 1 ("Search
Linear") for a chain of layers, and the branch/join graph reduction of §4.2 for graphs whose
chains fork and join (Inception, residual blocks).  Pure Python + numpy, no torch, no ray.
``engine/burst.py`` executes the plans.

Modules: :mod:`.graph` (the input layer DAG and its series-parallel decomposition),
:mod:`.costs` (network model, transfer fractions, :class:`BurstProblem` with every cost
precomputed), :mod:`.search` (the DP, :func:`plan_burst`), :mod:`.plan` (the outputs),
:mod:`.reference` (scalar evaluation of one assignment, the paper's literal Algorithm 1),
:mod:`.cache` (plans per global batch).

Implementation notes
--------------------
Cost model (§4.1, "we simply divide the payload size by the bandwidth and add the propagation
delay"), with per-GPU bandwidth ``B`` (bytes/s) and propagation delay ``d`` (s):

* ``comp(i, g)``: forward+backward time of layer i at per-GPU batch ``global/g`` (given).
* ``sync(i, g) = 2 (g-1)/g * P_i / B + d`` for ``g > 1`` (ring all-reduce payload of the
  layer's ``P_i`` parameter bytes), 0 for ``g = 1`` or ``P_i = 0``.
* ``comm((i,g) -> (j,h)) = 2 (f(g,h) * A_i / B + d)`` for ``g != h``, 0 for ``g == h``: the
  activation ``A_i`` (global batch) goes forward and its gradient backward.  ``f`` is the
  largest fraction of ``A_i`` one GPU sends or receives when samples are re-sharded
  contiguously from GPUs ``0..g-1`` to ``0..h-1`` (``rescale_fraction``, closed form; equals
  ``1/min(g,h)`` for powers of two >= 2).  When a branch runs on its *own* GPU set (see below)
  nothing stays local and ``f = max(1/g, 1/h)`` (``disjoint_fraction``).

Amplification (§4.2): ``Amp(i, g) = T[i][g] * g / comp(i, 1)`` where
``T[i][g] = comm_in + comp(i,g) + sync(i,g)`` is the time spent on layer i *for the chosen
predecessor*.  Because T depends on the incoming edge, the limit is a constraint on each edge
``(i-1,h) -> (i,g)``::

    (comm((i-1,h)->(i,g)) + comp(i,g) + sync(i,g)) * g  <=  AmpLimit * comp(i,1)

and the DP of Algorithm 1 becomes an exact shortest path over feasible edges:
``S[i][g] = min_h S[i-1][h] + comm + comp(i,g) + sync(i,g)`` over feasible h, ``S[0][g]=0``.

*Deviation from the paper's pseudo-code.*  Algorithm 1 filters predecessor *states* by their
already fixed ``Amp(i-1,h)`` and accepts the first candidate unconditionally
(``bestAmp = inf`` makes ``max(bestAmp, AmpLimit) = inf``), so a returned plan can exceed the
limit, and a state whose cheapest predecessor breaks the limit is dropped although another
predecessor would have kept it feasible.  Checking the same ``Amp`` on the edge instead gives
the optimum under exactly the paper's definition (tests compare with exhaustive search) and
every returned plan respects the limit.  ``search_linear_paper`` keeps a literal transcription
for comparison.  The all-one-GPU plan always satisfies the limit (``AmpLimit >= 1``), so a plan
always exists.  A layer with several incoming edges (a join) is checked once per incoming edge.

*Zero-compute layers.*  ``Amp`` divides by ``comp(i, 1)``; a layer that does no work (an
Inception concat profiled at 0, the profiler's ``output`` join) would make every transfer into
it infinitely amplified, so no branch could ever run on its own GPUs (their outputs must move
to the join).  Such a layer has no work of its own to amplify: a transfer into it is overhead of
the data it carries, so it is judged against the work that produced that data.  Per edge
``u -> v`` the reference work is ``comp(v, 1)``, or for ``comp(v, 1) = 0`` the reference work of
``u`` (recursively: a zero-compute layer's reference work is the largest of its inputs', 0 for
a zero-compute input layer), and the edge is feasible iff
``(comm + comp(v,h) + sync(v,h)) * h <= AmpLimit * reference``.  Layers with work are unchanged
(exactly the paper's definition); the all-one-GPU plan stays feasible.  Only exact zeros get
this rule: a measured concat of a few microseconds is a layer like any other.

Graph reduction (§4.2, Fig. 7).  The layer DAG is decomposed into a series-parallel tree: a
*block* is a branching layer ``s``, a joining layer ``t`` and the chains ("lanes") between them
(a lane may contain nested blocks, or be a bare edge such as a residual shortcut).  For every
block the planner computes the transition cost ``tau[(s,g) -> (t,h)]`` with linear searches
on each lane for every ``(g, h)``, as the paper describes, and the enclosing chain uses ``tau``
in place of ``comm``.  ``R_i[g, h]`` is lane i's best time on the shared GPUs (from the end of
``s`` to its data arriving at ``t``), ``Q_i[g, h]`` its best time on a new set of GPUs (transfers
in and out with the disjoint fraction).  The paper lets the join keep the critical branch and
greedily move other branches to new GPUs when that "won't increase the total training time or
overshoot the amplification limit"; we take the exact minimum over every choice P of lanes
moved (at least one lane stays):

    tau = min_P max( sum_{i not in P} R_i , max_{i in P} Q_i )

The paper does not say how many GPUs a parallel lane may use; we split the pool evenly: with
``m = |P| + 1`` concurrent lanes every layer inside the block uses at most ``cap_m`` = the
largest candidate count ``<= cap // m`` (``cap`` = G, or the enclosing lane's cap), so the lanes
always fit on the G GPUs.  Every transfer into the join is checked against the join's limit on
its own edge.

Vectorisation.  Lane costs are min-plus matrices over (count of s, count of t), built with numpy
(``O(n^3)`` per inner layer for n candidate counts); the top-level chain carries a single row,
the paper's S vector (``O(n^2)`` per layer).  All edge matrices (with the limit applied) are
built in one numpy expression per problem, and a plain-chain lane is computed for all its
variants (shared/own GPUs, caps) in one stacked pass.  Argmins are recomputed only for the
cells the backtrace visits.

Table 3 limits the search to powers of two (``powers_of_two=True``, the default); with
``False`` every count 1..G is a candidate.
"""
from __future__ import annotations

from .cache import BurstPlanCache
from .costs import (BurstProblem, NetworkModel, amplification, candidate_gpu_counts,
                    disjoint_fraction, rescale_fraction)
from .graph import LayerGraph, LayerSpec
from .plan import BlockPlan, BurstPlan, Evaluation, LayerPlan
from .reference import evaluate_assignment, search_linear_paper
from .search import plan_burst

__all__ = ["LayerSpec", "LayerGraph", "NetworkModel", "LayerPlan", "BlockPlan", "BurstPlan",
           "Evaluation", "BurstProblem", "candidate_gpu_counts", "rescale_fraction",
           "disjoint_fraction", "amplification", "plan_burst", "evaluate_assignment",
           "search_linear_paper", "BurstPlanCache"]
