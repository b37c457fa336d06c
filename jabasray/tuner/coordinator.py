"""The packing coordinator of one device: a named Ray actor the device's Tune trials share.

Implementation notes
--------------------
Every configuration stays its own Tune trial (a function trainable, see
:mod:`jabasray.tuner.packed_trials`). The trials of one device register with the device's
:class:`PackCoordinator` (a detached named actor, created by the first trial that needs it)
and hand it their config; the coordinator holds a :class:`~jabasray.tuner.pack_runner.PackRunner`
that trains all of them as ONE packed model.

One unit of training is a barrier over the registered members:

1. each trial calls :meth:`PackCoordinator.unit` (then waits);
2. when every registered member has called -- or ``wait_s`` after the first call, whichever
   comes first -- the runner trains the waiting members one unit together in a worker thread
   (the event loop keeps accepting arrivals and departures meanwhile). A member that did not
   call is *set aside*: its state is kept here and its slot freed, and it re-joins from that
   state if it ever asks again. This matters because Tune does not always end a trial's
   thread when it stops or pauses it: with ``reuse_actors=True`` the actor is cached with the
   thread still blocked in ``tune.report`` (Tune's ``_maybe_cache_trial_actor``), so such a
   member would otherwise hold its slot and stall every unit;
3. each call returns its member's metrics (and its checkpoint bytes when asked); the trial
   calls ``tune.report`` -- the scheduler sees an ordinary trial reporting every unit.

Arrivals (:meth:`load`) join at the next unit; a trial the scheduler stops or pauses leaves
through :meth:`free` (from the trial's ``finally``, which runs when Tune ends the trial's
thread). A coordinator with no member for ``idle_exit_s`` seconds exits, so detached
coordinators do not outlive their sweep. Coordinators are named after the sweep's
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

__all__ = ["PackCoordinator"]


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
    """

    def __init__(self, spec_blob: bytes, stream_batch: int, capacity: int, space: Any = None,
                 threads: int = 1, device: str | None = None, wait_s: float = 2.0,
                 idle_exit_s: float = 60.0) -> None:
        import dataclasses

        import cloudpickle

        self.spec = cloudpickle.loads(spec_blob)
        if device is not None:
            self.spec = dataclasses.replace(self.spec, device=device)
        self.stream_batch, self.capacity, self.space = stream_batch, capacity, space
        self.threads, self.wait_s, self.idle_exit_s = threads, wait_s, idle_exit_s
        self.pool = ThreadPoolExecutor(1)          # ONE training thread: the runner is not thread-safe
        self.runner = None
        self.configs: dict[str, dict] = {}         # registered members
        self.waiting: dict[str, tuple[asyncio.Future, bool]] = {}
        self.aside: dict[str, tuple[dict, bytes]] = {}   # set-aside members: config, state
        self.first_wait = 0.0
        self.running = False
        self.timer: asyncio.TimerHandle | None = None
        self.last_active = time.monotonic()
        self.watchdog: asyncio.Task | None = None
        self.units_run = 0
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
        import ray

        while True:
            await asyncio.sleep(min(5.0, self.idle_exit_s))
            if not self.configs and not self.aside and time.monotonic() - self.last_active > self.idle_exit_s:
                log.info("packing coordinator idle for %.0f s: exiting", self.idle_exit_s)
                ray.actor.exit_actor()

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
        ``{"unpackable": reason}``."""
        self._touch()
        self.aside.pop(key, None)
        if key in self.configs:                    # the trial restarts before its free arrived
            self.configs.pop(key)
            await self._in_thread(self.runner.free, key)
        if len(self.configs) >= self.capacity:
            return {"full": True}
        self.configs[key] = dict(config)           # reserve the slot before yielding

        def work() -> int:
            from jabasray.tuner.pack_runner import state_from_bytes

            return self.runner.load(key, config, state_from_bytes(state) if state else None)

        from jabasray.tuner.pack_runner import Unpackable
        try:
            units = await self._in_thread(work)
        except Unpackable as e:
            self.configs.pop(key, None)
            return {"unpackable": str(e)}
        except BaseException:
            self.configs.pop(key, None)
            raise
        return {"units": units}

    async def free(self, key: str) -> None:
        """Pack's ``free``: the trial was stopped, paused or has finished."""
        self._touch()
        self.aside.pop(key, None)
        if self.configs.pop(key, None) is None:
            return
        fut = self.waiting.pop(key, None)
        if fut is not None and not fut[0].done():
            fut[0].cancel()
        await self._in_thread(self.runner.free, key)
        self._kick()

    async def unit(self, key: str, want_state: bool = False) -> tuple[dict, bytes | None]:
        """Train one unit with the other members (the barrier of the module docstring);
        returns the member's metrics and, if ``want_state``, its checkpoint bytes."""
        self._touch()
        if key not in self.configs and key in self.aside:       # set aside earlier: re-join
            config, state = self.aside.pop(key)
            self.configs[key] = config

            def reload() -> int:
                from jabasray.tuner.pack_runner import state_from_bytes
                return self.runner.load(key, config, state_from_bytes(state))
            await self._in_thread(reload)
        if key not in self.configs:
            raise ValueError(f"trial {key!r} is not loaded")
        fut = asyncio.get_running_loop().create_future()
        if not self.waiting:
            self.first_wait = time.monotonic()
        self.waiting[key] = (fut, want_state)
        self._kick()
        return await fut

    def stats(self) -> dict:
        return {"members": sorted(self.configs), "units_run": self.units_run,
                "position": getattr(self.runner, "position", 0)}

    # -- the barrier -------------------------------------------------------------------------
    def _kick(self) -> None:
        if self.running or not self.waiting:
            return
        missing = set(self.configs) - set(self.waiting)
        late = self.first_wait + self.wait_s - time.monotonic()
        if missing and late > 0:
            if self.timer is None:
                def fire() -> None:
                    self.timer = None
                    self._kick()
                self.timer = asyncio.get_running_loop().call_later(late, fire)
            return
        if missing:
            log.info("setting aside %d member(s) that did not ask within %.1f s", len(missing), self.wait_s)
        aside = {k: self.configs.pop(k) for k in missing}
        batch = dict(self.waiting)
        self.waiting.clear()
        self.running = True
        asyncio.get_running_loop().create_task(self._run(batch, aside))

    async def _run(self, batch: dict[str, tuple[asyncio.Future, bool]], aside: dict[str, dict]) -> None:
        from jabasray.tuner.pack_runner import state_to_bytes

        keys = list(batch)

        def work() -> dict:
            if aside:
                states = self.runner.states(list(aside))
                for k, config in aside.items():
                    self.aside[k] = (config, state_to_bytes(states[k]))
                    self.runner.free(k)
            results = self.runner.unit(keys)
            want = [k for k, r in results.items() if batch[k][1] and not isinstance(r, Exception)]
            states = self.runner.states(want) if want else {}
            return {k: r if isinstance(r, Exception) else (r, state_to_bytes(states[k]) if k in states else None)
                    for k, r in results.items()}

        try:
            results = await self._in_thread(work)
        except Exception as e:                      # noqa: BLE001 -- hand it to every caller
            results = {k: e for k in keys}
        self.units_run += 1
        for k, r in results.items():
            fut = batch[k][0]
            if fut.done():
                continue
            if isinstance(r, Exception):
                self.configs.pop(k, None)           # a failed member leaves the pack
                fut.set_exception(r)
            else:
                fut.set_result(r)
        self.running = False
        self._touch()
        self._kick()
