"""The placed GPU actors of a job: placement, process-group rendezvous, fan-out, configuration.

:class:`ActorPool` owns what the driver needs to talk to its actors: the :class:`Placement`
(actors and placement groups), the rendezvous server of the current process group (a new
generation after every (re-)placement), the last configuration applied (``configure`` is a
collective call, skipped when nothing changed) and the fault-tolerant fan-out
(:func:`.fanout.call_all`).
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, Callable

from ..errors import DatasetMismatch
from .fanout import call_all
from .metrics import reduce_metrics
from .placement import Placement, Slot, actor_name, place_actors, release
from .rendezvous import RendezvousServer, backend_for

log = logging.getLogger(__name__)


class ActorPool:
    """GPU actors of the current allocation (empty until :meth:`place`).

    Args:
        make_actor: ``(slot, world_size, ray_options) -> actor handle`` (starts one GPU actor).
        device: "cpu" or "cuda" (process-group backend).
        emulate: emulated GPU types (placement bundles).
        placement_timeout_s, collective_timeout_s, failure_grace_s, call_timeout_s,
            rendezvous_ports: see ``DriverOptions`` (call_timeout_s None: calls wait without limit).
        bundle_cpus: CPUs each GPU's placement bundle reserves for its data-loader workers.
        label: what the actors' names say about the job (e.g. the run name); a short unique
            suffix is added (:func:`.placement.actor_name`).
    """

    def __init__(self, make_actor: Callable[[Slot, int, dict], Any], device: str, emulate: bool,
                 placement_timeout_s: float, collective_timeout_s: float, failure_grace_s: float,
                 label: str = "job", call_timeout_s: float | None = None,
                 rendezvous_ports: tuple[int, int] | None = None,
                 bundle_cpus: float = 0.0) -> None:
        self._make = make_actor
        self.label = f"{label}-{uuid.uuid4().hex[:6]}"
        self.name_prefix = "jabasray"      # first part of the actors' names (actor_name)
        self.device, self.emulate = device, emulate
        self.placement_timeout_s = placement_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.failure_grace_s = failure_grace_s
        self.call_timeout_s = call_timeout_s
        self.rendezvous_ports = rendezvous_ports
        self.bundle_cpus = bundle_cpus          # CPUs every GPU bundle reserves (loader workers)
        self.placement: Placement | None = None
        self._rdv: RendezvousServer | None = None
        self._generation = 0
        self._applied: tuple | None = None

    @property
    def actors(self) -> list:
        return list(self.placement.actors) if self.placement else []

    @property
    def slots(self) -> list[Slot]:
        return list(self.placement.slots) if self.placement else []

    def runs(self, slots: list[Slot]) -> bool:
        """True when the placed actors are exactly these slots (same pairs, same ranks)."""
        return (self.placement is not None and
                [(s.pair_key, s.rank) for s in self.placement.slots] == [(s.pair_key, s.rank) for s in slots])

    def place(self, slots: list[Slot], worker_state_ref: Any = None, fresh: bool = False,
              bucket_plan: list[list[str]] | None = None, rank_state_refs: list | None = None) -> None:
        """Place actors for ``slots`` (pairs that stay keep their actors unless ``fresh``), join
        them in a new process group (workers built with ``bucket_plan``; None: size-capped
        buckets) and load ``worker_state_ref`` (a Ray object) into every rank, or
        ``rank_state_refs[r]`` into rank r (SMA: every rank its own state), if given."""
        if fresh:
            self.shutdown()
        elif self._rdv:
            self._rdv.close()
        world = len(slots)
        self._generation += 1
        gen = self._generation

        def make(s: Slot, opts: dict) -> Any:
            return self._make(s, world, {**opts, "name": actor_name(self.label, gen, s, self.name_prefix)})

        self.placement, new = place_actors(slots, make, emulate=self.emulate,
                                           timeout_s=self.placement_timeout_s, reuse=self.placement,
                                           cpus=self.bundle_cpus)
        log.debug("placement: %d actors, %d new", world, len(new))
        self._rdv = RendezvousServer(world, backend_for(self.device), self._generation,
                                     timeout_s=self.collective_timeout_s, ports=self.rendezvous_ports)
        # setup's deadline covers a new actor's start (its process, runtime_env, dataset: as long
        # as a placement may take), the rendezvous (which times out in the actors first:
        # RendezvousFailed, an actor failure) and building the worker (a call)
        deadline = None if self.call_timeout_s is None else \
            self.placement_timeout_s + self.collective_timeout_s + self.call_timeout_s
        try:
            self.call_all("setup", per_rank=[(self._rdv.info, s, bucket_plan) for s in slots],
                          deadline_s=deadline)
        except DatasetMismatch as e:   # Ray's RayTaskError is also its cause's class: one line
            raise DatasetMismatch(str(getattr(e, "cause", e))) from None
        if worker_state_ref is not None:
            self.call_all("load_state_dict", worker_state_ref)
        if rank_state_refs is not None:
            self.call_all("load_state_dict", per_rank=[(ref,) for ref in rank_state_refs])
        self._applied = None

    def call_all(self, method: str, *args: Any, per_rank: list[tuple] | None = None,
                 ranks: list[int] | None = None, deadline_s: float | None = None) -> list:
        """:func:`.fanout.call_all` on the placed actors (raises ``ActorFailure``, also for a
        call past ``deadline_s``; None: ``call_timeout_s``)."""
        return call_all(self.placement.actors, method, *args, per_rank=per_rank, ranks=ranks,
                        grace_s=self.failure_grace_s,
                        deadline_s=self.call_timeout_s if deadline_s is None else deadline_s)

    def train(self, req: Any, deadline_s: float | None = None) -> tuple[list, int]:
        """``run_interval(req)`` on every actor (within ``deadline_s``; None: ``call_timeout_s``):
        the replies (rank order) and their common end cursor (RuntimeError when the actors
        disagree on it)."""
        replies = self.call_all("run_interval", req, deadline_s=deadline_s)
        end = {r.end_cursor for r in replies}
        if len(end) != 1:
            raise RuntimeError(f"actors disagree on the epoch cursor: {sorted(end)}")
        return replies, end.pop()

    def evaluate(self, val_ref: Any) -> dict[str, float]:
        """Validation: every actor evaluates its shard of ``val_ref`` (the user's eval_fn; None:
        the actors' own validation set), the shards' means combined weighted by their sample
        counts (:func:`.metrics.reduce_metrics`, exact for per-sample means)."""
        return reduce_metrics(self.call_all("evaluate", val_ref))

    def configure(self, configs: list[tuple]) -> bool:
        """``configure`` every rank (one collective call) unless nothing changed since the last;
        whether it called."""
        if tuple(configs) == self._applied:
            return False
        self.call_all("configure", per_rank=list(configs))
        self._applied = tuple(configs)
        return True

    def shutdown(self) -> None:
        """Release all actors, placement groups and the rendezvous server."""
        release(self.placement)
        self.placement = None
        self._applied = None
        if self._rdv:
            self._rdv.close()
            self._rdv = None


__all__ = ["ActorPool"]
