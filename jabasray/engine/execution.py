"""Which execution runs an IIDP step, and why: the one decision of the worker facade.

Four executions run a step on the same :class:`~jabasray.engine.state.StepState`:

* ``"graphed"`` (:class:`~jabasray.engine.graphs.GraphedExecution`): one CUDA device without a
  process group, the batched step captured as ONE CUDA graph and replayed;
* ``"segmented"`` (:class:`~jabasray.engine.segmented.SegmentedExecution`): a process group,
  the batched step split at bucket boundaries, the bucket all-reduces issued between the
  segments (CUDA: each segment a captured graph; CPU, ``segmented="on"``: the segments run
  eagerly in capture order);
* ``"batched"`` (:class:`~jabasray.engine.batched.BatchedExecution`): one eager pass of the
  main VSW per GA round over the VSWs' joined micro-batches, wherever that is exact;
* ``"per_vsw"`` (:class:`~jabasray.engine.per_vsw.PerVSWExecution`): every VSW on its replica.

:func:`choose_execution` picks one per step and says why the preferred ones were not taken
(the reasons of :func:`~jabasray.engine.batched.batch_fallback_reason` and
:func:`~jabasray.engine.graphs.worker_graph_blocker` /
:func:`~jabasray.engine.graphs.step_graph_blocker`). A graphed or segmented choice still runs
the batched step eagerly while its key warms up, or when the capture is refused (the
:class:`~jabasray.engine.graphs.GraphCache` decides per key), and a batched choice runs per
VSW when the micro-batches cannot be joined.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .batched import batch_fallback_reason
from . import graphs

EXECUTIONS = ("graphed", "segmented", "batched", "per_vsw")
SEGMENTED_MODES = ("auto", "on", "off")
# What a worker with a process group runs unless told: the eager step, until the segmented
# CUDA graphs have run on a GPU (tests/test_cuda.py and the GPU campaign's engine checks pass
# "auto" explicitly). On CPU the segments are proven equal to the eager step (float64, gloo);
# on CUDA they are written and tested but not yet run, and a silently wrong replay would cost
# a user more than the eager step's host work does.
SEGMENTED_DEFAULT = "off"


@dataclass(frozen=True)
class Choice:
    """``execution`` (one of :data:`EXECUTIONS`); ``graph_why``: why the step is not captured
    (``None`` for a graphed/segmented choice, or when graphs are off and nobody asked);
    ``batch_why``: why it does not run batched (``None`` when it does); ``capturable``: the
    worker captures steps (on CUDA), so every step, eager ones included, runs the optimizer
    in its capturable form (:func:`~jabasray.engine.graphs.make_capturable`)."""

    execution: str
    graph_why: str | None = None
    batch_why: str | None = None
    capturable: bool = False


def segmented_blocker(mode: str, graph_mode: str, device: torch.device, precision: str,
                      process_group: Any, hooks_enabled: bool, sync_timing: bool,
                      optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why a step with a process group is NOT run as segments, or ``None``.

    ``mode``: ``"auto"`` (CUDA graphs wherever a single-device step could be captured),
    ``"on"`` (also on CPU: the segments run eagerly, all-reduces between them), ``"off"``."""
    if process_group is None:
        return "no process group"
    if mode == "off":
        return "segmented='off' (bucket all-reduces issued by the communication thread)"
    if not hooks_enabled:
        return "bucket hooks are off (no bucket boundaries inside backward)"
    if torch.device(device).type != "cuda":
        if mode == "on":
            return "precision='fp16' (the GradScaler decides on the host)" if precision == "fp16" else None
        return f"device {device} is not CUDA"
    # the single-device blockers, without the two a segmented step lifts (the process group,
    # flat gradient buckets: the all-reduces run between the graphs, into the flat buckets)
    return graphs.worker_graph_blocker(graph_mode, device, precision, None, False, sync_timing, optimizer)


def choose_execution(*, num_vsw: int, ragged: bool, keep_local_grad: bool | str, per_sample_loss: bool,
                     coupling: Sequence[str], forced: str | None, graph_mode: str, segmented: str,
                     device: torch.device, precision: str, process_group: Any, flat_grads: bool,
                     hooks_enabled: bool, sync_timing: bool, optimizer: torch.optim.Optimizer | None,
                     graphs_disabled: str | None) -> Choice:
    """The execution of one step (module notes), with the reasons it is not a graph and not
    batched. Batched unless :func:`batch_fallback_reason` (or a ``"split"`` local gradient,
    which needs each VSW's own gradient) says otherwise; then, without a process group, a
    CUDA graph unless :func:`worker_graph_blocker` / :func:`step_graph_blocker` object; with
    one, segments unless :func:`segmented_blocker` / :func:`step_graph_blocker` object."""
    batch_why = batch_fallback_reason(num_vsw, ragged, per_sample_loss, coupling, forced)
    if keep_local_grad == "split":
        batch_why = "the similarity groups split the VSWs"
    eager = "batched" if batch_why is None else "per_vsw"
    step_why = graphs.step_graph_blocker(batch_why, ragged, keep_local_grad)
    cuda = torch.device(device).type == "cuda"
    if process_group is not None and (segmented == "on" or (segmented == "auto" and graph_mode != "off")):
        worker_why = segmented_blocker(segmented, graph_mode, device, precision, process_group,
                                       hooks_enabled, sync_timing, optimizer)
        capturable = worker_why is None and cuda
        why = worker_why or step_why or (graphs_disabled if cuda else None)
        if why is None:
            return Choice("segmented", capturable=capturable)
        return Choice(eager, why, batch_why, capturable)
    if graph_mode == "off":
        return Choice(eager, None, batch_why)
    worker_why = graphs.worker_graph_blocker(graph_mode, device, precision, process_group, flat_grads,
                                             sync_timing, optimizer)
    why = worker_why or step_why or graphs_disabled
    if why is None:
        return Choice("graphed", capturable=True)
    return Choice(eager, why, batch_why, worker_why is None)
