"""The finished-bracket fix of :mod:`jabasray.tuner.schedulers`, driven the way Tune's controller
drives a scheduler (``on_trial_add`` / ``on_trial_result`` / ``on_trial_complete``), with fake
trials and a controller that records ``stop_trial`` -- no Ray cluster."""
from __future__ import annotations

import pytest

from jabasray.tuner.schedulers import hyperband_scheduler

schedulers = pytest.importorskip("ray.tune.schedulers")
from ray.tune.experiment import Trial  # noqa: E402


class _Trial:
    PAUSED, RUNNING, PENDING, TERMINATED = Trial.PAUSED, Trial.RUNNING, Trial.PENDING, Trial.TERMINATED

    def __init__(self, name):
        self.trial_id, self.status, self.is_saving = name, Trial.RUNNING, False

    def __repr__(self):
        return self.trial_id


class _Controller:
    def __init__(self):
        self.stopped = []

    def stop_trial(self, trial):
        self.stopped.append(trial)
        trial.status = Trial.TERMINATED


def _finish_by_ending(scheduler):
    """Bracket of two trials at max_t = 3: A reports its last unit first and is PAUSED (B is
    still running); then B's trainable returns after its last unit (Tune: on_trial_complete)."""
    ctl = _Controller()
    a, b = _Trial("A"), _Trial("B")
    scheduler.on_trial_add(ctl, a)
    scheduler.on_trial_add(ctl, b)
    assert scheduler._trial_info[a][0] is scheduler._trial_info[b][0]      # one bracket
    for it in (1, 2):
        for t in (a, b):
            assert scheduler.on_trial_result(ctl, t, {"training_iteration": it, "acc": it}) == "CONTINUE"
    assert scheduler.on_trial_result(ctl, a, {"training_iteration": 3, "acc": 3}) == "PAUSE"
    a.status = Trial.PAUSED
    b.status = Trial.TERMINATED
    scheduler.on_trial_complete(ctl, b, {"training_iteration": 3, "acc": 3})
    return ctl, a


def _stock():
    return schedulers.HyperBandScheduler(time_attr="training_iteration", metric="acc", mode="max",
                                         max_t=3, reduction_factor=3)


def test_paused_trial_of_a_bracket_finished_by_a_trial_ending_is_stopped():
    ctl, a = _finish_by_ending(hyperband_scheduler(3, 3, metric="acc", mode="max"))
    assert ctl.stopped == [a]                            # nothing left PAUSED: fit() can end


def test_stock_hyperband_leaves_that_trial_paused_forever():
    """Why the subclass exists (Ray 2.60): Tune's own scheduler stops nothing, no trial is left
    to run, and the controller loops. If this starts failing, Tune fixed it upstream."""
    sched = _stock()
    ctl, a = _finish_by_ending(sched)
    assert ctl.stopped == [] and a.status == Trial.PAUSED
    assert sched.choose_trial_to_run(ctl) is None


def test_same_decisions_as_tune_when_the_last_trial_reports():
    """When the last trial reports max_t instead of ending, both stop the paused trial in
    _process_bracket and return STOP for the reporter."""
    out = []
    for sched in (_stock(), hyperband_scheduler(3, 3, metric="acc", mode="max")):
        ctl = _Controller()
        a, b = _Trial("A"), _Trial("B")
        sched.on_trial_add(ctl, a)
        sched.on_trial_add(ctl, b)
        assert sched.on_trial_result(ctl, a, {"training_iteration": 3, "acc": 1}) == "PAUSE"
        a.status = Trial.PAUSED
        out.append((sched.on_trial_result(ctl, b, {"training_iteration": 3, "acc": 2}),
                    [t.trial_id for t in ctl.stopped]))
    assert out[0] == out[1] == ("STOP", ["A"])


def _finish_while_pausing(scheduler):
    """A reports max_t first and is told to PAUSE, but its pause is still in progress (status
    RUNNING) when B's trainable ends after its last unit and finishes the bracket; only then
    does A's status become PAUSED."""
    ctl = _Controller()
    a, b = _Trial("A"), _Trial("B")
    scheduler.on_trial_add(ctl, a)
    scheduler.on_trial_add(ctl, b)
    assert scheduler.on_trial_result(ctl, a, {"training_iteration": 3, "acc": 3}) == "PAUSE"
    assert scheduler.on_trial_result(ctl, b, {"training_iteration": 2, "acc": 2}) == "CONTINUE"
    b.status = Trial.TERMINATED
    scheduler.on_trial_complete(ctl, b, {"training_iteration": 3, "acc": 3})
    stopped_at_removal = list(ctl.stopped)
    a.status = Trial.PAUSED                              # the pause completes afterwards
    return ctl, a, stopped_at_removal, scheduler.choose_trial_to_run(ctl)


def test_a_trial_whose_pause_completes_after_its_bracket_finished_is_stopped():
    ctl, a, at_removal, chosen = _finish_while_pausing(hyperband_scheduler(3, 3, metric="acc", mode="max"))
    assert at_removal == []                              # still RUNNING then: nothing to stop yet
    assert ctl.stopped == [a] and chosen is None         # the controller's next step stops it


def test_stock_hyperband_leaves_a_late_paused_trial_paused_forever():
    ctl, a, _, chosen = _finish_while_pausing(_stock())
    assert ctl.stopped == [] and a.status == Trial.PAUSED and chosen is None


class _TuneController(_Controller):
    """``stop_trial`` as Tune's controller does it: a PAUSED or PENDING trial is removed from
    the scheduler (``on_trial_remove``), a RUNNING one completed (``on_trial_complete``), and
    only then becomes TERMINATED."""

    def __init__(self, scheduler):
        super().__init__()
        self.scheduler = scheduler

    def stop_trial(self, trial):
        if trial.status in (Trial.TERMINATED, Trial.ERROR):
            return
        if trial.status in (Trial.PENDING, Trial.PAUSED):
            self.scheduler.on_trial_remove(self, trial)
        else:
            self.scheduler.on_trial_complete(self, trial, {})
        self.stopped.append(trial)
        trial.status = Trial.TERMINATED


def _overstep(scheduler):
    """max_t = 9, eta = 3: bracket s = 0 (3 trials, r = 9) is filled first, then bracket s = 1
    (5 trials, r0 = 3, keeps ceil(5/3) = 2). Every trial of bracket 1 oversteps its first rung:
    its first result already has time_total_s = 9 = max_t. A..D are paused at the rung, E's
    result triggers the bracket's last halving, after which every live trial is at max_t."""
    ctl = _TuneController(scheduler)
    for name in ("X1", "X2", "X3"):
        scheduler.on_trial_add(ctl, _Trial(name))
    trials = [_Trial(n) for n in "ABCDE"]
    for t in trials:
        scheduler.on_trial_add(ctl, t)
    actions = []
    for acc, t in enumerate(trials):
        a = scheduler.on_trial_result(ctl, t, {"time_total_s": 9.5, "acc": acc})
        actions.append(a)
        if a == "PAUSE":
            t.status = Trial.PAUSED
    return actions, sorted(t.trial_id for t in ctl.stopped), {t.trial_id: t.status for t in trials}


def test_overstepping_max_t_before_the_last_halving_behaves_as_tune():
    """Tune's stock scheduler stops the three bad trials and the paused good one and STOPs
    the reporter; the subclass must do exactly that. (Its finished-bracket sweep used to run
    inside Tune's halving, stopping trials Tune still iterated over: ``TuneError: Trial with
    unexpected bad status encountered: ... is TERMINATED``.)"""
    def make(cls):
        return cls(time_attr="time_total_s", metric="acc", mode="max", max_t=9, reduction_factor=3)

    stock = _overstep(make(schedulers.HyperBandScheduler))
    ours = _overstep(hyperband_scheduler(9, 3, time_attr="time_total_s", metric="acc", mode="max"))
    assert stock == ours
    assert stock[0] == ["PAUSE"] * 4 + ["STOP"]
    assert stock[1] == ["A", "B", "C", "D"]             # E (best, running) gets STOP itself


def test_finished_bracket_sweep_with_tune_like_controller():
    """The original hang, driven by a controller whose ``stop_trial`` calls back into the
    scheduler as Tune's does: the paused trial is stopped when the other one ends."""
    sched = hyperband_scheduler(3, 3, metric="acc", mode="max")
    ctl = _TuneController(sched)
    a, b = _Trial("A"), _Trial("B")
    sched.on_trial_add(ctl, a)
    sched.on_trial_add(ctl, b)
    assert sched.on_trial_result(ctl, a, {"training_iteration": 3, "acc": 3}) == "PAUSE"
    a.status = Trial.PAUSED
    b.status = Trial.TERMINATED
    sched.on_trial_complete(ctl, b, {"training_iteration": 3, "acc": 3})
    assert ctl.stopped == [a] and a.status == Trial.TERMINATED
    assert sched.choose_trial_to_run(ctl) is None
