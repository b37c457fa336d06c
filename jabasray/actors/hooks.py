"""The user's job hooks beyond model/optimizer/loss, and the pre-flight probe that checks them.

:class:`JobHooks` is plain data handed to every GPU actor: how the actor builds and reads its
data (``dataset_fn``/``val_dataset_fn`` + DataLoader options), the training step, the
evaluation, the LR scheduler. The in-memory ``dataset=`` path needs none of it.

:func:`probe_job` runs ONCE before training, in a Ray task (so a ``dataset_fn``'s samples are
never read in the driver's process): it builds the datasets, reads one tiny batch, runs the
step (forward + backward on a fresh model) and the evaluation on it - and the step on 8 samples
and on their halves, to refuse a loss summed over samples that ``JobConfig.per_sample_loss``
does not declare (:func:`summed_loss`) - and returns plain numbers
- the dataset sizes the driver's plans need, the optimizer's LR - or a one-line error that
names the hook and what it returned. A probe costs one model build and one small batch; the
driver then never needs ``len(dataset)`` from anywhere else. With ``dataset_fn`` it also returns
the dataset's :func:`dataset_fingerprint` (length, first and last sample); every GPU actor
checks its own dataset against it (:func:`check_same_dataset`), so different files on different
nodes stop the run with one line naming the node instead of duplicating or missing samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import HookCall, HookError
from ..validation import check_choice, check_int

LR_SCHEDULER_INTERVALS = ("iteration", "epoch")
PROFILE_SAMPLES = 64       # rows the probe hands to the profiler (cycled to any batch size)
MEAN_CHECK_SAMPLES = 8     # samples of the probe's per-sample-mean check (two halves of 4)


@dataclass
class JobHooks:
    """User callables and data-loading options (all optional; defaults reproduce the plain
    supervised job). Callables must be picklable (cloudpickle): they run on the actors."""

    dataset_fn: Callable[[], Any] | None = None       # () -> map-style training Dataset, on each actor
    val_dataset_fn: Callable[[], Any] | None = None   # () -> validation Dataset, on each actor
    step_fn: Callable[[Any, Any], Any] | None = None  # (model, batch) -> scalar mean loss
    eval_fn: Callable[[Any, Any], dict] | None = None  # (model, batches) -> {name: mean value}
    lr_scheduler_fn: Callable[[Any], Any] | None = None  # optimizer -> torch LR scheduler
    lr_scheduler_interval: str = "iteration"          # scheduler.step() per "iteration" | "epoch"
    collate_fn: Callable[[list], Any] | None = None   # DataLoader collate (None: default_collate)
    num_data_workers: int = 0                         # DataLoader worker processes per actor
    prefetch_factor: int = 2                          # batches each DataLoader worker loads ahead
    eval_batch_size: int = 256                        # validation batch size
    log_level: str = "WARNING"                        # actors' jabasray log level ("INFO" with -v)
    dataset_fingerprint: dict | None = None           # the probe's dataset_fingerprint of dataset_fn's
                                                      # dataset; every actor's must equal it (set by fit)
    actor_class: Any = None                           # the GPU actor class the driver places (None:
                                                      # GPUActor; jabasray.train's for a user's loop)

    def __post_init__(self) -> None:
        for name in ("dataset_fn", "val_dataset_fn", "step_fn", "eval_fn", "lr_scheduler_fn",
                     "collate_fn"):
            f = getattr(self, name)
            if f is not None and not callable(f):
                raise ValueError(f"{name} must be callable or None, got {f!r}")
        check_choice("lr_scheduler_interval", self.lr_scheduler_interval, LR_SCHEDULER_INTERVALS)
        check_int("num_data_workers", self.num_data_workers, min_value=0)
        check_int("prefetch_factor", self.prefetch_factor, min_value=1)
        check_int("eval_batch_size", self.eval_batch_size, min_value=1)
        check_choice("log_level", self.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))


HOOK_NAMES = ("dataset_fn", "val_dataset_fn", "step_fn", "eval_fn", "lr_scheduler_fn", "collate_fn")


def named(name: str, fn: Callable | None) -> Callable | None:
    """``fn`` as a :class:`HookCall` named ``name`` (None stays None; idempotent)."""
    if fn is None or isinstance(fn, HookCall):
        return fn
    return HookCall(name, fn)


def named_hooks(hooks: "JobHooks") -> "JobHooks":
    """``hooks`` with every callable a :class:`HookCall` of its field name."""
    from dataclasses import replace
    return replace(hooks, **{n: named(n, getattr(hooks, n)) for n in HOOK_NAMES})


def refuse_module_classes(**fns: Any) -> None:
    """A ``torch.nn.Module`` class passed where a callable is expected (``loss_fn=nn.CrossEntropyLoss``
    instead of ``nn.CrossEntropyLoss()``) is a one-line ValueError naming the argument: called
    with (outputs, targets) the class would build a module from them and fail obscurely."""
    import torch

    for name, fn in fns.items():
        if isinstance(fn, type) and issubclass(fn, torch.nn.Module):
            raise ValueError(f"{name} must be a callable such as a module instance, got the class "
                             f"{fn.__module__}.{fn.__qualname__}; pass an instance: {name}={fn.__name__}()")


@dataclass
class ProbeReport:
    """What :func:`probe_job` found (plain data)."""

    dataset_size: int
    val_size: int | None
    optimizer_lr: float           # param_groups[0]["lr"] of the user's optimizer, as built
    error: str | None = None      # one line; the driver raises ValueError(error)
    profile_rows: Any = None      # up to PROFILE_SAMPLES training rows (TensorDataset) or None
    fingerprint: dict | None = None  # dataset_fingerprint of the training set (dataset_fn only)
    hook_error: HookError | None = None  # the hook's error (with its traceback text) behind ``error``
    model: dict | None = None     # job_identity.model_signature of model_fn()'s module
    optimizer: dict | None = None  # job_identity.optimizer_identity of the optimizer, as built


def build_dataset(dataset_fn: Callable[[], Any], hook: str = "dataset_fn") -> Any:
    """``dataset_fn()``, checked: a non-empty map-style dataset, else a one-line ValueError
    naming ``hook`` and what it returned."""
    ds = dataset_fn()
    _check_dataset(ds, hook)
    return ds


def build_datasets(hooks: JobHooks, dataset: Any, val_dataset: Any) -> tuple[Any, Any]:
    """(train, val) on this process: the in-memory ones, or built by the hooks (checked)."""
    if hooks.dataset_fn is not None:
        train = build_dataset(hooks.dataset_fn, "dataset_fn")
    else:
        train = dataset
        _check_dataset(train, "dataset")
    if hooks.val_dataset_fn is not None:
        return train, build_dataset(hooks.val_dataset_fn, "val_dataset_fn")
    if val_dataset is not None:
        _check_dataset(val_dataset, "val_dataset")
    return train, val_dataset


def dataset_fingerprint(ds: Any) -> dict:
    """A cheap identity of a map-style dataset: its length and a SHA-256 of its first and of its
    last sample (:func:`sample_digest`). Two actors whose datasets differ in length, order or
    content at either end get different fingerprints; reading two samples costs what serving
    two samples costs."""
    n = len(ds)
    return {"len": n, "first": sample_digest(ds[0]), "last": sample_digest(ds[n - 1])}


def sample_digest(sample: Any) -> str:
    """SHA-256 (hex, 16 digits) of one sample: tensors and arrays by dtype, shape and bytes,
    numbers and strings by value, sequences and dicts element by element, images (objects with
    ``__array_interface__``) by their pixels; any other object by its type only (nothing else
    about it is stable across processes)."""
    import hashlib

    h = hashlib.sha256()
    _digest_into(h, sample)
    return h.hexdigest()[:16]


def _digest_into(h: Any, x: Any) -> None:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(x, np.ndarray) or hasattr(x, "__array_interface__"):
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"A{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes() if a.dtype != object else repr(a.tolist()).encode())
    elif isinstance(x, (bool, int, float, complex, str, bytes, type(None), np.generic)):
        h.update(f"S{type(x).__name__}:{x!r}".encode())
    elif isinstance(x, (list, tuple)):
        h.update(f"L{len(x)}".encode())
        for v in x:
            _digest_into(h, v)
    elif isinstance(x, dict):
        h.update(f"D{len(x)}".encode())
        for k in sorted(x, key=repr):
            h.update(repr(k).encode())
            _digest_into(h, x[k])
    else:
        h.update(f"O{type(x).__module__}.{type(x).__qualname__}".encode())


def check_same_dataset(ds: Any, expected: dict | None) -> str | None:
    """None when ``ds`` has the fingerprint ``expected`` (or nothing is expected), else one line
    naming this node and what differs (the caller raises it when the actor is set up)."""
    if expected is None:
        return None
    got = dataset_fingerprint(ds)
    if got == expected:
        return None
    if got["len"] != expected["len"]:
        what = f"{got['len']} samples, the probe's {expected['len']}"
    else:
        ends = [e for e in ("first", "last") if got[e] != expected[e]]
        what = f"its {' and '.join(ends)} sample{'s differ' if len(ends) > 1 else ' differs'} from the probe's"
    return (f"dataset_fn built a different dataset on node {_node_label()} than the probe did "
            f"({what}); every GPU actor must see the same dataset: the same files on every node "
            f"(a shared or cloud path) in the same order")


def _node_label() -> str:
    try:
        import ray
        ctx = ray.get_runtime_context()
        return f"{ray.util.get_node_ip_address()} ({ctx.get_node_id()[:12]})"
    except Exception:  # noqa: BLE001 - outside Ray
        import socket
        return socket.gethostname()


def _check_dataset(ds: Any, hook: str) -> None:
    from ..engine.step import _short
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise ValueError(f"{hook} must return a map-style Dataset (with __len__ and __getitem__), "
                         f"got {type(ds).__name__}: {_short(ds)}")
    if len(ds) < 1:
        raise ValueError(f"{hook} returned an empty dataset (len 0)")


def probe_job(model_fn: Callable, optimizer_fn: Callable, loss_fn: Callable | None,
              hooks: JobHooks, dataset: Any = None, val_dataset: Any = None,
              precision: str = "fp32", want_profile_rows: bool = False,
              per_sample_loss: bool = True) -> ProbeReport:
    """Build what each actor will build and run every hook once on a 2-sample batch (module
    notes); with ``per_sample_loss`` (``JobConfig.per_sample_loss``) also check that the loss
    is not a sum over samples (:func:`summed_loss`). Never raises for a bad hook: the error
    comes back as ``ProbeReport.error``."""
    import torch

    from ..engine.loader import batch_size, split_batch
    from ..engine.step import autocast, check_loss, check_metrics, split_step_output, supervised_step
    from ..engine.evaluation import default_eval_fn

    hooks, loss_fn = named_hooks(hooks), named("loss_fn", loss_fn)
    model_fn, optimizer_fn = named("model_fn", model_fn), named("optimizer_fn", optimizer_fn)
    try:
        train, val = build_datasets(hooks, dataset, val_dataset)
        data_hook = "dataset_fn" if hooks.dataset_fn is not None else "dataset"
        rows = batch_rows(train, min(2, len(train)), hooks.collate_fn, data_hook)
        model = model_fn()
        opt = optimizer_fn([p for p in model.parameters() if p.requires_grad])
        lr = float(opt.param_groups[0]["lr"])
        if hooks.lr_scheduler_fn is not None:
            sched = hooks.lr_scheduler_fn(opt)
            if not (hasattr(sched, "step") and hasattr(sched, "state_dict")):
                raise ValueError(f"lr_scheduler_fn must return a torch LR scheduler (with step() "
                                 f"and state_dict()), got {type(sched).__name__}")
        step = hooks.step_fn or supervised_step(loss_fn)
        hook = "step_fn" if hooks.step_fn is not None else "loss_fn"
        device = torch.device("cpu")
        with autocast(device, precision):
            loss = check_loss(split_step_output(step(model, rows), hook)[0], hook)
        loss.backward()
        k = min(MEAN_CHECK_SAMPLES, len(train)) // 2 * 2
        if per_sample_loss and k >= 4:       # halves of 2 at least (BatchNorm needs 2 in training)
            batch = batch_rows(train, k, hooks.collate_fn, data_hook)
            with torch.no_grad(), autocast(device, precision):
                losses = [float(split_step_output(step(model, b), hook)[0])
                          for b in [batch, *split_batch(batch, [k // 2, k // 2])]]
            if summed_loss(*losses):
                raise ValueError(f"per_sample_loss: the training loss is a sum over the batch's "
                                 f"samples, not a per-sample mean (loss of {k} samples "
                                 f"{losses[0]:.6g} = loss of its halves {losses[1]:.6g} + "
                                 f"{losses[2]:.6g}); declare JobConfig(per_sample_loss=False) or "
                                 f"return the mean")
        if val is not None:
            vrows = batch_rows(val, min(2, len(val)), hooks.collate_fn,
                               "val_dataset_fn" if hooks.val_dataset_fn is not None else "val_dataset")
            eval_fn = hooks.eval_fn or default_eval_fn(loss_fn)
            model.eval()
            with torch.no_grad(), autocast(device, precision):
                check_metrics(eval_fn(model, iter(split_batch(vrows, [batch_size(vrows)]))),
                              "eval_fn" if hooks.eval_fn is not None else "the default eval_fn")
        profile_rows = None
        if want_profile_rows:
            profile_rows = _profile_rows(train, hooks.collate_fn, hooks.step_fn, data_hook)
        from .job_identity import model_signature, optimizer_identity
        return ProbeReport(len(train), len(val) if val is not None else None, lr,
                           profile_rows=profile_rows, model=model_signature(model),
                           optimizer=optimizer_identity(opt),
                           fingerprint=dataset_fingerprint(train) if hooks.dataset_fn is not None else None)
    except Exception as e:  # noqa: BLE001 - reported as one line to the driver
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not isinstance(e, ValueError):
            msg = f"{type(e).__name__}: {msg}"
        return ProbeReport(0, None, 0.0, error=msg, hook_error=e if isinstance(e, HookError) else None)


def summed_loss(whole: float, half1: float, half2: float) -> bool:
    """Whether a step's losses on a batch and on its two equal halves say SUM over samples
    rather than per-sample mean: a mean gives ``whole = (half1 + half2) / 2``, a sum (or a sum
    over a fixed normaliser) ``whole = half1 + half2``. True only when ``whole`` is within 10 %
    of the sum and the two predictions are clearly apart (not ~0), so that batch-coupled
    modules (BatchNorm) or dropout, which move a mean a little, never make a mean look summed;
    a per-token or other batch-dependent normaliser may pass unnoticed (it must be declared)."""
    as_sum, as_mean = half1 + half2, (half1 + half2) / 2
    if not all(map(math.isfinite, (whole, as_sum))):
        return False
    return abs(whole - as_sum) <= 0.1 * abs(as_sum) and abs(as_sum - as_mean) >= 0.25 * abs(as_sum) > 0


def batch_rows(ds: Any, k: int, collate_fn: Callable | None, hook: str) -> Any:
    """The first ``k`` samples of ``ds`` as one batch, batched as training and the profiler
    batch them (:func:`jabasray.engine.loader.gather_rows`, which the profiler's batches go
    through too). Samples that torch's ``default_collate`` cannot batch (no ``collate_fn``)
    are a one-line ValueError naming ``hook``, the dataset's source; a ``collate_fn`` that
    raises is a :class:`HookError` naming ``collate_fn``."""
    from torch.utils.data import TensorDataset

    from ..engine.loader import gather_rows

    try:
        return gather_rows(ds, list(range(k)), collate_fn)
    except HookError:
        raise
    except Exception as e:  # noqa: BLE001 - default_collate's error, explained in one line
        if collate_fn is not None or isinstance(ds, TensorDataset):
            raise
        try:                    # the samples read: the error was batching them
            [ds[i] for i in range(k)]
        except Exception:       # noqa: BLE001 - reading failed: that error, as it was
            raise e from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        cause = f"{type(e).__name__}: {first}" if first else type(e).__name__
        if len(cause) > 200:
            cause = cause[:197] + "..."
        raise ValueError(f"{hook}: samples cannot be batched by torch's default_collate ({cause}); "
                         f"pass collate_fn=... (a list of samples -> one batch)") from e


def _profile_rows(train: Any, collate_fn: Callable | None, step_fn: Callable | None = None,
                  hook: str = "dataset") -> Any:
    """Up to PROFILE_SAMPLES training rows for the profiler: (inputs, targets) rows batched by
    ``default_collate`` as a TensorDataset (the profiler cycles them); with a ``collate_fn``
    whose batches are (inputs, targets), or with a ``step_fn``, a list of samples (the profiler
    batches them as training does: ``collate_fn``, else ``default_collate``, and runs the step
    on them); None when neither applies. The rows are batched here first (:func:`batch_rows`):
    samples the profiler could not batch are refused now, in one line naming ``hook``."""
    import torch

    k = min(PROFILE_SAMPLES, len(train))
    rows = batch_rows(train, k, collate_fn, hook)
    pair = (isinstance(rows, (list, tuple)) and len(rows) == 2
            and all(isinstance(t, torch.Tensor) for t in rows))
    if pair and collate_fn is None:
        return torch.utils.data.TensorDataset(*rows)
    if pair or step_fn is not None:
        return [train[i] for i in range(k)]
    return None


def run_probe(model_fn: Callable, optimizer_fn: Callable, loss_fn: Callable | None,
              hooks: JobHooks, dataset: Any = None, val_dataset: Any = None,
              precision: str = "fp32", want_profile_rows: bool = False,
              per_sample_loss: bool = True) -> ProbeReport:
    """:func:`probe_job` in a Ray task (no GPU, a small CPU share) when the job builds its data
    with ``dataset_fn``/``val_dataset_fn``; in this process otherwise (the in-memory datasets
    are here anyway). Raises the probe's one-line ValueError (a :class:`HookError`, with the
    hook's original traceback as text, when a hook raised)."""
    if hooks.dataset_fn is not None or hooks.val_dataset_fn is not None:
        import ray
        task = ray.remote(num_cpus=0.01, max_retries=0)(probe_job)
        report = ray.get(task.remote(model_fn, optimizer_fn, loss_fn, hooks, dataset, val_dataset,
                                     precision, want_profile_rows, per_sample_loss))
    else:
        report = probe_job(model_fn, optimizer_fn, loss_fn, hooks, dataset, val_dataset,
                           precision, want_profile_rows, per_sample_loss)
    if report.hook_error is not None:
        raise report.hook_error
    if report.error:
        raise ValueError(report.error)
    return report
