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

The Ray primitives are parameters (``wait``, ``get``, ``dead_errors``) so the logic is tested
with fake actors and futures (tests/test_fanout.py), without a cluster.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

log = logging.getLogger(__name__)


class ActorFailure(RuntimeError):
    """One or more GPU actors died during a call."""

    def __init__(self, dead_ranks: list[int], cause: BaseException) -> None:
        super().__init__(f"GPU actor(s) of rank {dead_ranks} died: {type(cause).__name__}")
        self.dead_ranks = dead_ranks
        self.cause = cause


def _ray_primitives() -> tuple[Callable, Callable, tuple[type, ...]]:
    import ray
    from ray.exceptions import RayActorError
    return ray.wait, ray.get, (RayActorError,)


def call_all(actors: Sequence[Any], method: str, *args: Any, per_rank: Sequence[tuple] | None = None,
             ranks: Sequence[int] | None = None, grace_s: float = 20.0,
             wait: Callable | None = None, get: Callable | None = None,
             dead_errors: tuple[type, ...] | None = None) -> list:
    """``actors[r].<method>.remote(*args)`` (or ``*per_rank[r]``) for every rank in ``ranks``
    (default all), gathered in rank order (module notes). ``wait(pending, num_returns, timeout)
    -> (ready, pending)`` and ``get(ref)`` default to Ray's; ``dead_errors`` (default
    ``(RayActorError,)``) are the exceptions meaning "this actor is dead"."""
    if wait is None or get is None or dead_errors is None:
        rw, rg, rd = _ray_primitives()
        wait, get, dead_errors = wait or rw, get or rg, dead_errors or rd
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

    while pending:
        ready, pending = wait(pending, num_returns=1, timeout=grace_s if errors else None)
        if not ready:
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
    if errors:
        dead = sorted(i for i, e in errors.items() if isinstance(e, dead_errors))
        if dead:
            raise ActorFailure(dead, errors[dead[0]])
        raise next(iter(errors.values()))
    return [results[i] for i in ranks]


__all__ = ["ActorFailure", "call_all"]
