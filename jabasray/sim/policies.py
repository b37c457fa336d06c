"""The policies a simulated job runs under: JABAS and the baselines of JABAS section 7.1.

Each policy answers four questions from the simulator's state (:class:`SimState`), and nothing
else differs between them in the loop (:mod:`.loop`):

* ``start``: the allocation of the first epoch;
* ``epoch_batch``: a global batch set at an epoch's start (Pollux), or None (the batch-size
  rule's B_G carries on);
* ``plan``: the configuration that runs a requested B_G on the allocation;
* ``next_epoch``: the allocation of the next epoch (:class:`NextEpoch`: with the forecast of its
  B_G trajectory and the auto-scaler's decision record,
  :func:`jabasray.actors.metrics.decision_record`, where the policy makes them).

``adaptive`` says whether the SimiGrad rule moves B_G every p iterations
(:class:`jabasray.adaptive.AdaptiveBatchController`, the driver's own).

=========== ========================================= ============= =====================
policy      global batch                              GPUs          local batches
=========== ========================================= ============= =====================
static      B_G^init, fixed                           all           equal (straggler)
simigrad    SimiGrad rule every p iterations          all           equal (straggler)
pollux      goodput-optimal, every epoch              all           equal (straggler)
pollux-as   goodput-optimal, every epoch              Pollux-AS     equal (straggler)
jabas       SimiGrad rule every p iterations          auto-scaler   IIDP (Alg. 1 plans)
=========== ========================================= ============= =====================

JABAS decides with exactly the driver's code: the plan of an interval is
:meth:`jabasray.planners.job_planner.JobPlanner.plan`, the initial and every next allocation
:func:`jabasray.actors.placement.next_allocation` on the forecast of
:func:`jabasray.adaptive.forecast.forecast_next_epoch`, charged the re-placement time
(``JobConfig.replacement_cost_s``, else the last placement's), with the job planner's plan cache.

Pollux (Pollux section 3.1; as the JABAS paper ran it, section 7.1): all GPUs, equal local
batches, the batch of greatest goodput (:func:`.baselines.goodput`) on a grid of
[min B_G, max B_G] (:func:`.baselines.batch_grid`) chosen at every epoch's start from the
statistical efficiency at the job's progress. Pollux-AS adds the scaling policy of JABAS section
7.1: it starts on one node, the slowest (least TFLOPS, as the paper starts it), and at an
epoch's end, while its goodput exceeds U = 2/3 of the ideal (every allocated GPU at its
single-GPU goodput), it adds the next slowest node as long as the goodput there stays at least
L = 1/2 of that node set's ideal. Pollux's GNS monitoring overhead (14.3 % of the training time
for ResNet-50 in JABAS section 7.7) is not charged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..actors.metrics import decision_record
from ..actors.placement import full_allocation, group_gpus, multi_node, next_allocation, slots_for
from ..adaptive.forecast import forecast_next_epoch
from ..config import JobConfig
from ..planners.job_planner import JobPlanner
from ..types import ClusterSpec, Plan, units_num_gpus
from .baselines import batch_grid, equal_batch_plan, goodput

POLICIES = ("static", "simigrad", "pollux", "pollux-as", "jabas")
POLLUX_AS_UP = 2.0 / 3.0     # U of JABAS section 7.1
POLLUX_AS_LOW = 0.5          # L of JABAS section 7.1


@dataclass
class SimState:
    """What a policy reads: the job, the cluster, the job planner over the current
    iteration-time model, the convergence model, the run so far."""

    job: JobConfig
    cluster: ClusterSpec
    dataset_size: int
    planner: JobPlanner
    convergence: Any                         # efficiency(progress, batch) & co (.convergence)
    progress: float = 0.0                    # samples at the reference batch (Pollux's unit)
    epochs_done: int = 0
    trajectories: list[list[int]] = field(default_factory=list)   # completed epochs' B_G
    replacement_s: float = 0.0               # what the last placement took (the JABAS charge)

    def units(self, allocation: dict[str, int]) -> tuple[list[str], bool]:
        """Group H and whether ``allocation`` spans several nodes (the driver's slots)."""
        slots = slots_for(self.cluster, allocation)
        return group_gpus(slots), multi_node(slots)


@dataclass(frozen=True)
class NextEpoch:
    """A policy's epoch-end answer."""

    allocation: dict[str, int]
    forecast: list[float] = field(default_factory=list)   # the next epoch's B_G (JABAS)
    decision: dict = field(default_factory=dict)          # decision_record (JABAS)


class Policy:
    """Base: all GPUs, fixed B_G^init, equal local batches (static data parallelism)."""

    name = "static"
    adaptive = False

    def start(self, state: SimState) -> dict[str, int]:
        return full_allocation(state.cluster)

    def epoch_batch(self, state: SimState, allocation: dict[str, int]) -> int | None:
        return None

    def plan(self, state: SimState, allocation: dict[str, int], batch: int) -> Plan:
        units, multi = state.units(allocation)
        return equal_batch_plan(batch, units, state.planner.alloc_model(units_num_gpus(units), multi),
                                state.job.min_local_batch)

    def next_epoch(self, state: SimState, allocation: dict[str, int]) -> NextEpoch:
        return NextEpoch(allocation)


class StaticPolicy(Policy):
    pass


class SimiGradPolicy(Policy):
    """SimiGrad: the similarity rule on all GPUs with equal local batches."""

    name = "simigrad"
    adaptive = True


class PolluxPolicy(Policy):
    """Pollux: the goodput-optimal batch on all GPUs, chosen every epoch (module notes)."""

    name = "pollux"

    def epoch_batch(self, state: SimState, allocation: dict[str, int]) -> int | None:
        return best_goodput(state, allocation)[0]


class PolluxASPolicy(PolluxPolicy):
    """Pollux-AS: Pollux plus the node-by-node scaling of JABAS section 7.1 (module notes)."""

    name = "pollux-as"

    def start(self, state: SimState) -> dict[str, int]:
        first = slowest_first(state.cluster)[0]
        return {first.name: first.num_gpus}

    def next_epoch(self, state: SimState, allocation: dict[str, int]) -> NextEpoch:
        order = slowest_first(state.cluster)
        held = [n for n in order if n.name in allocation]
        rest = [n for n in order if n.name not in allocation]
        nodes = held
        while rest and best_goodput(state, _whole(nodes))[1] > POLLUX_AS_UP * ideal_goodput(state, nodes):
            more = nodes + [rest[0]]
            if best_goodput(state, _whole(more))[1] < POLLUX_AS_LOW * ideal_goodput(state, more):
                break
            nodes, rest = more, rest[1:]
        return NextEpoch(_whole(nodes))


class JabasPolicy(Policy):
    """JABAS: the driver's own planners (module notes)."""

    name = "jabas"
    adaptive = True

    def start(self, state: SimState) -> dict[str, int]:
        return self._next(state, None, None, 0.0)[0]

    def plan(self, state: SimState, allocation: dict[str, int], batch: int) -> Plan:
        units, multi = state.units(allocation)
        return state.planner.plan(batch, units, multi)

    def next_epoch(self, state: SimState, allocation: dict[str, int]) -> NextEpoch:
        # the driver's _decide_next_epoch: forecast, re-placement charge, auto-scaler
        forecast = forecast_next_epoch(state.trajectories, state.job, state.dataset_size)
        switch = float(state.job.replacement_cost_s) if state.job.replacement_cost_s is not None \
            else state.replacement_s
        chosen, _, decision = self._next(state, forecast, allocation, switch)
        return NextEpoch(chosen, [float(x) for x in forecast],
                         decision_record(decision, allocation, switch) if decision is not None else {})

    @staticmethod
    def _next(state: SimState, forecast: Sequence[float] | None, current: dict[str, int] | None,
              switch_s: float) -> tuple:
        # the driver's JabasDriver._next_allocation, with its plan cache
        return next_allocation(state.cluster, state.planner.model, forecast, state.dataset_size,
                               state.job, fixed=not state.job.autoscale, current=current,
                               switch_cost_s=switch_s, plan_cache=state.planner.plan_cache)


def slowest_first(cluster: ClusterSpec) -> list:
    """Nodes by Eq. 8 price weight (TFLOPS, else speed), slowest first, cluster order on ties."""
    return sorted(cluster.nodes, key=lambda n: n.price_weight)


def _whole(nodes: Sequence) -> dict[str, int]:
    return {n.name: n.num_gpus for n in nodes}


def best_goodput(state: SimState, allocation: dict[str, int]) -> tuple[int, float]:
    """Pollux's choice on ``allocation``: (the grid batch of greatest goodput, that goodput),
    the statistical efficiency taken at the job's progress."""
    units, multi = state.units(allocation)
    model = state.planner.alloc_model(units_num_gpus(units), multi)
    best = (state.job.min_global_batch, -1.0)
    for m in batch_grid(state.job.min_global_batch, state.job.max_global_batch):
        plan = equal_batch_plan(m, units, model, state.job.min_local_batch)
        g = goodput(plan, state.convergence.efficiency(state.progress, plan.global_batch_size))
        if g > best[1]:
            best = (m, g)
    return best


def ideal_goodput(state: SimState, nodes: Sequence) -> float:
    """The ideal scaling goodput of ``nodes``: every GPU at the goodput one GPU of its type
    reaches alone (Pollux-AS's yardstick, JABAS section 7.1)."""
    single: dict[str, float] = {}
    total = 0.0
    for n in nodes:
        if n.gpu_type not in single:
            single[n.gpu_type] = best_goodput(state, {n.name: 1})[1]
        total += n.num_gpus * single[n.gpu_type]
    return total


def make_policy(name: str) -> Policy:
    """The policy called ``name`` (one of :data:`POLICIES`)."""
    table: dict[str, Callable[[], Policy]] = {
        "static": StaticPolicy, "simigrad": SimiGradPolicy, "pollux": PolluxPolicy,
        "pollux-as": PolluxASPolicy, "jabas": JabasPolicy}
    if name not in table:
        raise ValueError(f"policy must be one of {list(POLICIES)}, got {name!r}")
    return table[name]()


__all__ = ["POLICIES", "SimState", "NextEpoch", "Policy", "StaticPolicy", "SimiGradPolicy", "PolluxPolicy",
           "PolluxASPolicy", "JabasPolicy", "make_policy", "best_goodput", "ideal_goodput",
           "slowest_first"]
