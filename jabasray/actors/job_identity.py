"""The identity of a training job, recorded in its run folder so that a run is never confused
with another (``<run>/job.json``).

A run folder holds the checkpoints and metrics of ONE job. :func:`job_identity` describes that
job in plain JSON:

* ``job_config``: ``JobConfig.to_dict()`` (``epochs`` is not part of the identity: raising it
  continues a run);
* ``model``: the class of ``model_fn()``'s module and every state tensor's name, shape and dtype
  (:func:`model_signature`);
* ``optimizer``: the optimizer's class and its param groups' hyper-parameters without the
  parameters (``lr``, ``momentum``, ``weight_decay`` ...; :func:`optimizer_identity`);
* ``hooks``: the identity of every user callable (``model_fn``, ``optimizer_fn``, ``loss_fn``,
  ``step_fn``, ``eval_fn``, ``lr_scheduler_fn``, ``collate_fn``, ``dataset_fn``,
  ``val_dataset_fn``): ``module.qualname`` of a function or class, ``module.Class()`` of a
  callable instance (:func:`callable_identity`);
* ``dataset_size``: the training set's length.

``JabasTrainer.fit()`` writes it into a new run folder before the driver starts and compares
it with the recorded one when the folder already holds a checkpoint: :func:`differences` lists
every differing field (``job_config.alpha: 0.25 -> 0.5``); any difference refuses the resume
unless ``RunConfig(resume="force")`` asks for it (the record is then rewritten).
"""
from __future__ import annotations

import datetime
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..config import JobConfig, changed_job_fields
from ..errors import HookCall
from ..storage import StoragePath, as_storage_path, explain

log = logging.getLogger(__name__)

JOB_FILE = "job.json"
FORMAT = 1
HOOK_NAMES = ("model_fn", "optimizer_fn", "loss_fn", "step_fn", "eval_fn", "lr_scheduler_fn",
              "collate_fn", "dataset_fn", "val_dataset_fn")
IGNORED_JOB_FIELDS = ("epochs",)   # raising epochs continues a run


def _plain(value: Any) -> Any:
    """JSON-safe copy: numbers, strings, bools, None, lists and dicts; anything else as repr-less
    type name (tensors: their shape), so the identity never depends on an object's address."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return {"tensor": list(getattr(value, "shape")), "dtype": str(value.dtype)}
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return type(value).__qualname__


def callable_identity(fn: Callable | None) -> str | None:
    """``module.qualname`` of a function or class; ``module.Class()`` of a callable instance;
    ``functools.partial(inner, args...)`` of a partial; None for None."""
    if fn is None:
        return None
    if isinstance(fn, HookCall):   # named for its errors: the user's callable is the identity
        fn = fn.fn
    if isinstance(fn, functools.partial):
        args = ", ".join([*map(repr, map(_plain, fn.args)),
                          *(f"{k}={_plain(v)!r}" for k, v in sorted(fn.keywords.items()))])
        return f"functools.partial({callable_identity(fn.func)}, {args})"
    if hasattr(fn, "__qualname__") and hasattr(fn, "__module__"):
        return f"{fn.__module__}.{fn.__qualname__}"
    cls = type(fn)
    return f"{cls.__module__}.{cls.__qualname__}()"


def model_signature(model: Any) -> dict:
    """``{"class": module.qualname, "tensors": [[name, shape, dtype], ...]}`` of a torch module's
    state dict (parameters and buffers, in state-dict order)."""
    cls = type(model)
    tensors = [[name, list(t.shape), str(t.dtype).replace("torch.", "")]
               for name, t in model.state_dict().items()]
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "tensors": tensors}


def optimizer_identity(optimizer: Any) -> dict:
    """``{"class": ..., "param_groups": [{hyper-parameter: value}, ...]}`` (no parameters)."""
    cls = type(optimizer)
    groups = [{k: _plain(v) for k, v in sorted(g.items()) if k != "params"}
              for g in optimizer.param_groups]
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "param_groups": groups}


def job_identity(job_config: Any, model: Mapping, optimizer: Mapping, hooks: Mapping[str, Any],
                 dataset_size: int) -> dict:
    """The identity record (module notes): ``job_config`` a JobConfig, ``model`` and
    ``optimizer`` from :func:`model_signature` / :func:`optimizer_identity`, ``hooks`` the
    user's callables by name."""
    return {"job_config": job_config.to_dict(), "model": dict(model), "optimizer": dict(optimizer),
            "hooks": {k: callable_identity(hooks.get(k)) for k in HOOK_NAMES},
            "dataset_size": int(dataset_size)}


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _model_difference(old: Mapping, new: Mapping) -> str | None:
    if old.get("class") != new.get("class"):
        return f"model: class {old.get('class')} -> {new.get('class')}"
    a = {n: (s, d) for n, s, d in old.get("tensors", [])}
    b = {n: (s, d) for n, s, d in new.get("tensors", [])}
    for name in [*a, *(n for n in b if n not in a)]:
        if name not in b:
            return f"model: tensor {name} {a[name][0]} is gone"
        if name not in a:
            return f"model: new tensor {name} {b[name][0]}"
        if a[name] != b[name]:
            (s0, d0), (s1, d1) = a[name], b[name]
            return f"model: {name} {s0} {d0} -> {s1} {d1}"
    return None


def differences(old: Mapping, new: Mapping) -> list[str]:
    """Every field in which identity ``new`` differs from the recorded ``old``, one short
    ``field: old -> new`` text each (``job_config.<field>``, ``model``, ``optimizer.<key>``,
    ``hooks.<name>``, ``dataset_size``); empty when they match."""
    out: list[str] = []
    oj, nj = dict(old.get("job_config", {})), dict(new.get("job_config", {}))
    defaults = JobConfig().to_dict()
    for k in changed_job_fields(oj, nj, ignore=IGNORED_JOB_FIELDS):
        out.append(f"job_config.{k}: {_short(oj.get(k, defaults[k]))} -> {_short(nj.get(k))}")
    model = _model_difference(old.get("model", {}), new.get("model", {}))
    if model:
        out.append(model)
    oo, no = old.get("optimizer", {}), new.get("optimizer", {})
    if oo.get("class") != no.get("class"):
        out.append(f"optimizer: {oo.get('class')} -> {no.get('class')}")
    else:
        og, ng = oo.get("param_groups", []), no.get("param_groups", [])
        if len(og) != len(ng):
            out.append(f"optimizer.param_groups: {len(og)} groups -> {len(ng)}")
        for i, (a, b) in enumerate(zip(og, ng)):
            where = "optimizer" if len(og) == 1 else f"optimizer.param_groups[{i}]"
            for k in sorted(set(a) | set(b)):
                if a.get(k) != b.get(k):
                    out.append(f"{where}.{k}: {_short(a.get(k))} -> {_short(b.get(k))}")
    oh, nh = old.get("hooks", {}), new.get("hooks", {})
    for k in HOOK_NAMES:
        if oh.get(k) != nh.get(k):
            out.append(f"hooks.{k}: {oh.get(k)} -> {nh.get(k)}")
    if old.get("dataset_size") != new.get("dataset_size"):
        out.append(f"dataset_size: {old.get('dataset_size')} -> {new.get('dataset_size')}")
    return out


def read_identity(run_dir: "str | StoragePath") -> dict | None:
    """The identity recorded in ``<run>/job.json``; None when there is none. A file that is not
    an identity record is a one-line ValueError naming it."""
    p = as_storage_path(run_dir) / JOB_FILE
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise ValueError(f"{p} is not a jabasray job record (not JSON); remove it or choose "
                         f"another run name") from None
    if not isinstance(data, dict) or not isinstance(data.get("identity"), dict):
        raise ValueError(f"{p} is not a jabasray job record (no 'identity' object); remove it "
                         f"or choose another run name")
    return data["identity"]


def write_identity(run_dir: "str | StoragePath", identity: Mapping, run_name: str) -> None:
    """Write ``<run>/job.json`` (one PUT on an object store)."""
    record = {"format": FORMAT, "run": run_name,
              "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "identity": dict(identity)}
    (as_storage_path(run_dir) / JOB_FILE).write_text(json.dumps(record, indent=1))


@dataclass
class RunStart:
    """How ``fit()`` starts on a run folder (:func:`check_run`)."""

    kind: str                      # "new" | "resume" | "finished"
    checkpoint: Any = None         # the newest intact checkpoint (resume, finished)
    message: str | None = None     # the console line ("finished": it returns the old result)


def check_run(run_dir: "str | StoragePath", identity: Mapping, run_name: str, resume: str,
              epochs: int) -> RunStart:
    """Decide how run ``run_name`` starts in ``run_dir`` with the job ``identity`` (module
    notes), before any actor starts:

    * no intact checkpoint: a new run; ``job.json`` is (re)written;
    * a checkpoint and a recorded identity that differs: one-line ``ValueError`` naming every
      differing field, unless ``resume == "force"`` (then a warning and the record rewritten);
    * a checkpoint without a record (a folder of an older jabasray): resumed, record written;
    * a checkpoint of ``epochs`` or more epochs and ``metrics.json``: "finished" (fit returns
      the run's result and says so);
    * else "resume".
    """
    from ..config import RESUME_MODES
    from ..validation import check_choice
    from .checkpoint import latest_checkpoint

    check_choice("resume", resume, RESUME_MODES)
    run = as_storage_path(run_dir)
    skipped: list[str] = []       # the driver reports them when it resumes
    try:
        cp = latest_checkpoint(run, skipped)
    except OSError as e:
        raise ValueError(f"storage_path {run.parent} is not reachable: {explain(e)}") from None
    if cp is None:
        write_identity(run, identity, run_name)
        return RunStart("new")
    old = read_identity(run)
    if old is None:
        log.warning("run %s has no %s (written by an older jabasray): resuming it without the "
                    "job check; recording this job", run, JOB_FILE)
        write_identity(run, identity, run_name)
    else:
        diff = differences(old, identity)
        if diff and resume != "force":
            raise ValueError(
                f"name: run {run} holds another job's checkpoints ({'; '.join(diff)}); leave "
                f"RunConfig.name unset for a new run (or choose another name), or pass "
                f"RunConfig(resume='force') (`jabasray train --resume force`) to resume it with "
                f"this job")
        if diff:
            log.warning("run %s: resuming with a changed job (resume='force'): %s", run,
                        "; ".join(diff))
            write_identity(run, identity, run_name)
    if cp.epochs_done >= epochs and (run / "metrics.json").exists():
        return RunStart("finished", cp,
                        f"run {run} already finished ({cp.epochs_done} epoch(s) of this job); "
                        f"returning its result - raise JobConfig.epochs to train on, or leave "
                        f"RunConfig.name unset for a new run")
    return RunStart("resume", cp)


__all__ = ["JOB_FILE", "RunStart", "check_run", "callable_identity", "model_signature", "optimizer_identity",
           "job_identity", "differences", "read_identity", "write_identity"]
