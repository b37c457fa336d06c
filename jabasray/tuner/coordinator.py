"""The packing coordinator of one device: a named Ray actor the device's Tune trials share.

Implementation notes
--------------------
Every configuration stays its own Tune trial (a class Trainable, see
:mod:`jabasray.tuner.packed_trials`). The trials of one device register with the device's
:class:`PackCoordinator` (a detached named actor, created by the first trial that needs it)
and hand it their config; the coordinator holds a :class:`~jabasray.tuner.pack_runner.PackRunner`
that trains all of them as ONE packed model.

One unit of training is a barrier over the registered members, run ONE UNIT AHEAD of Tune:

1. a trial registers (:meth:`load`) and asks for its next unit (:meth:`unit`), then waits;
2. a unit starts as soon as every registered member has claimed the result of its previous
   unit (or has none yet) -- it does not wait for the trials to ask. So while Tune processes
   unit ``n`` of every trial (its result, checkpoint and scheduling decision: the trials' round
   trip), the runner already trains unit ``n + 1``; a trial's next request then finds its
   result ready, or waits only for the rest of the compute. At most one result per member is
   ever unclaimed, so at most one unit per member is speculative: when Tune stops or pauses
   the trial after unit ``n`` (its checkpoint is that of unit ``n``), :meth:`free` discards the
   speculative unit ``n + 1`` and nothing of it is ever reported. When Tune asks for the
   trial's state after unit ``n`` (:meth:`state`: a pause, a checkpoint) while ``n + 1`` runs
   or waits unclaimed, it gets unit ``n``'s: each member's state before its latest unit is
   kept (a copy of its rows per unit, no restack). The last unit (``max_units``) carries the
   member's state bytes;
   *Decision points*: schedulers stop or pause trials only at certain unit counts (ASHA's and
   HyperBand's rungs: 1, 3, 9, ... for grace 1 and eta 3), so a speculative unit after such a
   count is mostly wasted (two of every three trials stop at an ASHA rung). The coordinator
   learns these counts from the trials that leave (the units a trial had claimed when it was
   freed, below ``max_units``) and does not run ahead of a member that has just claimed such
   a unit: the member joins the next unit once its trial asks for it, and one it stops
   costs no speculative compute. The next unit waits a little for such members
   (*deciding*: their trial claimed the unit and has neither asked again nor left), at most
   ``gather`` times the last unit's training time (and at most ``wait_s``): the trials the
   scheduler keeps then train in this unit with the others, instead of the pack splitting
   into two halves that take turns, each unit half full; a trial that asks later waits at
   most one unit longer;
3. a member that has not claimed its result ``wait_s`` after the others were ready is *set
   aside*: its state (and unclaimed result) is kept here and its slot freed, and it re-joins
   from that state if it ever asks (for ``idle_exit_s`` at most: then it is dropped and its
   trial, should it come back, loads again from its last checkpoint). This matters because
   Tune does not always end a trial at once: with ``reuse_actors=True`` a paused trial's
   actor may be cached until Tune reuses it (``reset_config``) or stops it, so such a member
   would otherwise hold its slot and stall every unit;
4. each call returns its member's metrics; the trial's ``step()`` returns them -- the
   scheduler sees an ordinary trial reporting every unit.

Arrivals (:meth:`load`) join at the next unit; a trial the scheduler stops or pauses leaves
through :meth:`free` (from the trial actor's ``cleanup``, or ``reset_config`` when Tune
reuses the actor). A coordinator with no member for ``idle_exit_s`` seconds exits, so
detached coordinators do not outlive their sweep. Coordinators are named after the sweep's
:class:`~jabasray.tuner.packed_trials.PackedJob` token; ``packed()`` starts the local node's
coordinators at once when Ray is already running, so importing torch and loading the data
overlap Tune's own start-up instead of delaying the first unit.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["PackCoordinator", "NotLoaded"]


class NotLoaded(ValueError):
    """The trial is not a member here (never loaded, or set aside and dropped after
    ``idle_exit_s``): it loads again from its last checkpoint."""


class PackCoordinator:
    """Ray actor class (wrapped with ``ray.remote`` by :mod:`jabasray.tuner.packed_trials`).

    Args:
        spec_blob: the cloudpickled :class:`~jabasray.tuner.training.TrainingSpec` (so the
            trials themselves never import torch).
        stream_batch: chunk of the shared input stream (largest batch size of the space).
        capacity: most members trained in one packed model.
        space: :class:`~jabasray.planners.pack_opt.NormalisedSpace` for :meth:`affinity`, or None.
        threads: torch threads of the training thread.
        device: the torch device the members train on (overrides ``spec.device``), or None.
        wait_s: longest wait for a member that has not claimed its previous result.
        idle_exit_s: a coordinator with no member exits after this.
        max_units: units after which a member trains no more (its trial ends).
        checkpoint_every: a unit whose number is a multiple of this (and the last one) returns
            the member's state bytes with its metrics; 0: only the last one.
        run_ahead: train a unit as soon as every member claimed its previous one (True), or
            only once every member's trial has asked for it (False: the barrier waits for
            Tune's round trip of every trial, nothing is speculative).
        queue_s: a :meth:`load` finding every slot taken waits up to this long for one (FIFO;
            more trials admitted than slots: the next one is seated as soon as a member
            leaves); 0: it answers ``{"full": True}`` at once.
        gather: a unit waits for deciding members (see the module docstring) up to this
            fraction of the last unit's training time (at most ``wait_s``); 0: never.
        decision: the packing decision the sweep was built from (a dict), reported by :meth:`stats`.
    """

    def __init__(self, spec_blob: bytes, stream_batch: int, capacity: int, space: Any = None,
                 threads: int = 1, device: str | None = None, wait_s: float = 2.0,
                 idle_exit_s: float = 60.0, max_units: int | None = None, checkpoint_every: int = 1,
                 run_ahead: bool = True, queue_s: float = 0.0, gather: float = 0.25,
                 decision: dict | None = None) -> None:
        import dataclasses

        import cloudpickle

        self.spec = cloudpickle.loads(spec_blob)
        if device is not None:
            self.spec = dataclasses.replace(self.spec, device=device)
        self.stream_batch, self.capacity, self.space = stream_batch, capacity, space
        self.threads, self.wait_s, self.idle_exit_s = threads, wait_s, idle_exit_s
        self.max_units, self.checkpoint_every, self.run_ahead = max_units, checkpoint_every, run_ahead
        self.pool = ThreadPoolExecutor(1)          # ONE training thread: the runner is not thread-safe
        self.loader = ThreadPoolExecutor(1)        # builds arriving members off the training thread
        self.queue_s, self.gather = queue_s, gather
        self.decision = decision                   # the sweep's packing decision (reported by stats)
        self.last_unit_s = 0.0                     # training time of the last unit
        self.seat_waiters: list[asyncio.Future] = []   # loads waiting for a free slot (FIFO)
        self.runner = None
        self.configs: dict[str, dict] = {}         # registered members
        self.units: dict[str, int] = {}            # units each registered member has trained
        self.token: dict[str, int] = {}            # which load of the key (a unit's result for an
        self.loads = 0                             # earlier load of the same key is discarded)
        self.loading: set[str] = set()             # registered, state still loading
        self.waiting: dict[str, asyncio.Future] = {}     # trials waiting for their next unit
        self.ready: dict[str, tuple] = {}          # computed, not yet claimed (one unit ahead)
        self.decisions: set[int] = set()           # unit counts after which trials were stopped or paused
        self.failed: dict[str, BaseException] = {}  # a member's unit failed: raised when it asks
        self.aside: dict[str, tuple[dict, bytes, tuple | None]] = {}   # config, state, unclaimed
        self.aside_since: dict[str, float] = {}    # when each was set aside (dropped after idle_exit_s)
        self.aside_before: dict[str, bytes] = {}   # state at the last CLAIMED unit of one set aside unclaimed
        self.before: dict[str, dict] = {}          # each member's state before the latest unit it trained
        self.training: set[str] = set()            # members of the unit now running
        self.run_task: asyncio.Task | None = None
        self.first_ready = 0.0                     # when the next unit could first have started
        self.running = False
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0                        # when the timer fires
        self.last_active = time.monotonic()
        self.watchdog: asyncio.Task | None = None
        self.units_run = 0
        self.units_discarded = 0                   # speculative units of members that left
        self.member_units = 0                      # members trained, summed over units
        self.set_aside = 0                         # members set aside by the barrier
        self.busy_s = 0.0                          # seconds the training thread trained units
        self.idle_s: dict[str, float] = {}         # seconds between units, by what was awaited
        self.idle_reason = "empty"
        self.created = self.last_end = time.monotonic()
        self._make_runner()                        # torch, data, stream: before the first trial asks

    # -- helpers -----------------------------------------------------------------------------
    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _make_runner(self):
        import torch

        from jabasray.tuner.pack_runner import PackRunner

        torch.set_num_threads(self.threads)
        self.runner = PackRunner(self.spec, self.stream_batch)

    def _touch(self) -> None:
        self.last_active = time.monotonic()
        if self.watchdog is None:
            self.watchdog = asyncio.get_running_loop().create_task(self._idle_exit())

    async def _idle_exit(self) -> None:
        """Exit after ``idle_exit_s`` without a member. A set-aside member counts only for
        ``idle_exit_s`` after it was set aside: its trial may have ended without a ``free``
        (Tune does not always end a trial's thread), and a detached actor must not hold its
        memory -- on a GPU its CUDA context -- forever. A trial that comes back later re-joins
        from its last checkpoint (:mod:`jabasray.tuner.packed_trials`)."""
        while True:
            await asyncio.sleep(min(5.0, self.idle_exit_s / 2))
            now = time.monotonic()
            for k in [k for k, t in self.aside_since.items() if now - t > self.idle_exit_s]:
                log.info("dropping set-aside member %s: its trial did not ask for %.0f s", k, self.idle_exit_s)
                self.aside.pop(k, None)
                self.aside_since.pop(k, None)
                self.aside_before.pop(k, None)
            if not self.configs and not self.aside and now - self.last_active > self.idle_exit_s:
                log.info("packing coordinator idle for %.0f s: exiting", self.idle_exit_s)
                self._exit()
                return

    def _exit(self) -> None:
        import ray

        ray.actor.exit_actor()

    def _done(self, key: str) -> bool:
        """The member has trained ``max_units`` (its trial ends; it trains no more)."""
        return self.max_units is not None and self.units[key] >= self.max_units

    def _between_units(self, key: str) -> bool:
        """Loaded, its previous result claimed and not done: the member may train next."""
        return key not in self.loading and key not in self.ready and not self._done(key)

    def _trainable(self, key: str) -> bool:
        """Between units and its trial has asked for the next one -- or, with ``run_ahead``,
        the unit is not past a decision point."""
        return self._between_units(key) and (
            key in self.waiting or (self.run_ahead and self.units[key] not in self.decisions))

    def _behind(self) -> list[str]:
        """Members the next unit waits for (at most ``wait_s``): an unclaimed result, or
        (without ``run_ahead``) a trial that has not asked yet."""
        return [k for k in self.configs if k in self.ready or (
            not self.run_ahead and k not in self.loading and k not in self.waiting and not self._done(k))]

    def _deciding(self) -> list[str]:
        """Members that claimed a unit at a decision point and whose trial has neither asked
        for the next one nor left yet: the scheduler is deciding about them."""
        if not self.run_ahead:           # without run-ahead every unit waits for every trial
            return []
        return [k for k in self.configs if self._between_units(k) and k not in self.waiting
                and self.units[k] in self.decisions]

    def _kick_at(self, when: float) -> None:
        """Call :meth:`_kick` again at monotonic time ``when`` (or earlier, if already due)."""
        if self.timer is not None:
            if self.timer_at <= when:
                return
            self.timer.cancel()

        def fire() -> None:
            self.timer = None
            self._kick()
        self.timer_at = when
        self.timer = asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), fire)

    def _register(self, key: str, config: dict) -> None:
        self.loads += 1
        self.configs[key], self.units[key], self.token[key] = dict(config), 0, self.loads
        self.loading.add(key)

    def _wake_seat(self) -> None:
        """A slot was freed: the first load waiting for one tries again."""
        while self.seat_waiters:
            fut = self.seat_waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                return

    def _forget(self, key: str) -> None:
        """Drop the member's bookkeeping here (the runner is freed by the caller)."""
        self._wake_seat()
        self.configs.pop(key, None)
        self.units.pop(key, None)
        self.token.pop(key, None)
        self.before.pop(key, None)
        self.loading.discard(key)
        if self.ready.pop(key, None) is not None:
            self.units_discarded += 1
        fut = self.waiting.pop(key, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def _load_state(self, key: str, config: dict, state: bytes | None) -> int:
        """Load the member into the runner (``key`` registered and ``loading`` before); returns
        its units. Raises if it was freed meanwhile (then nothing of it is left)."""
        token = self.token[key]

        def build():
            from jabasray.tuner.pack_runner import state_from_bytes

            return self.runner.prepare(key, config, state_from_bytes(state) if state else None)

        try:
            # built on the loader thread while a unit may train; registered on the training thread
            member = await asyncio.get_running_loop().run_in_executor(self.loader, build)
            units = await self._in_thread(self.runner.add, member)
        except BaseException:
            if self.token.get(key) == token:
                self._forget(key)
            raise
        if self.token.get(key) != token:            # freed (or re-loaded) while loading
            if key not in self.configs:             # a re-load frees and loads it itself
                await self._in_thread(self.runner.free, key)
            raise ValueError(f"trial {key!r} was freed while loading")
        self.loading.discard(key)
        self.units[key] = units
        return units

    # -- the trials' calls -------------------------------------------------------------------
    def affinity(self, config: dict) -> tuple[int, float]:
        """``(free member slots, mean normalised distance of config to the members)``."""
        free = self.capacity - len(self.configs)
        if not self.configs or self.space is None:
            return free, 0.0
        d = [self.space.distance(config, c) for c in self.configs.values()]
        return free, sum(d) / len(d)

    async def load(self, key: str, config: dict, state: bytes | None = None) -> dict:
        """Pack's ``load``: ``{"units": n}`` (units already trained), ``{"full": True}`` or
        ``{"unpackable": reason}``. A member with this key already here (its trial restarts
        before its free arrived, or Tune resumes it from its checkpoint) starts over from
        ``state``: what was trained after that checkpoint is discarded."""
        from jabasray.tuner.pack_runner import Unpackable

        self._touch()
        self.aside.pop(key, None)
        self.aside_since.pop(key, None)
        self.aside_before.pop(key, None)
        self.failed.pop(key, None)
        if key in self.configs:
            self._forget(key)
            await self._in_thread(self.runner.free, key)
        deadline = time.monotonic() + self.queue_s
        while len(self.configs) >= self.capacity:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"full": True}
            fut = asyncio.get_running_loop().create_future()
            self.seat_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                return {"full": True}
            finally:
                if fut in self.seat_waiters:
                    self.seat_waiters.remove(fut)
            self._touch()
        self._register(key, config)                 # reserve the slot before yielding
        try:
            units = await self._load_state(key, config, state)
        except Unpackable as e:
            return {"unpackable": str(e)}
        self._kick()
        return {"units": units}

    async def free(self, key: str) -> None:
        """Pack's ``free``: the trial was stopped, paused or has finished (a speculative unit
        it did not claim is discarded)."""
        self._touch()
        self.aside.pop(key, None)
        self.aside_since.pop(key, None)
        self.aside_before.pop(key, None)
        self.failed.pop(key, None)
        if key not in self.configs:
            return
        n = self.units[key] - (key in self.ready)   # units of the last result its trial claimed
        if n > 0 and not (self.max_units is not None and n >= self.max_units):
            self.decisions.add(n)                   # the scheduler decides after n units
        self._forget(key)
        await self._in_thread(self.runner.free, key)
        self._kick()

    async def unit(self, key: str) -> tuple[dict, bytes | None]:
        """The member's next unit (trained with the other members, usually ahead of this
        call: see the module docstring): its metrics and, when a checkpoint is due after it
        (:func:`~jabasray.tuner.packed_trials.checkpoint_due`), its state bytes."""
        self._touch()
        if key in self.failed:
            raise self.failed.pop(key)
        if key not in self.configs and key in self.aside:       # set aside earlier: re-join
            config, state, unclaimed = self.aside.pop(key)
            self.aside_since.pop(key, None)
            self.aside_before.pop(key, None)
            self._register(key, config)
            await self._load_state(key, config, state)
            if unclaimed is not None:
                self.ready[key] = unclaimed
        if key not in self.configs:
            raise NotLoaded(f"trial {key!r} is not loaded")
        if key in self.ready:                                    # trained ahead: claim it
            result = self.ready.pop(key)
            self._kick()
            return result
        if key in self.waiting:
            raise ValueError(f"trial {key!r} already waits for a unit")
        fut = asyncio.get_running_loop().create_future()
        self.waiting[key] = fut
        self._kick()
        return await fut

    async def state(self, key: str) -> bytes:
        """The member's checkpoint bytes at the last unit its trial CLAIMED (what Tune saves
        when it asks: a pause, ``checkpoint_frequency``, the end). A unit trained ahead and not
        yet claimed is not in it: the state from before that unit is kept for this."""
        from jabasray.tuner.pack_runner import state_to_bytes

        self._touch()
        if key in self.training and self.run_task is not None:
            await asyncio.shield(self.run_task)                # its pre-unit state is then kept
        if key in self.configs:
            if key in self.ready:
                before = self.before[key]
                return await self._in_thread(state_to_bytes, before)
            return await self._in_thread(lambda: state_to_bytes(self.runner.states([key])[key]))
        if key in self.aside:
            return self.aside_before.get(key) or self.aside[key][1]
        raise NotLoaded(f"trial {key!r} is not loaded")

    def stats(self) -> dict:
        """Where the coordinator's time went: units run and members trained in them (summed),
        speculative units discarded, results computed but not (yet) claimed (members ahead or
        set aside), members set aside, the decision points learned, seconds
        training (``busy_s``), seconds between units by what was awaited (``idle_s``: "tune"
        -- every member's trial still busy with its report --, "behind" -- a member not yet
        claiming its previous result --, "deciding" -- gathering members at a decision
        point --, "loading", "empty") and seconds alive."""
        unclaimed = len(self.ready) + sum(u is not None for _, _, u in self.aside.values())
        return {"members": sorted(self.configs), "units_run": self.units_run,
                "member_units": self.member_units, "units_discarded": self.units_discarded,
                "units_unclaimed": unclaimed,
                "set_aside": self.set_aside, "decisions": sorted(self.decisions),
                "busy_s": self.busy_s, "idle_s": dict(self.idle_s),
                "alive_s": time.monotonic() - self.created, "position": getattr(self.runner, "position", 0),
                "decision": self.decision}

    # -- the barrier -------------------------------------------------------------------------
    def _kick(self) -> None:
        """Start the next unit when every registered member is trainable, or ``wait_s`` after
        it could first have started with whoever is (members behind are set aside)."""
        if self.running:
            return
        keys = [k for k in self.configs if self._trainable(k)]
        if not keys:
            self.idle_reason = "empty" if not self.configs else "tune"
            return
        behind = self._behind()
        now = time.monotonic()
        if behind or self.loading:
            self.idle_reason = "behind" if behind else "loading"
        if self.first_ready == 0.0:
            self.first_ready = now
        if (behind or self.loading) and now < self.first_ready + self.wait_s:
            self._kick_at(self.first_ready + self.wait_s)
            return
        gather_until = self.first_ready + min(self.wait_s, self.gather * self.last_unit_s)
        if now < gather_until and self._deciding():
            self.idle_reason = "deciding"
            self._kick_at(gather_until)
            return
        if behind:
            self.set_aside += len(behind)
            log.info("setting aside %d member(s) that did not claim a unit within %.1f s", len(behind), self.wait_s)
        aside = {k: (self.configs[k], self.ready.pop(k, None)) for k in behind}
        for k in behind:
            self.configs.pop(k)
            self.units.pop(k)
            self.token.pop(k)
            self._wake_seat()
        self.first_ready = 0.0
        self.idle_s[self.idle_reason] = self.idle_s.get(self.idle_reason, 0.0) + now - self.last_end
        self.running = True
        tokens = {k: self.token[k] for k in keys}
        asyncio.get_running_loop().create_task(self._run(tokens, aside))

    async def _run(self, tokens: dict[str, int], aside: dict[str, tuple[dict, tuple]]) -> None:
        from jabasray.tuner.pack_runner import state_to_bytes
        from jabasray.tuner.packed_trials import checkpoint_due

        keys = list(tokens)

        def work() -> dict:
            if aside:
                states = self.runner.states(list(aside))
                for k, (config, unclaimed) in aside.items():
                    self.aside[k] = (config, state_to_bytes(states[k]), unclaimed)
                    self.aside_since[k] = time.monotonic()
                    if unclaimed is not None and k in self.before:
                        self.aside_before[k] = state_to_bytes(self.before.pop(k))
                    self.runner.free(k)
            if self.run_ahead:          # a unit ahead of Tune: keep the state Tune may ask for
                self.before.update(self.runner.states(keys))
            results = self.runner.unit(keys)
            want = [k for k, r in results.items() if not isinstance(r, Exception)
                    and checkpoint_due(r["units"], self.max_units, self.checkpoint_every)]
            states = self.runner.states(want) if want else {}
            return {k: r if isinstance(r, Exception) else (r, state_to_bytes(states[k]) if k in states else None)
                    for k, r in results.items()}

        t0 = time.monotonic()
        self.training = set(keys)
        self.run_task = asyncio.current_task()
        try:
            results = await self._in_thread(work)
        except Exception as e:                      # noqa: BLE001 -- hand it to every member
            results = {k: e for k in keys}
        finally:
            self.training = set()
        self.last_unit_s = time.monotonic() - t0
        self.busy_s += self.last_unit_s
        self.units_run += 1
        self.member_units += len(keys)
        failed = [k for k, r in results.items() if isinstance(r, Exception)]
        if failed:                                  # the runner keeps no failed member
            await self._in_thread(lambda: [self.runner.free(k) for k in failed])
        for k, r in results.items():
            if self.token.get(k) != tokens[k]:      # freed (or re-loaded) while training: discard
                self.units_discarded += 1
                continue
            fut = self.waiting.pop(k, None)
            if isinstance(r, Exception):            # a failed member leaves the pack
                self._forget(k)
                if fut is not None and not fut.done():
                    fut.set_exception(r)
                else:
                    self.failed[k] = r
                continue
            self.units[k] = int(r[0]["units"])
            if fut is not None and not fut.done():
                fut.set_result(r)
            else:
                self.ready[k] = r                   # ahead: claimed by the trial's next call
        self.running = False
        self.last_end = time.monotonic()
        self._touch()
        self._kick()
