"""Tune's ``HyperBandScheduler`` with one missing case handled: a finished bracket's paused trials.

Tune's HyperBand pauses a trial that reaches its rung while others of the bracket are still
running; when the last of them reports the rung, ``_process_bracket`` halves the bracket (or,
at ``max_t``, stops the paused trials: ``_Bracket.cleanup_full``). But when that last trial
*ends on its own* -- a function trainable that returns after ``max_t`` units, which is what a
trainable written for ``max_t`` does -- Tune calls ``on_trial_complete`` ->
``on_trial_remove``, which processes the bracket only ``if not bracket.finished()``. A
finished bracket is skipped, so the trials paused at ``max_t`` stay PAUSED, nothing is left to
run, and ``Tuner.fit()`` loops forever (seen on Ray 2.60 with packed trials whose last unit
ended in the same controller step as another trial's rung result).

:func:`hyperband_scheduler` returns a subclass that, after Tune's own removal bookkeeping,
stops the paused trials of a bracket that the removal finished -- exactly what
``_process_bracket`` does for a finished bracket when the last trial reports instead of ending.
The same hang has a second door: a trial whose PAUSE decision is still in progress (Tune
saves it before its status becomes PAUSED) when the bracket finishes -- the last trial ends
or reports in that window -- is not PAUSED yet when ``cleanup_full`` looks, and nothing looks
again (seen with packed trials at R = 81: one trial left PAUSED at ``max_t`` in a finished
bracket). So the subclass also sweeps every finished bracket for PAUSED trials whenever the
controller asks it for a trial to run (:meth:`choose_trial_to_run`, every controller step).

Neither sweep may run INSIDE Tune's own bracket processing: ``_process_bracket`` stops the bad
trials of a halving one by one (``stop_trial`` -> ``on_trial_remove``) and then walks the good
ones. When the halving it performs is the bracket's last and every trial left has already
reached ``max_t`` (a trial whose time attribute oversteps the rung, e.g. ``time_total_s`` or a
trainable that reports past a rung), the bracket is ``finished()`` as soon as the first bad
trial is removed; sweeping then would stop trials Tune is still iterating over, and Tune
raises ``TuneError: Trial with unexpected bad status encountered: ... is TERMINATED``. So the
subclass marks its own ``_process_bracket`` calls and sweeps only outside them; every decision
is otherwise Tune's (same brackets -- Tune keeps ``ceil(n / eta)`` trials per halving, see
:mod:`jabasray.tuner.brackets` --, same halving, same handling of errored, early-ended and
late-added trials).
The subclass lives in :mod:`jabasray.tuner.tune_internals` with every other Tune internal
jabasray uses (checked against the installed Ray there). Ray is imported lazily, like the rest
of :mod:`jabasray.tuner`.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

__all__ = ["hyperband_scheduler"]


def hyperband_scheduler(max_t: int, reduction_factor: int, time_attr: str = "training_iteration", **kwargs):
    """Tune's ``HyperBandScheduler(time_attr, max_t, reduction_factor, **kwargs)`` with the
    finished-bracket fix of this module (same brackets, same decisions otherwise)."""
    from .tune_internals import finishing_hyperband_class

    return finishing_hyperband_class()(time_attr=time_attr, max_t=max_t, reduction_factor=reduction_factor, **kwargs)
