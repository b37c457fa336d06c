"""The packing coordinator's barrier, one unit ahead of Tune, driven directly on an asyncio loop
(no Ray: the coordinator is a plain class that Ray wraps as an actor). Exact bookkeeping: what
trains ahead equals the reference loop, checkpoints come when due, nothing trains past
max_units, a speculative unit of a member that leaves is discarded, a late member is set aside
with its unclaimed result and gets it back."""
from __future__ import annotations

import asyncio
import time

import cloudpickle
import torch
import pytest

from jabasray.tuner.coordinator import PackCoordinator
from jabasray.tuner.digits import digits_mlp_spec
from jabasray.tuner.pack_runner import state_from_bytes
from tuner_helpers import STREAM, Alone

SPEC = digits_mlp_spec(steps_per_unit=2)
A = {"batch_size": 20, "optimizer": "adam", "lr": 1e-2, "activation": "relu"}
B = {"batch_size": 40, "optimizer": "momentum", "lr": 5e-2, "activation": "tanh"}


def _run(scenario, **kw):
    """Run ``scenario(coordinator)`` on a fresh loop; always release the coordinator. The
    default ``wait_s`` is long, so that no member is set aside unless a test waits for it."""
    args = dict(capacity=4, wait_s=10.0, idle_exit_s=1e6, max_units=3, checkpoint_every=1) | kw

    async def main():
        c = PackCoordinator(cloudpickle.dumps(SPEC), STREAM, **args)
        try:
            return await asyncio.wait_for(scenario(c), timeout=120)
        finally:
            if c.watchdog is not None:
                c.watchdog.cancel()
            c.pool.shutdown(wait=True)
            c.loader.shutdown(wait=True)
    return asyncio.run(main())


async def _until(pred, timeout=60.0):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.01)


def _check(row, ref):
    assert row["train_loss"] == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    assert row["accuracy"] == pytest.approx(ref[1], abs=1e-9)


def test_units_run_ahead_exactly_as_the_reference_with_checkpoints_when_due():
    refs = {"a": Alone(A, SPEC), "b": Alone(B, SPEC)}

    async def scenario(c):
        assert await asyncio.gather(c.load("a", A), c.load("b", B)) == [{"units": 0}] * 2
        rows = []
        first = await asyncio.gather(c.unit("a"), c.unit("b"))          # unit 1: both asked
        rows.append(first)
        for n in (2, 3):
            # unit n trains before anyone asks for it (Tune is still busy with unit n - 1)
            await _until(lambda: c.units_run == n and not c.running)
            assert set(c.ready) == {"a", "b"} and not c.waiting
            rows.append(await asyncio.gather(c.unit("a"), c.unit("b")))  # claimed at once
        await asyncio.sleep(0.3)
        return rows, c.units_run, c.units_discarded

    rows, units_run, discarded = _run(scenario, checkpoint_every=2)
    assert units_run == 3 and discarded == 0                            # nothing past max_units
    for n, pair in enumerate(rows, start=1):
        for key, (row, blob) in zip("ab", pair):
            assert row["units"] == n and row["steps"] == 2 * n and row["pack_size"] == 2
            _check(row, refs[key].unit(2 * (n - 1)))                    # shared stream positions
            assert (blob is not None) == (n in (2, 3))                  # every 2nd unit and the last
            if blob is not None:
                assert state_from_bytes(blob)["units"] == n


def test_a_member_that_leaves_discards_its_speculative_unit_and_resumes_from_its_checkpoint():
    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        (_, blob_a1), _ = await asyncio.gather(c.unit("a"), c.unit("b"))
        await _until(lambda: c.units_run == 2 and not c.running)       # unit 2 ahead for a and b
        await c.free("a")                                               # Tune paused a after unit 1
        assert c.units_discarded == 1 and "a" not in c.configs
        row_b, _ = await c.unit("b")
        assert row_b["units"] == 2
        assert await c.load("a", A, blob_a1) == {"units": 1}            # resumed from its checkpoint
        row_a, blob = await c.unit("a")
        return row_a, blob

    row_a, blob = _run(scenario)
    assert row_a["units"] == 2 and row_a["steps"] == 4                  # unit 2 again, not unit 3
    assert state_from_bytes(blob)["steps"] == 4


def test_a_late_member_is_set_aside_with_its_unclaimed_unit_and_gets_it_back():
    refs = {"a": Alone(A, SPEC), "b": Alone(B, SPEC)}

    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        await asyncio.gather(c.unit("a"), c.unit("b"))
        await _until(lambda: c.units_run == 2 and not c.running)
        a2, _ = await c.unit("a")                                       # b does not claim unit 2
        await _until(lambda: c.units_run == 3 and not c.running)       # after wait_s: a alone
        assert "b" in c.aside and "b" not in c.configs
        assert c.stats()["units_unclaimed"] == 2                        # b's unit 2 aside, a's unit 3 ahead
        b2, _ = await c.unit("b")                                       # its unit 2, kept aside
        assert "b" in c.configs and "b" not in c.aside
        a3, _ = await c.unit("a")
        b3, _ = await c.unit("b")                                       # trains alone: position 6
        return a2, b2, a3, b3

    a2, b2, a3, b3 = _run(scenario, wait_s=1.0)
    assert [r["units"] for r in (a2, b2, a3, b3)] == [2, 2, 3, 3]
    refs["a"].unit(0), refs["b"].unit(0)
    _check(a2, refs["a"].unit(2))
    _check(b2, refs["b"].unit(2))
    _check(a3, refs["a"].unit(4))
    assert a3["pack_size"] == 1 and b3["pack_size"] == 1
    _check(b3, refs["b"].unit(6))


def test_without_run_ahead_a_unit_waits_until_every_trial_asked():
    refs = {"a": Alone(A, SPEC), "b": Alone(B, SPEC)}

    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        first = await asyncio.gather(c.unit("a"), c.unit("b"))
        task_a = asyncio.ensure_future(c.unit("a"))                    # only a asks for unit 2
        await asyncio.sleep(0.5)
        idle = (c.units_run, c.running)                                 # nothing ran ahead for b
        second = await asyncio.gather(task_a, c.unit("b"))
        return first, idle, second, c.units_discarded

    first, idle, second, discarded = _run(scenario, run_ahead=False)
    assert idle == (1, False) and discarded == 0
    for n, pair in ((1, first), (2, second)):
        for key, (row, _) in zip("ab", pair):
            assert row["units"] == n and row["pack_size"] == 2
            _check(row, refs[key].unit(2 * (n - 1)))


def test_no_unit_runs_ahead_past_a_decision_point_learned_from_a_stopped_trial():
    """A trial freed after claiming unit 1 (ASHA's first rung) teaches the coordinator that
    the scheduler decides after 1 unit: a later member that claims its unit 1 is not trained
    ahead (nothing to discard if it is stopped there) while the others still are, and when its
    trial goes on it trains from the unit it asked for."""
    C = {"batch_size": 30, "optimizer": "sgd", "lr": 1e-1, "activation": "relu"}

    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        await asyncio.gather(c.unit("a"), c.unit("b"))
        await _until(lambda: c.units_run == 2 and not c.running)       # unit 2 ahead for a and b
        await c.free("a")                                               # ASHA stopped a after unit 1
        assert c.decisions == {1} and c.units_discarded == 1
        assert await c.load("c", C) == {"units": 0}
        (b2, _), (c1, _) = await asyncio.gather(c.unit("b"), c.unit("c"))   # run 3: b's 3 and c's 1
        await _until(lambda: c.units_run == 3 and not c.running)
        b3, _ = await c.unit("b")
        await _until(lambda: c.units_run == 4 and not c.running)       # run 4: b's unit 4 only
        held = (c.units["c"], "c" in c.ready, c.units["b"])
        (c2, _), (b4, _) = await asyncio.gather(c.unit("c"), c.unit("b"))   # c's trial goes on
        return [r["units"] for r in (b2, c1, b3, c2, b4)], c1, c2, held, c.units_discarded, c.decisions

    units, c1, c2, held, discarded, decisions = _run(scenario, max_units=5)
    assert held == (1, False, 4)                    # c was not trained past its decision point
    assert units == [2, 1, 3, 2, 4]
    assert c1["pack_size"] == 2 and c2["steps"] == 4 and c2["pack_size"] == 2
    assert discarded == 1 and decisions == {1}      # only a's unit 2, before the point was learned


@pytest.mark.parametrize("gather", [0.0, 1e6])
def test_the_unit_after_a_decision_point_gathers_the_members_whose_trials_go_on(gather):
    """Once a stopped trial taught the coordinator that the scheduler decides after unit 1,
    a and b claim their unit 1 and their trials go on at different times (b at once, a 0.3 s
    later, as Tune processes one result after the other). With a gather window (capped by
    wait_s = 10 s) unit 2 waits for a and trains both together; without one (gather=0) b's
    unit 2 starts alone and a trains its unit 2 in a unit of its own."""
    C = {"batch_size": 30, "optimizer": "sgd", "lr": 1e-1, "activation": "relu"}

    async def scenario(c):
        await c.load("x", C)
        await c.unit("x")
        await _until(lambda: c.units_run == 2 and not c.running)       # x's unit 2 ahead
        await c.free("x")                                               # stopped after unit 1
        assert c.decisions == {1}
        await asyncio.gather(c.load("a", A), c.load("b", B))
        await asyncio.gather(c.unit("a"), c.unit("b"))                  # unit 1 of both: run 3
        await _until(lambda: c.units_run == 3 and not c.running)
        assert not c.ready                                              # not run past the point
        b2 = asyncio.ensure_future(c.unit("b"))                          # b's trial goes on at once
        await asyncio.sleep(0.3)
        a2, _ = await c.unit("a")                                        # a's trial 0.3 s later
        b2, _ = await b2
        await _until(lambda: not c.running)
        return a2, b2, c.units_run, dict(c.idle_s)

    a2, b2, units_run, idle = _run(scenario, gather=gather, max_units=2)    # nothing after unit 2
    assert a2["units"] == b2["units"] == 2 and a2["steps"] == b2["steps"] == 4
    if gather:
        assert (a2["pack_size"], b2["pack_size"], units_run) == (2, 2, 4)
        assert idle["deciding"] >= 0.25                                 # it waited for a
    else:
        assert (a2["pack_size"], b2["pack_size"], units_run) == (1, 1, 5)
        assert "deciding" not in idle


def test_a_coordinator_holding_a_set_aside_member_whose_trial_never_frees_it_exits(monkeypatch):
    """b is set aside (it does not claim unit 2) and its trial ends without a ``free``; a's
    trial frees a. With a short idle timeout the coordinator drops b and exits (it once lived
    forever: a detached actor keeping its memory, on a GPU its CUDA context)."""
    import ray

    exits = []
    monkeypatch.setattr(ray.actor, "exit_actor", lambda: exits.append(time.monotonic()))

    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        await asyncio.gather(c.unit("a"), c.unit("b"))
        await _until(lambda: c.units_run == 2 and not c.running)
        await c.unit("a")                                               # b never claims unit 2
        await _until(lambda: "b" in c.aside and not c.running)
        await c.free("a")
        freed = time.monotonic()
        await _until(lambda: exits, timeout=10.0)
        return exits[0] - freed, dict(c.aside), list(c.configs)

    waited, aside, configs = _run(scenario, wait_s=0.2, idle_exit_s=0.5)
    assert aside == {} and configs == []
    assert waited < 0.5 + 0.5 + 1.0          # idle_exit_s after the last activity, one check period


def test_a_set_aside_member_dropped_after_idle_exit_s_asks_to_load_again():
    from jabasray.tuner.coordinator import NotLoaded

    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        await asyncio.gather(c.unit("a"), c.unit("b"))
        await _until(lambda: c.units_run == 2 and not c.running)
        await c.unit("a")
        await _until(lambda: "b" in c.aside and not c.running)
        await _until(lambda: "b" not in c.aside, timeout=10.0)         # dropped after idle_exit_s
        with pytest.raises(NotLoaded, match="not loaded"):
            await c.unit("b")
        return True

    assert _run(scenario, wait_s=0.2, idle_exit_s=0.5, max_units=50)


def test_state_is_that_of_the_last_claimed_unit_while_a_unit_runs_ahead():
    """Tune asks a trial's state (a pause, a checkpoint) after the result of unit n; the
    coordinator may already have trained unit n + 1 (run ahead) or be training it. The state
    returned is unit n's, equal to the reference trained n units; once n + 1 is claimed, the
    state is unit n + 1's."""
    ref = Alone(A, SPEC)

    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        await asyncio.gather(c.unit("a"), c.unit("b"))                  # unit 1 claimed
        during = await c.state("a")                                     # unit 2 may be running
        await _until(lambda: c.units_run == 2 and not c.running)
        assert "a" in c.ready                                           # unit 2 ahead, unclaimed
        ahead = await c.state("a")
        await c.unit("a")                                               # claim unit 2
        claimed = await c.state("a")
        return [state_from_bytes(b) for b in (during, ahead, claimed)]

    during, ahead, claimed = _run(scenario, checkpoint_every=0, max_units=5)
    ref.unit(0)
    for st in (during, ahead):
        assert st["units"] == 1 and st["steps"] == 2
        for n, t in ref.model.state_dict().items():
            assert torch.allclose(st["model"][n], t, rtol=1e-5, atol=1e-6)
    ref.unit(2)
    assert claimed["units"] == 2
    for n, t in ref.model.state_dict().items():
        assert torch.allclose(claimed["model"][n], t, rtol=1e-5, atol=1e-6)


def test_arriving_members_are_built_off_the_training_thread():
    """A member's model, optimizer and state are built on the loader thread (a unit may train
    meanwhile); only its registration and every unit run on the training thread."""
    import threading

    async def scenario(c):
        seen = {"prepare": set(), "add": set(), "unit": set()}
        for name in seen:
            fn = getattr(c.runner, name)

            def wrapped(*a, _fn=fn, _name=name, **k):
                seen[_name].add(threading.get_ident())
                return _fn(*a, **k)
            setattr(c.runner, name, wrapped)
        await c.load("a", A)
        await c.unit("a")
        await c.load("b", B)                                            # while a's unit 2 may train
        await asyncio.gather(c.unit("a"), c.unit("b"))
        return seen

    seen = _run(scenario)
    assert len(seen["prepare"]) == len(seen["unit"]) == 1
    assert seen["add"] == seen["unit"] and seen["prepare"] != seen["unit"]


def test_more_trials_than_slots_wait_for_a_seat_and_train_exactly():
    """capacity 2, three trials: c's load waits (FIFO) until a leaves, then c is seated at the
    next unit and trains as alone; at most 2 members ever share a unit."""
    refs = {"b": Alone(B, SPEC), "c": Alone(A | {"lr": 3e-3}, SPEC)}

    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        waiting = asyncio.ensure_future(c.load("c", A | {"lr": 3e-3}))
        await asyncio.gather(c.unit("a"), c.unit("b"))
        await asyncio.sleep(0.2)
        assert not waiting.done() and len(c.seat_waiters) == 1        # admitted, not seated
        await c.free("a")
        assert await waiting == {"units": 0}
        await _until(lambda: c.units_run == 2 and not c.running)       # b's unit 2, ahead, alone
        b2, _ = await c.unit("b")
        rows = await asyncio.gather(c.unit("b"), c.unit("c"))         # b's 3rd with c's 1st
        return b2, rows, c.stats()

    b2, ((b3, _), (c1, _)), stats = _run(scenario, capacity=2, queue_s=30.0, max_units=5)
    refs["b"].unit(0)
    _check(b2, refs["b"].unit(2))
    _check(b3, refs["b"].unit(4))
    _check(c1, refs["c"].unit(4))                                       # joined at stream position 4
    assert b3["pack_size"] == c1["pack_size"] == 2


def test_without_a_queue_a_full_coordinator_answers_at_once():
    async def scenario(c):
        await asyncio.gather(c.load("a", A), c.load("b", B))
        return await c.load("c", A | {"lr": 3e-3})

    assert _run(scenario, capacity=2) == {"full": True}
