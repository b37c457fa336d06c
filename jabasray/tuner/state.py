"""Bookkeeping of packed Hyperband -- pure (no Ray, no torch), fed with results by the searcher.

Implementation notes
--------------------
:class:`PackedHyperbandState` holds, for one Hyperband run, every sampled configuration
(:class:`ConfigRecord`), the survivors of each bracket and a queue of pack TASKS (a task = one
Tune trial = one pack of configurations of ONE bracket rung, all starting at the same step).

* At construction every bracket samples its ``n_0`` configurations (without replacement, seeded)
  and rung 0 of every bracket is packed (``plan_fn``) and queued.
* :meth:`next_task` hands out queued tasks (the searcher turns each into a trial).
* :meth:`complete` records every member's reported metric; when the last pack of a bracket's
  rung has completed, the bracket keeps its best ``n_{i+1}`` configurations (metric/mode,
  ties by configuration id), re-packs them and queues rung ``i + 1``. Brackets advance
  independently (no barrier across brackets), which equals running them one after another.
* :meth:`finished` once every bracket has completed its last rung.

Worked example (R = 9, eta = 3, brackets (9,1)(3,3)(1,9) / (5,3)(1,9) / (3,9)): rung 0 queues
the packs of 9 + 5 + 3 configurations; when the 9 of bracket 2 report, its best 3 are re-packed
for 3 units, and so on; 17 configurations are sampled in all.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from jabasray.planners.pack_opt import PackingPlan, SearchSpace
from jabasray.serialization import JsonMixin
from jabasray.tuner.brackets import Bracket

log = logging.getLogger(__name__)

__all__ = ["ConfigRecord", "PackedHyperbandResult", "PackedHyperbandState"]


@dataclass
class ConfigRecord(JsonMixin):
    """One sampled configuration: what it reported at each rung it reached."""
    config_id: int
    bracket: int                                       # s of its bracket
    config: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)   # one row per rung reached
    checkpoint: str | None = None                      # file with its latest state

    @property
    def last(self) -> dict[str, Any]:
        return self.history[-1]


@dataclass
class PackedHyperbandResult(JsonMixin):
    """Everything the search decided; ``best_config_id`` by ``metric``/``mode`` over the last
    result of each configuration (the rule of ``ResultGrid.get_best_result``)."""
    metric: str
    mode: str
    records: list[ConfigRecord]
    packs: list[dict[str, Any]] = field(default_factory=list)     # name, bracket, rung, member ids
    best_config_id: int = -1
    search_time_s: float = 0.0

    @property
    def best_config(self) -> dict[str, Any]:
        return self.records[self.best_config_id].config


class PackedHyperbandState:
    """See the module docstring. ``plan_fn(configs) -> PackingPlan``; ``steps_of(units)``
    converts resource units to training steps; ``task_extra`` is copied into every task."""

    def __init__(self, space: SearchSpace, brackets: Sequence[Bracket],
                 plan_fn: Callable[[list[dict]], PackingPlan], steps_of: Callable[[float], int],
                 metric: str, mode: str, seed: int = 0, task_extra: dict[str, Any] | None = None) -> None:
        self.space = space
        self.brackets = {b.s: b for b in brackets}
        self.plan_fn = plan_fn
        self.steps_of = steps_of
        self.metric, self.mode = metric, mode
        self.task_extra = dict(task_extra or {})
        rng = random.Random(seed)
        self.records: list[ConfigRecord] = []
        self.alive: dict[int, list[int]] = {}
        self.rung: dict[int, int] = {}
        self.outstanding: dict[int, set[str]] = {}
        self.queue: list[dict[str, Any]] = []
        self.packs: list[dict[str, Any]] = []
        for b in brackets:                                   # Hyperband: sample n_0 per bracket
            ids = []
            for cfg in space.sample(b.num_configs, rng):
                self.records.append(ConfigRecord(len(self.records), b.s, cfg))
                ids.append(self.records[-1].config_id)
            self.alive[b.s] = ids
            self.rung[b.s] = 0
            self._queue_rung(b.s)

    # -- scheduling ----------------------------------------------------------------------------
    def _queue_rung(self, s: int) -> None:
        b, i = self.brackets[s], self.rung[s]
        ids = self.alive[s]
        start = self.steps_of(b.rungs[i - 1].r) if i else 0
        end = self.steps_of(b.rungs[i].r)
        plan = self.plan_fn([self.records[c].config for c in ids])
        names = set()
        for j, members in enumerate(plan.packs):
            name = f"s{s}_r{i}_p{j}"
            task = {**self.task_extra, "name": name, "bracket": s, "rung": i,
                    "members": [{"id": ids[k], "config": self.records[ids[k]].config, "start": start,
                                 "end": end, "ckpt": self.records[ids[k]].checkpoint} for k in members]}
            self.queue.append(task)
            self.packs.append({"name": name, "bracket": s, "rung": i, "members": [ids[k] for k in members]})
            names.add(name)
        self.outstanding[s] = names
        log.debug("bracket %d rung %d: %d configs in %d packs", s, i, len(ids), len(plan.packs))

    def next_task(self) -> dict[str, Any] | None:
        return self.queue.pop(0) if self.queue else None

    @property
    def finished(self) -> bool:
        return not self.queue and not any(self.outstanding.values())

    def _key(self, cid: int) -> tuple[float, int]:
        v = float(self.records[cid].last[self.metric])
        return (-v if self.mode == "max" else v, cid)

    def complete(self, task: dict[str, Any], members: dict[str, dict[str, Any]]) -> None:
        """Record the per-member results of a finished pack task; advance its bracket."""
        s, i, name = task["bracket"], task["rung"], task["name"]
        if name not in self.outstanding.get(s, set()):
            raise ValueError(f"task {name!r} is not outstanding")
        expected = {str(m["id"]) for m in task["members"]}
        if set(members) != expected:
            raise ValueError(f"task {name!r} must report members {sorted(expected)}, got {sorted(members)}")
        b = self.brackets[s]
        for cid, row in members.items():
            rec = self.records[int(cid)]
            rec.history.append({**{k: v for k, v in row.items() if k != "checkpoint"},
                                "rung": i, "resource": b.rungs[i].r, "bracket": s,
                                "pack": name, "pack_size": len(members)})
            rec.checkpoint = row.get("checkpoint")
        self.outstanding[s].discard(name)
        if not self.outstanding[s]:                          # rung done: successive halving
            keep = b.keep(i)
            self.alive[s] = sorted(self.alive[s], key=self._key)[:keep]
            if keep:
                self.rung[s] = i + 1
                self._queue_rung(s)

    def result(self, search_time_s: float = 0.0) -> PackedHyperbandResult:
        done = [r for r in self.records if r.history]
        best = min(done, key=lambda r: self._key(r.config_id)) if done else None
        return PackedHyperbandResult(self.metric, self.mode, self.records, self.packs,
                                     best.config_id if best else -1, search_time_s)
