"""An ordinary one-configuration Tune trainable built from a :class:`TrainingSpec`.

This is the UNPACKED counterpart of the packed trials: one configuration per trial, one
``tune.report`` per resource unit (``training_iteration`` = units trained), checkpoints at the
given units so that Ray Tune's own ``HyperBandScheduler`` can pause and resume trials. It reads
the same shared input stream and builds the same initial weights as a packed member, so a
configuration follows the same trajectory here and in a pack.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Iterable

import torch

from jabasray.tuner.training import (SharedStream, TrainingSpec, build_member, cached_data,
                                     load_member_state, member_state)
from jabasray.validation import check_int

__all__ = ["make_trainable", "plain_trial_class", "train_plain", "PlainMember"]


def make_trainable(spec: TrainingSpec, stream_batch: int, max_units: int,
                   checkpoint_units: Iterable[int] | None = None,
                   report_units: Iterable[int] | None = None,
                   threads: int = 1) -> Callable[[dict], None]:
    """Function trainable for ``tune.Tuner``: trains ``config`` for up to ``max_units`` units.

    Every report carries ``units`` (resource units trained so far). ``report_units``: units
    after which the metric is evaluated and reported (default: every unit, so
    ``training_iteration == units``); with sparse reports use ``time_attr="units"`` in the
    scheduler. ``checkpoint_units``: reports that carry a checkpoint (default: every report);
    for ``HyperBandScheduler(max_t=R, reduction_factor=eta)`` the rung boundaries (powers of
    eta) suffice. Resumes from ``tune.get_checkpoint()``.

    The trainable takes an optional ``data=(train, val)`` keyword, so that
    ``tune.with_parameters(trainable, data=...)`` ships the datasets once through Ray's object
    store (as the packed trials do); without it every trial process calls ``spec.data_fn()``.
    """
    check_int("stream_batch", stream_batch, min_value=1)
    check_int("max_units", max_units, min_value=1)
    ckpt_at = None if checkpoint_units is None else {int(u) for u in checkpoint_units}
    report_at = None if report_units is None else {int(u) for u in report_units} | {max_units}

    def trainable(config: dict[str, Any], data: tuple | None = None) -> None:
        torch.set_num_threads(threads)
        train_plain(spec, config, stream_batch, max_units, data, report_at, ckpt_at)

    return trainable


def train_plain(spec: TrainingSpec, config: dict[str, Any], stream_batch: int, max_units: int,
                data: tuple | None = None, report_at: set[int] | None = None,
                ckpt_at: set[int] | None = None) -> None:
    """The body of a plain (unpacked) trial: train ``config`` alone up to ``max_units``,
    ``tune.report`` at ``report_at`` units (None: every unit) with a checkpoint (the user's
    own ``state_dict``s in ``member.pt``) at ``ckpt_at`` (None: every report); resumes from
    ``tune.get_checkpoint()``. Also the fallback of :func:`jabasray.tuner.packed` for a spec
    whose model cannot be packed."""
    from ray import tune

    train, val = data if data is not None else cached_data(spec)
    stream = SharedStream(train, stream_batch, spec.seed, spec.device)
    model, opt = build_member(spec, config)
    b = spec.batch_size_of(config)
    step = 0
    ckpt = tune.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            step = load_member_state(model, opt, torch.load(os.path.join(d, "member.pt"), weights_only=True))
    unit = step // spec.steps_per_unit
    while unit < max_units:
        total = 0.0                          # becomes a float64 tensor: no host sync per step
        for _ in range(spec.steps_per_unit):
            x, y = stream.batch(step, b)
            opt.zero_grad()
            loss = spec.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += loss.detach().double()
            step += 1
        unit += 1
        if report_at is not None and unit not in report_at:
            continue
        metrics = {spec.metric: float(spec.metric_fn(model, val)),
                   "train_loss": float(total) / spec.steps_per_unit, "steps": step, "units": unit}
        if ckpt_at is None or unit in ckpt_at:
            with tempfile.TemporaryDirectory() as d:
                torch.save({**member_state(model, opt, step), "units": unit}, os.path.join(d, "member.pt"))
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
        else:
            tune.report(metrics)


class PlainMember:
    """ONE configuration trained unit by unit in the calling process (the fallback of a packed
    trial whose model cannot be stacked): the same shared-stream batches and initial weights
    as a packed member, the same metrics row and checkpoint contents."""

    def __init__(self, spec: TrainingSpec, config: dict[str, Any], stream_batch: int,
                 state: dict | None = None, data: tuple | None = None) -> None:
        self.spec = spec
        train, self.val = data if data is not None else cached_data(spec)
        self.stream = SharedStream(train, stream_batch, spec.seed, spec.device)
        self.model, self.opt = build_member(spec, config)
        self.b = spec.batch_size_of(config)
        self.step = load_member_state(self.model, self.opt, state) if state else 0

    @property
    def units(self) -> int:
        return self.step // self.spec.steps_per_unit

    def unit(self) -> dict:
        total = 0.0
        for _ in range(self.spec.steps_per_unit):
            x, y = self.stream.batch(self.step, self.b)
            self.opt.zero_grad()
            loss = self.spec.loss_fn(self.model(x), y)
            loss.backward()
            self.opt.step()
            total += loss.detach().double()
            self.step += 1
        return {self.spec.metric: float(self.spec.metric_fn(self.model, self.val)),
                "train_loss": float(total) / self.spec.steps_per_unit, "steps": self.step, "units": self.units}

    def state(self) -> dict:
        return {**member_state(self.model, self.opt, self.step), "units": self.units}


def plain_trial_class(spec: TrainingSpec, stream_batch: int, max_units: int, threads: int = 1) -> type:
    """The same trial as :func:`make_trainable` as a class ``tune.Trainable``: ``step()`` trains
    one unit of :class:`PlainMember` (the same batches, weights and metrics row), ``done`` at
    ``max_units``; a checkpoint (``member.pt``) only when Tune asks (a pause,
    ``checkpoint_frequency``, ``checkpoint_at_end``); ``reset_config`` for ``reuse_actors``.
    ``setup`` takes ``data=(train, val)`` from ``tune.with_parameters``. A class, as the packed
    trials are, so that one ``RunConfig`` (e.g. ``CheckpointConfig(checkpoint_at_end=True)``,
    which Tune refuses for a function trainable) serves a sweep whichever way
    :func:`jabasray.tuner.packed` decides."""
    check_int("stream_batch", stream_batch, min_value=1)
    check_int("max_units", max_units, min_value=1)
    from ray import tune

    class PlainTrial(tune.Trainable):
        def setup(self, config: dict[str, Any], data: tuple | None = None) -> None:
            torch.set_num_threads(threads)
            self._data = data
            self.member = PlainMember(spec, config, stream_batch, data=data)

        def step(self) -> dict:
            row = self.member.unit()
            return {**row, "done": self.member.units >= max_units}

        def save_checkpoint(self, checkpoint_dir: str) -> None:
            torch.save(self.member.state(), os.path.join(checkpoint_dir, "member.pt"))

        def load_checkpoint(self, checkpoint_dir: str) -> None:
            state = torch.load(os.path.join(checkpoint_dir, "member.pt"), weights_only=True)
            self.member = PlainMember(spec, self.config, stream_batch, state=state, data=self._data)

        def reset_config(self, new_config: dict[str, Any]) -> bool:
            self.member = PlainMember(spec, new_config, stream_batch, data=self._data)
            return True

    return PlainTrial
