"""The members of ONE device and the packed model they train in (torch only, no Ray).

Implementation notes
--------------------
A :class:`PackRunner` is what a device's packing coordinator (:mod:`jabasray.tuner.coordinator`)
executes. Tune trials come and go one at a time; the runner keeps every live trial as a
*member* (its own model and optimizer, built from the trial's config by the user's
:class:`~jabasray.tuner.training.TrainingSpec`) and trains the members together one resource
unit at a time:

* :meth:`load` (Pack's ``load``): a trial arrives, possibly with the state it checkpointed
  (the user's own ``state_dict``s); the member joins the packed model at the next unit.
* :meth:`unit`: ``steps_per_unit`` packed steps of the members asked for, all on ONE shared
  batch per step (Pack 3.2: the batch is read once; member k trains on its first ``b_k``
  samples, 3.1.1), then the user's metric of each member. Members not asked for this unit
  (a trial the scheduler has not released yet) are set aside (``free``) and join again when
  asked -- the pack never waits for them and never trains them without their trial.
* :meth:`free` (Pack's ``free``): the scheduler stopped or paused the trial.
* A member whose training or metric raises fails alone: when the joint step raises, every
  member of the unit is retrained on its own for that unit (nothing was updated: the joint
  step's forward/backward precede every update), so only the failing ones report the error.

Shared input stream: the runner reads its stream from its own position, so a member's batches
depend on when it joined the pack (deviation from the packed-Hyperband trials, whose members
all started together: Tune trials arrive one at a time). Every batch is still a slice of a
fresh random permutation of the data per epoch, as in ordinary training.
"""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from jabasray.engine.packing import PackedModel, batchable, pack
from jabasray.tuner.training import (SharedStream, TrainingSpec, build_member, cached_data,
                                     load_member_state, member_state)

log = logging.getLogger(__name__)

__all__ = ["PackRunner", "Unpackable", "unpackable_reason", "state_to_bytes", "state_from_bytes"]


class Unpackable(ValueError):
    """The member's model cannot share a packed model (the trial trains on its own)."""


def unpackable_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot be stacked with others (None: it can)."""
    if not batchable(model):
        return (f"{type(model).__name__} has buffers (e.g. BatchNorm running statistics) or "
                f"dropout, so its members cannot be stacked into one batched computation")
    return None


def state_to_bytes(state: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def state_from_bytes(data: bytes) -> dict:
    """A member checkpoint (tensors, numbers, strings only: ``weights_only=True``)."""
    return torch.load(io.BytesIO(data), weights_only=True)


@dataclass
class _Member:
    key: str
    config: dict
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch_size: int
    steps: int
    units: int
    pid: int | None = None          # id inside the packed model (None: set aside)


class PackRunner:
    """See the module docstring. ``data``: ``(train, validation)``; default ``spec.data_fn()``."""

    def __init__(self, spec: TrainingSpec, stream_batch: int, data: tuple | None = None) -> None:
        self.spec = spec
        train, self.val = data if data is not None else cached_data(spec)
        self.stream = SharedStream(train, stream_batch, spec.seed, spec.device)
        self.position = 0                          # next chunk of the shared stream
        self.pack: PackedModel | None = None
        self.members: dict[str, _Member] = {}
        self._leaving: list[int] = []              # pack ids of freed members, dropped at the next unit

    def __len__(self) -> int:
        return len(self.members)

    # -- Pack's load / free ----------------------------------------------------------------
    def load(self, key: str, config: Mapping[str, Any], state: Mapping[str, Any] | None = None) -> int:
        """Add a member; returns the units it has trained (from ``state``, else 0). Raises
        :class:`Unpackable` when its model cannot be stacked."""
        return self.add(self.prepare(key, config, state))

    def prepare(self, key: str, config: Mapping[str, Any], state: Mapping[str, Any] | None = None) -> _Member:
        """Build a member (model, optimizer, its state loaded) WITHOUT touching the runner: safe
        on another thread while a unit trains (the coordinator's loads run off the training
        thread); :meth:`add` then seats it at the next unit."""
        model, opt = build_member(self.spec, config)
        reason = unpackable_reason(model)
        if reason is not None:
            raise Unpackable(reason)
        steps = load_member_state(model, opt, state) if state else 0
        units = int(state.get("units", steps // self.spec.steps_per_unit)) if state else 0
        return _Member(key, dict(config), model, opt, self.spec.batch_size_of(config), steps, units)

    def add(self, member: _Member) -> int:
        """Register a :meth:`prepare`d member (on the training thread); returns its units."""
        if member.key in self.members:
            raise ValueError(f"member {member.key!r} is already loaded")
        self.members[member.key] = member
        return member.units

    def free(self, key: str) -> None:
        """Drop a member (its trial was stopped, paused or finished). Its rows leave the
        packed model at the next unit, together with the other leaves and joins (one restack)."""
        m = self.members.pop(key, None)
        if m is not None and m.pid is not None:
            self._leaving.append(m.pid)

    def state(self, key: str) -> dict:
        """The member's checkpoint: its own model and optimizer ``state_dict``s, steps, units."""
        return self.states([key])[key]

    def states(self, keys: list[str]) -> dict[str, dict]:
        """:meth:`state` of several members, read from their rows of the packed model (no
        restack); every tensor owns its storage, so a member's checkpoint holds its own
        tensors only, whatever the pack's size."""
        out = {}
        for k in keys:
            m = self.members[k]
            if m.pid is not None:
                model_sd, opt_sd = self.pack.member_state(m.pid)
                out[k] = {"model": model_sd, "optimizer": opt_sd, "steps": int(m.steps), "units": m.units}
            else:
                out[k] = {**member_state(m.model, m.optimizer, m.steps), "units": m.units}
        return out

    # -- one resource unit -------------------------------------------------------------------
    def unit(self, keys: list[str]) -> dict[str, dict | Exception]:
        """Train the members ``keys`` one unit together; returns each one's metrics row (or
        the exception that failed it; a failed member is dropped)."""
        unknown = [k for k in keys if k not in self.members]
        if unknown:
            raise ValueError(f"members {unknown} are not loaded")
        self._seat(keys)
        try:
            losses = self._steps([self.members[k] for k in keys], self.pack)
        except Exception as e:                                     # isolate the failing member(s)
            log.warning("packed step of %d members failed (%s); retrying each member alone", len(keys), e)
            return self._isolated(keys)
        return {k: self._report(self.members[k], losses[k]) for k in keys}

    def _seat(self, keys: list[str]) -> None:
        """Make the packed model hold exactly ``keys`` (Pack's load/free): every leave and join
        of this unit boundary is applied with ONE restack; none when the members stay."""
        want = set(keys)
        leaving = [m for m in self.members.values() if m.pid is not None and m.key not in want]
        new = [self.members[k] for k in keys if self.members[k].pid is None]
        gone = self._leaving + [m.pid for m in leaving]
        self._leaving = []
        for m in leaving:
            m.pid = None
        if not new and not gone:
            return
        if self.pack is None:
            self.pack = pack([m.model for m in new], [m.optimizer for m in new],
                             [m.batch_size for m in new], loss_fn=self.spec.loss_fn,
                             cuda_graphs=self.spec.cuda_graphs)
            ids = self.pack.member_ids
        else:
            ids = self.pack.update(gone, [(m.model, m.optimizer, m.batch_size) for m in new])
        for m, pid in zip(new, ids):
            m.pid = pid

    def _steps(self, members: list[_Member], packed: PackedModel) -> dict[str, float]:
        pos = {pid: i for i, pid in enumerate(packed.member_ids)}
        total = torch.zeros(len(pos), dtype=torch.float64, device=packed.device)
        for _ in range(self.spec.steps_per_unit):
            x, y = self.stream.batch(self.position, packed.max_batch_size)
            total += packed.train_step_tensor(x, y).double()
            self.position += 1
        for m in members:
            m.steps += self.spec.steps_per_unit
            m.units += 1
        mean = (total / self.spec.steps_per_unit).tolist()
        return {m.key: mean[pos[m.pid]] for m in members}

    def _report(self, m: _Member, train_loss: float) -> dict | Exception:
        try:
            value = float(self.spec.metric_fn(m.model, self.val))
        except Exception as e:                                     # noqa: BLE001 -- the member's error
            self.free(m.key)
            return e
        return {self.spec.metric: value, "train_loss": train_loss, "steps": m.steps,
                "units": m.units, "pack_size": len(self.pack) if self.pack is not None else 1}

    def _isolated(self, keys: list[str]) -> dict[str, dict | Exception]:
        """Each member of a failed unit trains alone for this unit."""
        out: dict[str, dict | Exception] = {}
        if self.pack is not None:
            for m in self.members.values():
                m.pid = None
            self.pack.free_all()
            self.pack = None
        self._leaving = []
        start = self.position
        for k in keys:
            m = self.members[k]
            self.position = start                                  # the same batches as the pack
            try:
                solo = pack([m.model], [m.optimizer], [m.batch_size], loss_fn=self.spec.loss_fn,
                            cuda_graphs=self.spec.cuda_graphs)
                m.pid = solo.member_ids[0]
                loss = self._steps([m], solo)[k]
                solo.free_all()
            except Exception as e:                                 # noqa: BLE001 -- the member's error
                log.warning("member %s failed: %s", k, e)
                self.members.pop(k, None)
                out[k] = e
                continue
            finally:
                m.pid = None
            out[k] = self._report(m, loss)
        return out
