"""The fault-tolerant fan-out (jabasray.actors.fanout.call_all) with fake actors and futures:
no Ray, no cluster. A fake future is ready at a virtual time (or never: an actor hanging in a
collective whose peer died); the fake ``wait`` hands out ready futures in time order and
refuses to block forever, so a test fails instead of hanging if call_all waits wrongly."""
from __future__ import annotations

import math

import pytest

from jabasray.actors.fanout import ActorFailure, ActorHung, call_all
from jabasray.errors import HookError, RendezvousFailed


class Dead(Exception):
    """Stands for RayActorError."""


class Future:
    def __init__(self, at: float, value=None, error: BaseException | None = None):
        self.at, self.value, self.error = at, value, error


class Clock:
    """Virtual time; ``wait`` advances it to the next ready future within the timeout."""

    def __init__(self):
        self.now = 0.0
        self.waits: list[float | None] = []

    def wait(self, pending, num_returns=1, timeout=None):
        self.waits.append(timeout)
        horizon = math.inf if timeout is None else self.now + timeout
        ready = sorted((f for f in pending if f.at <= horizon), key=lambda f: f.at)[:num_returns]
        if timeout is None and not ready:
            raise AssertionError("call_all would block forever on hanging actors")
        if ready and num_returns == 1:
            self.now = max(self.now, ready[0].at)
        elif timeout is not None:
            ready = [f for f in pending if f.at <= self.now + timeout]
            self.now = max([self.now] + [f.at for f in ready])
            if not ready:            # nothing came: the whole timeout passed
                self.now += timeout
        return ready, [f for f in pending if f not in ready]

    @staticmethod
    def get(f):
        if f.error is not None:
            raise f.error
        return f.value


class FakeActor:
    """``actor.<method>.remote(*args)`` returns the future its behaviour gives for the call."""

    def __init__(self, behave):
        self.behave = behave
        self.calls = []

    def __getattr__(self, method):
        actor = self

        class _M:
            @staticmethod
            def remote(*args):
                actor.calls.append((method, args))
                return actor.behave(*args)
        return _M


def fan(actors, clock, *args, **kw):
    return call_all(actors, "step", *args, wait=clock.wait, get=clock.get, dead_errors=(Dead,),
                    grace_s=kw.pop("grace_s", 5.0), **kw)


def test_results_in_rank_order_whatever_the_finish_order():
    clock = Clock()
    actors = [FakeActor(lambda x, r=r: Future(at=3 - r, value=(r, x))) for r in range(3)]
    assert fan(actors, clock, "a") == [(0, "a"), (1, "a"), (2, "a")]
    assert [a.calls for a in actors] == [[("step", ("a",))]] * 3


def test_per_rank_arguments_and_a_subset_of_ranks():
    clock = Clock()
    actors = [FakeActor(lambda x, r=r: Future(at=1, value=r * 10 + x)) for r in range(3)]
    assert fan(actors, clock, per_rank=[(1,), (2,), (3,)]) == [1, 12, 23]
    assert fan(actors, clock, 7, ranks=[2]) == [27]
    assert [len(a.calls) for a in actors] == [1, 1, 2]


def test_a_dead_actor_stops_the_wait_at_once_and_names_its_rank():
    """Rank 1 dies at t=2; ranks 0 and 2 hang in the collective (never ready). call_all must
    raise at t=2 without waiting for them (no timeout=None wait on hanging futures)."""
    clock = Clock()
    dead = Dead("actor 1 died")
    actors = [FakeActor(lambda: Future(at=math.inf)),
              FakeActor(lambda: Future(at=2, error=dead)),
              FakeActor(lambda: Future(at=math.inf))]
    with pytest.raises(ActorFailure) as info:
        fan(actors, clock)
    assert info.value.dead_ranks == [1] and info.value.cause is dead
    assert clock.now == 2


def test_several_dead_actors_already_finished_are_all_named():
    clock = Clock()
    actors = [FakeActor(lambda: Future(at=1, error=Dead("0"))),
              FakeActor(lambda: Future(at=1, error=Dead("1"))),
              FakeActor(lambda: Future(at=1, error=RuntimeError("peer gone"))),
              FakeActor(lambda: Future(at=math.inf))]
    with pytest.raises(ActorFailure) as info:
        fan(actors, clock)
    assert info.value.dead_ranks == [0, 1]


def test_a_survivor_error_waits_the_grace_period_for_the_dead_actor_behind_it():
    """Rank 0's collective fails at t=1 (peer gone) before rank 2's death surfaces at t=4:
    within grace_s=5 the death is seen, so the failure is an ActorFailure of rank 2."""
    clock = Clock()
    actors = [FakeActor(lambda: Future(at=1, error=RuntimeError("gloo: connection reset"))),
              FakeActor(lambda: Future(at=math.inf)),
              FakeActor(lambda: Future(at=4, error=Dead("2")))]
    with pytest.raises(ActorFailure) as info:
        fan(actors, clock, grace_s=5.0)
    assert info.value.dead_ranks == [2]
    assert clock.waits[1] == 5.0          # the wait after the first error is bounded by the grace


def test_an_error_without_a_dead_actor_is_reraised_after_the_grace_period():
    clock = Clock()
    boom = ValueError("bad batch")
    actors = [FakeActor(lambda: Future(at=1, error=boom)), FakeActor(lambda: Future(at=math.inf))]
    with pytest.raises(ValueError) as info:
        fan(actors, clock, grace_s=3.0)
    assert info.value is boom
    assert clock.waits == [None, 3.0]


class TaskError(Exception):
    """Stands for Ray's RayTaskError: the actor's own exception as ``cause``."""

    def __init__(self, cause):
        super().__init__(f"GPUActor.run_interval failed: {cause}")
        self.cause = cause


def test_a_user_hook_error_is_raised_as_itself_not_inside_rays_wrapper():
    clock = Clock()
    hook = HookError("step_fn", "RuntimeError: boom", "Traceback...")
    actors = [FakeActor(lambda: Future(at=1, error=TaskError(hook))), FakeActor(lambda: Future(at=2, value=1))]
    with pytest.raises(HookError) as info:
        fan(actors, clock)
    assert info.value is hook and str(info.value) == "step_fn raised RuntimeError: boom"
    assert info.value.__suppress_context__      # Ray's wrapper is not printed above it
    other = ValueError("not the user's hook")    # any other actor error: Ray's wrapper, as before
    wrapped = TaskError(other)
    with pytest.raises(TaskError) as info:
        fan([FakeActor(lambda: Future(at=1, error=wrapped))], Clock())
    assert info.value is wrapped


def deadline_fan(actors, clk, deadline_s, **kw):
    return call_all(actors, "step", wait=clk.wait, get=clk.get, dead_errors=(Dead,),
                    grace_s=kw.pop("grace_s", 5.0), deadline_s=deadline_s, clock=lambda: clk.now, **kw)


def test_ranks_past_the_deadline_are_a_failure_naming_them_at_the_deadline():
    """Rank 0 answers at t=1; ranks 1 and 2 never do (one stuck in its step, one waiting for it
    in the collective). With a 10 s deadline call_all raises at t=10: no dead rank, ranks 1 and
    2 failed, an ActorHung cause naming them; no wait is ever unbounded."""
    clock = Clock()
    actors = [FakeActor(lambda: Future(at=1, value=0)), FakeActor(lambda: Future(at=math.inf)),
              FakeActor(lambda: Future(at=math.inf))]
    with pytest.raises(ActorFailure) as info:
        deadline_fan(actors, clock, 10.0)
    f = info.value
    assert (f.dead_ranks, f.failed_ranks) == ([], [1, 2])
    assert isinstance(f.cause, ActorHung) and f.cause.ranks == [1, 2] and "within 10s" in str(f.cause)
    assert clock.now == 10.0 and None not in clock.waits


def test_a_deadline_met_returns_every_result_and_a_death_is_still_a_death():
    clock = Clock()
    actors = [FakeActor(lambda r=r: Future(at=2 + r, value=r)) for r in range(3)]
    assert deadline_fan(actors, clock, 10.0) == [0, 1, 2]
    clock = Clock()
    actors = [FakeActor(lambda: Future(at=math.inf)), FakeActor(lambda: Future(at=3, error=Dead("1")))]
    with pytest.raises(ActorFailure) as info:
        deadline_fan(actors, clock, 10.0)
    assert (info.value.dead_ranks, info.value.failed_ranks) == ([1], []) and clock.now == 3


def test_a_rendezvous_failure_is_an_actor_failure_with_the_ranks_left_waiting():
    """Rank 1 cannot reach the rendezvous (RendezvousFailed at t=2); rank 0 waits in it for
    good, rank 2 had joined: after the grace period ranks 0 and 1 are the failed ones."""
    clock = Clock()
    err = RendezvousFailed("rank 1: rendezvous with 10.0.0.1:29400 failed: timeout")
    actors = [FakeActor(lambda: Future(at=math.inf)), FakeActor(lambda: Future(at=2, error=err)),
              FakeActor(lambda: Future(at=1, value=2))]
    with pytest.raises(ActorFailure) as info:
        deadline_fan(actors, clock, 100.0, grace_s=5.0)
    assert (info.value.dead_ranks, info.value.failed_ranks) == ([], [0, 1])
    assert info.value.cause is err and clock.now == 7.0
