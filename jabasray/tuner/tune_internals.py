"""Every Ray Tune internal :mod:`jabasray.tuner` builds on, in one module, with a check that
the installed Ray has them.

Beyond Tune's public API (``Tuner``, ``TuneConfig``, ``Trainable``, ``Searcher``, the schedulers'
public hooks ``on_trial_remove`` / ``choose_trial_to_run``), jabasray uses:

* ``HyperBandScheduler._process_bracket(tune_controller, bracket)``, ``._trial_info[trial] ->
  (bracket, ...)`` and ``._hyperbands`` (bands of brackets, ``None`` for an empty slot): the
  finished-bracket fix of :mod:`jabasray.tuner.schedulers`;
* ``ray.tune.schedulers.hyperband._Bracket``: ``finished()``, ``current_trials()``,
  ``cleanup_full(tune_controller)``;
* ``Trial.status`` and ``Trial.PAUSED``;
* the domain classes behind ``tune.uniform`` / ``choice`` / ``randint`` ...:
  ``ray.tune.search.sample.{Domain, Categorical, Float, Integer, LogUniform}`` with
  ``.categories``, ``.lower``, ``.upper``, ``.get_sampler()``, ``.sample(random_state=)``
  (:mod:`jabasray.tuner.space`, the search order of :mod:`jabasray.tuner.packed_trials`);
* ``ray.tune.result.DONE``.

Tune may change any of them in a minor release. :data:`TESTED_RAY` is the range of Ray
releases the suite passed on (one constant for every internal jabasray uses, kept in
:mod:`jabasray.actors.ray_internals`; ``pyproject.toml`` bounds Ray to it);
:func:`problems` lists, one line each, an installed Ray outside that range and every internal
above that is missing. :func:`require` (called before a scheduler is built) raises
:class:`TuneInternalsError` for a missing internal and logs a warning for an untested version;
``tests/test_tune_internals.py`` fails on either, with the lines of :func:`problems`.
"""
from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace

from ..actors import ray_internals
from ..actors.ray_internals import TESTED_RAY

log = logging.getLogger(__name__)


class TuneInternalsError(RuntimeError):
    """The installed Ray lacks a Tune internal jabasray.tuner uses (one line)."""


def version_problem(version: str) -> str | None:
    """One line when Ray ``version`` is outside :data:`TESTED_RAY`, else None."""
    return ray_internals.version_problem(version, "jabasray.tuner", "jabasray/tuner/tune_internals.py")


def _has(obj: object, name: str, params: tuple[str, ...] | None = None) -> bool:
    attr = getattr(obj, name, None)
    if attr is None:
        return False
    if params is None:
        return True
    try:
        got = tuple(p for p in inspect.signature(attr).parameters if p != "self")
    except (TypeError, ValueError):
        return False
    return got == params


def missing_internals() -> list[str]:
    """The internals of the module notes that the installed Ray lacks (``module.name``)."""
    missing: list[str] = []
    try:
        from ray.tune.schedulers import hyperband as hb
    except ImportError:
        return ["ray.tune.schedulers.hyperband"]
    sched = getattr(hb, "HyperBandScheduler", None)
    bracket = getattr(hb, "_Bracket", None)
    if sched is None:
        missing.append("ray.tune.schedulers.hyperband.HyperBandScheduler")
    else:
        for name, params in (("_process_bracket", ("tune_controller", "bracket")),
                             ("on_trial_remove", ("tune_controller", "trial")),
                             ("choose_trial_to_run", ("tune_controller",))):
            if not _has(sched, name, params):
                missing.append(f"HyperBandScheduler.{name}{params}")
        try:
            inst = sched()
            for name in ("_trial_info", "_hyperbands"):
                if not hasattr(inst, name):
                    missing.append(f"HyperBandScheduler().{name}")
        except Exception as e:  # noqa: BLE001 - its constructor changed
            missing.append(f"HyperBandScheduler() ({type(e).__name__}: {e})")
    if bracket is None:
        missing.append("ray.tune.schedulers.hyperband._Bracket")
    else:
        for name, params in (("finished", ()), ("current_trials", ()),
                             ("cleanup_full", ("tune_controller",))):
            if not _has(bracket, name, params):
                missing.append(f"_Bracket.{name}{params}")
    try:
        from ray.tune.experiment import Trial
        if getattr(Trial, "PAUSED", None) != "PAUSED":
            missing.append("ray.tune.experiment.Trial.PAUSED")
    except ImportError:
        missing.append("ray.tune.experiment.Trial")
    try:
        from ray.tune.search import sample
        for name in ("Domain", "Categorical", "Float", "Integer", "LogUniform"):
            if not hasattr(sample, name):
                missing.append(f"ray.tune.search.sample.{name}")
        if hasattr(sample, "Domain"):
            missing += [f"ray.tune.search.sample.Domain.{a}" for a in ("sample", "get_sampler")
                        if not hasattr(sample.Domain, a)]
        if hasattr(sample, "Float") and not all(hasattr(sample.Float(0.0, 1.0), a) for a in ("lower", "upper")):
            missing.append("ray.tune.search.sample.Float().lower/.upper")
        if hasattr(sample, "Categorical") and not hasattr(sample.Categorical([1]), "categories"):
            missing.append("ray.tune.search.sample.Categorical().categories")
    except ImportError:
        missing.append("ray.tune.search.sample")
    try:
        from ray.tune import result
        if getattr(result, "DONE", None) != "done":
            missing.append("ray.tune.result.DONE")
    except ImportError:
        missing.append("ray.tune.result")
    return missing


def problems(version: str | None = None) -> list[str]:
    """One line per problem: Ray ``version`` (default: the installed one) outside
    :data:`TESTED_RAY`, then one per missing internal."""
    return ray_internals.problem_lines(version, version_problem, missing_internals(),
                                       "Tune internals jabasray.tuner uses",
                                       "jabasray/tuner/tune_internals.py")


_checked = False


def require() -> None:
    """Before the tuner uses an internal: :class:`TuneInternalsError` (one line) when one is
    missing; a logged warning when Ray's version is outside :data:`TESTED_RAY`. Checked once
    per process."""
    global _checked
    if _checked:
        return
    import ray
    missing = missing_internals()
    if missing:
        raise TuneInternalsError(f"Ray {ray.__version__} lacks Tune internals jabasray.tuner uses: "
                                 f"{', '.join(missing)}; install a Ray within "
                                 f"{TESTED_RAY[0]}..{TESTED_RAY[1]} (pyproject.toml)")
    warn = version_problem(ray.__version__)
    if warn:
        log.warning(warn)
    _checked = True


def sample_classes() -> SimpleNamespace:
    """Tune's domain classes: ``Domain, Categorical, Float, Integer, LogUniform``."""
    from ray.tune.search.sample import Categorical, Domain, Float, Integer, LogUniform
    return SimpleNamespace(Domain=Domain, Categorical=Categorical, Float=Float, Integer=Integer,
                           LogUniform=LogUniform)


def finishing_hyperband_class():
    """``HyperBandScheduler`` whose finished brackets never keep paused trials (why and how:
    :mod:`jabasray.tuner.schedulers`). Every private name it touches is listed in the module
    notes and checked by :func:`missing_internals`."""
    require()
    from ray.tune.schedulers import HyperBandScheduler

    class FinishingHyperBand(HyperBandScheduler):
        """``HyperBandScheduler`` whose finished brackets never keep paused trials."""

        _sweeping_off = 0          # > 0 while Tune's own bracket processing (or a sweep) runs

        def _process_bracket(self, tune_controller, bracket):
            self._sweeping_off += 1
            try:
                return super()._process_bracket(tune_controller, bracket)
            finally:
                self._sweeping_off -= 1

        def on_trial_remove(self, tune_controller, trial) -> None:
            bracket, _ = self._trial_info[trial]
            super().on_trial_remove(tune_controller, trial)
            if bracket.finished() and not self._sweeping_off:
                self._sweep(tune_controller, bracket, f"when trial {trial} ended")

        def choose_trial_to_run(self, tune_controller):
            if not self._sweeping_off:
                for band in self._hyperbands:
                    for bracket in band:
                        if bracket is not None and bracket.finished():
                            self._sweep(tune_controller, bracket, "after its last pause completed")
            return super().choose_trial_to_run(tune_controller)

        def _sweep(self, tune_controller, bracket, when: str) -> None:
            self._sweeping_off += 1
            try:
                _stop_paused(tune_controller, bracket, when)
            finally:
                self._sweeping_off -= 1

    return FinishingHyperBand


def _stop_paused(tune_controller, bracket, when: str) -> None:
    """``cleanup_full`` (stops the bracket's PAUSED trials), logged when it stops any."""
    paused = [t for t in bracket.current_trials() if t.status == t.PAUSED]
    if paused:
        log.info("HyperBand bracket finished %s: stopping %d paused trial(s) at max_t", when, len(paused))
        bracket.cleanup_full(tune_controller)


__all__ = ["TESTED_RAY", "TuneInternalsError", "version_problem", "missing_internals", "problems",
           "require", "sample_classes", "finishing_hyperband_class"]
