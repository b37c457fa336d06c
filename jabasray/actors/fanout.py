"""Fault-tolerant fan-out: call one method on many actors at once, gather in rank order.

A dead actor surfaces as ``RayActorError``; the others may then fail in their collective (peer
gone) or hang in it. :func:`call_all` therefore

1. sends the call to every rank at once and waits for results one at a time (``wait``);
2. on the first ``RayActorError`` (a dead actor) stops waiting: the ranks already finished are
   checked for further dead actors without blocking, and the rest are abandoned (the caller
   releases every actor in its recovery anyway);
3. after any other error, gives the remaining ranks ``grace_s`` seconds to reveal a dead actor
   behind it (a survivor's collective error usually arrives before the dead peer's error);
4. raises :class:`ActorFailure` naming the dead ranks known by then, else re-raises the first
   other error; without errors returns the results in rank order.

Deadline: with ``deadline_s`` the whole call waits at most that long. Ranks still running then
have hung (a blocked NCCL init, a data loader stuck on a network file system, a peer stuck in
its step while the others wait in the collective): :class:`ActorFailure` with no dead rank and
those ranks in ``failed_ranks``, its cause an :class:`ActorHung` naming them. An error of one of
the ``failure_errors`` types (default :class:`~jabasray.errors.RendezvousFailed`: the actor
could not join the process group in time) is a failure of that rank in the same way. The
caller kills every actor in its recovery, hung ones included.

The Ray primitives are parameters (``wait``, ``get``, ``dead_errors``) so the logic is tested
with fake actors and futures (tests/test_fanout.py), without a cluster.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from ..errors import HookError

log = logging.getLogger(__name__)


class ActorFailure(RuntimeError):
    """One or more GPU actors died (``dead_ranks``), hung past the call's deadline or failed to
    join the process group (``failed_ranks``: alive but unusable) during a call."""

    def __init__(self, dead_ranks: list[int], cause: BaseException,
                 failed_ranks: list[int] | None = None) -> None:
        self.dead_ranks = list(dead_ranks)
        self.failed_ranks = list(failed_ranks or [])
        what = (f"GPU actor(s) of rank {self.dead_ranks} died" if self.dead_ranks else
                f"GPU actor(s) of rank {self.failed_ranks} hung or failed")
        super().__init__(f"{what}: {type(cause).__name__}: {cause}")
        self.cause = cause


class ActorHung(TimeoutError):
    """Ranks whose call did not return within its deadline (one line)."""

    def __init__(self, method: str, ranks: list[int], deadline_s: float) -> None:
        super().__init__(f"{method} on rank(s) {ranks} did not return within {deadline_s:g}s")
        self.method, self.ranks, self.deadline_s = method, list(ranks), deadline_s


def _ray_primitives() -> tuple[Callable, Callable, tuple[type, ...]]:
    import ray
    from ray.exceptions import RayActorError
    return ray.wait, ray.get, (RayActorError,)


def call_all(actors: Sequence[Any], method: str, *args: Any, per_rank: Sequence[tuple] | None = None,
             ranks: Sequence[int] | None = None, grace_s: float = 20.0,
             deadline_s: float | None = None, wait: Callable | None = None,
             get: Callable | None = None, dead_errors: tuple[type, ...] | None = None,
             failure_errors: tuple[type, ...] | None = None,
             clock: Callable[[], float] | None = None) -> list:
    """``actors[r].<method>.remote(*args)`` (or ``*per_rank[r]``) for every rank in ``ranks``
    (default all), gathered in rank order (module notes). ``deadline_s``: the longest the call
    may take (None: no limit). ``wait(pending, num_returns, timeout) -> (ready, pending)`` and
    ``get(ref)`` default to Ray's; ``dead_errors`` (default ``(RayActorError,)``) are the
    exceptions meaning "this actor is dead", ``failure_errors`` (default ``(RendezvousFailed,)``)
    those meaning "this actor cannot go on"; ``clock`` (default ``time.monotonic``) measures the
    deadline."""
    import time

    from ..errors import RendezvousFailed

    if wait is None or get is None or dead_errors is None:
        rw, rg, rd = _ray_primitives()
        wait, get, dead_errors = wait or rw, get or rg, dead_errors or rd
    failure_errors = (RendezvousFailed,) if failure_errors is None else failure_errors
    clock = clock or time.monotonic
    end = None if deadline_s is None else clock() + deadline_s
    ranks = list(range(len(actors))) if ranks is None else list(ranks)
    refs = [getattr(actors[i], method).remote(*(per_rank[i] if per_rank else args)) for i in ranks]
    index = {r: rank for r, rank in zip(refs, ranks)}
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    pending = list(refs)

    def collect(ref: Any) -> None:
        try:
            results[index[ref]] = get(ref)
        except Exception as e:  # noqa: BLE001 - classified by the caller below
            errors[index[ref]] = e

    hung: list[int] = []
    while pending:
        left = None if end is None else max(0.0, end - clock())
        timeout = min(grace_s, left) if errors and left is not None else (grace_s if errors else left)
        ready, pending = wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            if not errors:   # the deadline passed without any error: these ranks hang
                hung = sorted(index[r] for r in pending)
                log.warning("%s: rank(s) %s did not return within %.0f s", method, hung, deadline_s)
                break
            log.warning("%s: %d rank(s) still running %.0f s after an error; abandoning them",
                        method, len(pending), grace_s)
            break   # grace period over: the rest hang in a collective with a dead peer
        for r in ready:
            collect(r)
        if any(isinstance(e, dead_errors) for e in errors.values()):
            done, _ = wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
            for r in done:          # other actors already known dead; survivors' errors ignored
                try:
                    get(r)
                except dead_errors as e:
                    errors[index[r]] = e
                except Exception:  # noqa: BLE001 - survivors failing in the collective
                    pass
            break
    if hung:
        raise ActorFailure([], ActorHung(method, hung, deadline_s), failed_ranks=hung)
    if errors:
        dead = sorted(i for i, e in errors.items() if isinstance(e, dead_errors))
        if dead:
            raise ActorFailure(dead, errors[dead[0]])
        failed = sorted(i for i, e in errors.items() if isinstance(e, failure_errors))
        if failed:
            return_late = sorted(index[r] for r in pending)   # waiting in the same rendezvous
            first = errors[failed[0]]
            cause = getattr(first, "cause", None)   # Ray's RayTaskError: the actor's own error
            raise ActorFailure([], cause if isinstance(cause, failure_errors) else first,
                               failed_ranks=sorted(failed + return_late))
        first = next(iter(errors.values()))
        cause = getattr(first, "cause", None)   # Ray's RayTaskError: the actor's own error
        if isinstance(cause, HookError):        # the user's code raised: that error, one line
            raise cause from None               # first, not Ray's wrapper around it
        raise first
    return [results[i] for i in ranks]


__all__ = ["ActorFailure", "ActorHung", "call_all"]
