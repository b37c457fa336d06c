"""Packed training inside Ray Tune's own API (Pack paper, sections 2.2, 3 and 5).

    trainable = jabasray.tuner.packed(spec, max_units=27, param_space=space)  # a Tune trainable
    tuner = tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(scheduler=ASHAScheduler(max_t=27), num_samples=64,
                                    metric="accuracy", mode="max",
                                    search_alg=SimilaritySearch(group_size=8, trainable=trainable),
                                    max_concurrent_trials=64),
        run_config=tune.RunConfig(...))

Implementation notes
--------------------
* :func:`packed` returns a class ``Trainable`` (with its resources): every configuration is
  its own Tune trial; ``step()`` is one resource unit (``training_iteration`` = units
  trained), ``save_checkpoint`` writes the member's own ``state_dict``s (``member.pt``) and
  runs only when Tune asks -- a pause, ``CheckpointConfig(checkpoint_frequency=...)``,
  ``checkpoint_at_end`` --, ``load_checkpoint`` resumes from it. Schedulers, ``stop``,
  callbacks, ``CheckpointConfig``, ``FailureConfig``, ``Tuner.restore``, progress.csv and the
  ``ResultGrid`` therefore work as with any class trainable.
* The training itself happens in the device's packing coordinator
  (:mod:`jabasray.tuner.coordinator`): the trial registers its config at its first step
  (Pack's ``load``), asks for one unit per ``step()``, and leaves (Pack's ``free``) in
  ``cleanup`` -- Tune stops the trial's actor when it stops, pauses or finishes it -- or in
  ``reset_config`` when Tune reuses the actor for another trial (``reuse_actors=True``).
  The coordinator trains a unit ahead of Tune; the state Tune asks for is that of the last
  unit the trial reported (the coordinator keeps it while a unit runs ahead).
* A trial reserves ``1 / members_per_device`` of a device (CPU or GPU): Tune's resource
  accounting then admits ``members_per_device`` trials per device, the coordinator trains them
  as one packed model, and the trial processes themselves only wait (they never import torch).
* Where packing does not pay (the cost model's decision, or ``pack=False``) :func:`packed`
  returns Tune's own trainable of the spec instead (:func:`~jabasray.tuner.make_trainable`,
  one CPU or one GPU per trial): such a sweep IS Tune's own sweep, so it cannot be slower.
  On a CPU node the coordinator is chosen among the node's devices by affinity (free slots,
  then the smallest normalised distance to its members); on a GPU, Ray's GPU assignment picks it.
* A spec whose model cannot be stacked (buffers such as BatchNorm statistics, dropout) trains
  as a plain trial in the trial process; the reason is logged.
* :class:`SimilaritySearch` samples the param space (any Tune domain) in batches and emits each
  batch in kNN order (similar configurations one after another), so the trials that arrive
  together -- and share a pack -- are similar (Pack 5.3). :class:`PackedHyperband` is Hyperband
  with that search order per bracket (Pack 5.2: ``pack_opt(T)`` of every bracket's sample) on
  Tune's ``HyperBandScheduler``; paused survivors of a rung re-join packs when resumed. Given
  the sweep's trainable, both keep the sampled order where every trial trains alone.
"""
from __future__ import annotations

import logging
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from jabasray.planners.pack_opt import NormalisedSpace, similarity_order
from jabasray.tuner.brackets import hyperband_schedule, tune_hyperband_schedule
from jabasray.tuner.pack_size import choose_members_per_device
from jabasray.tuner.space import largest_value, normalised_space
from jabasray.validation import check_choice, check_float, check_int

log = logging.getLogger(__name__)

__all__ = ["PackedJob", "packed", "trains_alone", "SimilaritySearch", "PackedHyperband", "coordinator_stats",
           "COORDINATOR_NAMESPACE"]

COORDINATOR_NAMESPACE = "jabasray"
CHECKPOINT_FILE = "member.pt"


@dataclass
class PackedJob:
    """What every packed trial of one sweep carries (plain data; the spec stays pickled)."""
    spec_blob: bytes                    # cloudpickled TrainingSpec (unpickled only where torch runs)
    stream_batch: int                   # shared-stream chunk: the largest batch size of the space
    max_units: int                      # units after which a trial ends on its own
    members_per_device: int             # trials packed into one model per device
    checkpoint_every: int               # a unit carries the state every this many units (0: only the last)
    cpus_per_device: float              # CPUs of one CPU "device" (its trials reserve them)
    gpu: bool                           # spec.device is CUDA: one coordinator per GPU
    space: NormalisedSpace | None       # distances for the choice of a device
    wait_s: float                       # barrier: longest wait for a member to claim its unit
    idle_exit_s: float                  # a coordinator with no member exits after this
    token: str                          # names this sweep's coordinators
    run_ahead: bool = True              # units start before the trials ask (coordinator.py)
    trials_per_device: int = 0          # trials admitted per device (0: members_per_device)
    threads: int = 1                    # torch threads of a CPU device's coordinator
    decision: dict | None = None        # PackDecision (as a dict) the sweep was built from


def checkpoint_due(unit: int, max_units: int | None, every: int) -> bool:
    """A packed trial checkpoints after ``unit``: every ``every`` units (0: never) and after
    its last one (``max_units``)."""
    return unit == max_units or bool(every and unit % every == 0)


def packed(spec: Any, *, max_units: int, param_space: Mapping[str, Any] | None = None,
           stream_batch: int | None = None, members_per_device: int | None = None,
           cpus_per_device: float = 1.0, wait_s: float = 2.0,
           idle_exit_s: float = 60.0, run_ahead: bool = True, trials_per_device: int | None = None,
           threads: int | None = None, pack: bool | str = "auto", num_samples: int | None = None,
           reduction_factor: int = 3, costs: Any = None, cache_dir: str | None = None):
    """A Tune trainable whose trials train packed per device (see the module docstring).

    Args:
        spec: :class:`~jabasray.tuner.training.TrainingSpec` -- how ONE configuration trains.
        max_units: resource units after which a trial ends (the scheduler may stop it earlier).
        param_space: the Tuner's param space: distances for packing (any domain) and the
            largest batch size (the shared stream's chunk).
        stream_batch: the chunk, if ``param_space`` does not bound the batch size.
        members_per_device: trials trained as one packed model per device; each trial
            reserves ``1 / members_per_device`` of a device. None (default): on a GPU as many
            as fit its memory (:mod:`jabasray.tuner.pack_size`: the space's largest
            configuration measured on one GPU in a Ray task, or ``spec.memory_fn``), on CPU 8.
        cpus_per_device: CPUs of one device on CPU nodes: a node with C CPUs has
            ``C // cpus_per_device`` devices (coordinators); its trials reserve them.
        threads: torch threads of a CPU device's coordinator (default ``cpus_per_device``).
            A packed step of small models is a stream of small ops that more threads slow
            down; ``threads=1`` with ``cpus_per_device=2`` then leaves the second CPU to the
            trial processes and Tune.
        wait_s: the longest a unit waits for a registered trial that has not claimed its
            previous unit (the trial is then set aside with its state and re-joins when it
            asks). Units run one ahead of Tune: see :mod:`jabasray.tuner.coordinator`.
        idle_exit_s: seconds a coordinator without members lives on.
        run_ahead: train every member's next unit while Tune still processes its previous
            report (default) -- except past the unit counts at which the scheduler has been
            seen to stop or pause trials, so a stopped trial rarely costs a discarded unit;
            False: a unit waits until every member's trial asked for it.
        trials_per_device: trials Tune runs per device (each reserves ``1 / trials_per_device``
            of it; default ``members_per_device``). More than ``members_per_device`` admits
            more trials than slots: the extra ones start (actor, data) and wait in the
            coordinator's queue, and are seated -- built off the training thread -- as soon as
            a member leaves, instead of Tune starting them only then.
        pack: ``"auto"`` (default): pack only where it pays -- the cost model of
            :mod:`jabasray.planners.pack_cost`, from costs measured on this machine
            (:mod:`jabasray.tuner.pack_profile`, cached), decides whether to pack, how many
            members per device (at most ``members_per_device`` when given) and so how many
            trials run at once; when packing does not pay every trial trains alone in its own
            trial process (1 CPU, or 1 GPU, per trial): the trainable returned is then Tune's
            own trainable of the spec (:func:`~jabasray.tuner.make_trainable`).
            ``True``: always pack (``members_per_device`` as given, or from memory);
            ``False``: never. The decision and its reason are logged once and reported by
            :func:`coordinator_stats`.
        num_samples: trials the sweep runs (for the cost model; default one Hyperband
            iteration's sample for ``R = max_units``); ``reduction_factor``: the scheduler's eta
            (the model assumes successive halving: :func:`~jabasray.planners.pack_cost.halving_units`).
        costs: a :class:`~jabasray.planners.pack_cost.PackCosts` to decide from instead of
            measuring; ``cache_dir``: where measured costs are cached (default
            :func:`~jabasray.tuner.pack_profile.default_cache_dir`).
    """
    import cloudpickle
    from ray import tune

    from jabasray.tuner.training import TrainingSpec

    if not isinstance(spec, TrainingSpec):
        raise ValueError(f"spec must be a jabasray.tuner.TrainingSpec, got {type(spec).__name__}")
    check_int("max_units", max_units, min_value=1)
    check_float("cpus_per_device", cpus_per_device, min_value=0.0, min_exclusive=True)
    check_float("wait_s", wait_s, min_value=0.0)
    check_float("idle_exit_s", idle_exit_s, min_value=0.0, min_exclusive=True)
    if members_per_device is not None:
        check_int("members_per_device", members_per_device, min_value=1)
    if trials_per_device is not None:
        check_int("trials_per_device", trials_per_device, min_value=members_per_device or 1)
    if threads is not None:
        check_int("threads", threads, min_value=1)
    if stream_batch is None:
        if param_space is None or not isinstance(spec.batch_size, str):
            raise ValueError("stream_batch must be given when param_space does not hold the "
                             "batch-size key (the largest batch size of the search space)")
        stream_batch = largest_value(param_space, spec.batch_size)
    check_int("stream_batch", stream_batch, min_value=1)
    check_choice("pack", pack, (True, False, "auto"))
    if num_samples is not None:
        check_int("num_samples", num_samples, min_value=1)
    check_int("reduction_factor", reduction_factor, min_value=2)
    if pack == "auto" and costs is None and param_space is None:
        raise ValueError("param_space must be given with pack='auto' (the packing costs are measured "
                         "at the space's configurations), or pass costs=, or pack=True / pack=False")
    gpu = str(spec.device).startswith("cuda")
    if pack is False:
        return _alone(spec, max_units, int(stream_batch), gpu,
                      _fixed_decision(False, "pack=False: every trial trains alone"))
    if members_per_device is None:      # after every cheap check: this may measure on a GPU
        members_per_device = choose_members_per_device(spec, param_space, gpu)
        if trials_per_device is not None and trials_per_device < members_per_device:
            raise ValueError(f"trials_per_device must be >= members_per_device "
                             f"({members_per_device}, chosen from memory), got {trials_per_device}")
    if pack == "auto":
        decision = decide_packing(spec, max_units, param_space, int(stream_batch), gpu, cpus_per_device,
                                  members_per_device, threads or max(1, int(cpus_per_device)),
                                  num_samples, reduction_factor, costs, cache_dir)
        if not decision.pack:
            return _alone(spec, max_units, int(stream_batch), gpu, decision)
        members_per_device = decision.members_per_device
        if trials_per_device is not None:
            trials_per_device = max(trials_per_device, members_per_device)
    else:
        decision = _fixed_decision(True, f"pack=True: {members_per_device} members per device")
    if trials_per_device is None:
        trials_per_device = members_per_device
    # checkpoint_every=0: a unit carries the member's state only at max_units; every other
    # checkpoint is fetched when Tune asks (save_checkpoint)
    job = PackedJob(cloudpickle.dumps(spec), int(stream_batch), max_units, members_per_device,
                    0, float(cpus_per_device), gpu,
                    normalised_space(param_space) if param_space is not None else None,
                    float(wait_s), float(idle_exit_s), uuid.uuid4().hex[:12], bool(run_ahead),
                    int(trials_per_device), threads or max(1, int(cpus_per_device)),
                    decision=decision.to_dict())
    import ray

    if ray.is_initialized():            # coordinators start now, not when the first trial asks
        if gpu:
            _start_gpu_coordinators(job)
        else:
            for d in _devices(job):
                _coordinator(job, *d)

    share = 1.0 / trials_per_device
    resources = {"cpu": 0.0 if gpu else cpus_per_device * share}
    if gpu:
        resources["gpu"] = share
    return tune.with_resources(_trainable_class(job), resources)


# ----------------------------------------------------------------------------- the decision

_ALONE_SWEEPS: dict[str, dict] = {}     # token -> decision of the sweeps built here that train alone


def _fixed_decision(pack: bool, reason: str):
    from jabasray.planners.pack_cost import PackDecision

    log.info("packed trials: %s", reason)
    return PackDecision(pack, 0, 0, 0, 0.0, 0.0, {}, reason)


def _cluster_shape(gpu: bool, cpus_per_device: float) -> tuple[int, int, int]:
    """``(cores, packed devices, trials alone at once)`` of the connected Ray cluster (this
    machine when Ray is not running): one coordinator per ``cpus_per_device`` CPUs or per GPU;
    alone, one trial per CPU (or per GPU)."""
    import ray

    if ray.is_initialized():
        res = ray.cluster_resources()
        cores = max(1, int(res.get("CPU", 1)))
        gpus = int(res.get("GPU", 0))
    else:
        cores, gpus = os.cpu_count() or 1, 0
    if gpu:
        gpus = max(1, gpus)
        return cores, gpus, gpus
    return cores, max(1, int(cores // cpus_per_device)), cores


def _probe_sample(param_space: Mapping[str, Any], k: int) -> list[dict]:
    """``k`` configurations of the space (seeded) in similarity order: what one pack holds."""
    rng = random.Random(0)
    batch = [_sample(param_space, rng) for _ in range(k)]
    groups = similarity_order(batch, normalised_space(param_space), k, seed=0)
    return [batch[i] for g in groups for i in g]


def _measure_costs_on_a_gpu(spec_blob: bytes, configs: list[dict], stream_batch: int, cache_dir: str | None):
    """Ray task body (it holds one GPU): the packing costs measured on it."""
    import dataclasses

    import cloudpickle

    from jabasray.tuner.pack_profile import measure_pack_costs

    spec = dataclasses.replace(cloudpickle.loads(spec_blob), device="cuda:0")
    return measure_pack_costs(spec, configs, stream_batch, 1, cache_dir).to_dict()


def decide_packing(spec: Any, max_units: int, param_space: Mapping[str, Any] | None, stream_batch: int,
                   gpu: bool, cpus_per_device: float, max_members: int, threads: int,
                   num_samples: int | None = None, reduction_factor: int = 3, costs: Any = None,
                   cache_dir: str | None = None):
    """The :class:`~jabasray.planners.pack_cost.PackDecision` of :func:`packed` with
    ``pack="auto"``: the sweep's expected units (successive halving of ``num_samples`` trials,
    default one Hyperband iteration's sample), the cluster's cores and devices, and the costs
    (given, or measured at ``max_members`` configurations of the space on this machine -- on a
    GPU in a Ray task holding one). Logged once with its reason."""
    import cloudpickle

    from jabasray.planners.pack_cost import PackCosts, decide, halving_units
    from jabasray.tuner.pack_profile import default_cache_dir

    cores, devices, slots = _cluster_shape(gpu, cpus_per_device)
    n = num_samples or sum(b.num_configs for b in hyperband_schedule(max_units, reduction_factor))
    units = halving_units(n, max_units, reduction_factor)
    if costs is None:
        configs = _probe_sample(param_space, max_members)
        cache = cache_dir or default_cache_dir()
        if gpu:
            import ray

            task = ray.remote(num_gpus=1, num_cpus=0)(_measure_costs_on_a_gpu)
            costs = PackCosts.from_dict(ray.get(task.remote(cloudpickle.dumps(spec), configs, stream_batch,
                                                            cache), timeout=900))
        else:
            from jabasray.tuner.pack_profile import measure_pack_costs
            costs = measure_pack_costs(spec, configs, stream_batch, threads, cache)
    elif not isinstance(costs, PackCosts):
        raise ValueError(f"costs must be a jabasray.planners.pack_cost.PackCosts, got {type(costs).__name__}")
    decision = decide(costs, units, cores, devices, slots, min(max_members, costs.max_members))
    log.info("packed trials: %s", decision.reason)
    return decision


def _alone(spec: Any, max_units: int, stream_batch: int, gpu: bool, decision):
    """The trainable of a sweep whose trials all train alone: a plain class trainable of the
    spec (:func:`~jabasray.tuner.trainable.plain_trial_class`: one trial process with one CPU,
    or one GPU, a report per unit, a checkpoint when Tune asks, the datasets shipped once
    through Ray's object store), what a Tune user runs, so that such a sweep is Tune's own
    sweep and never slower than it; a class, as the packed trainable is, so that the same
    ``RunConfig`` serves either decision. The decision is kept for :func:`coordinator_stats`
    (no coordinator starts)."""
    from ray import tune

    from jabasray.tuner.trainable import plain_trial_class
    from jabasray.tuner.training import cached_data

    _ALONE_SWEEPS[uuid.uuid4().hex[:12]] = decision.to_dict()
    trainable = tune.with_parameters(plain_trial_class(spec, stream_batch, max_units), data=cached_data(spec))
    trainable = tune.with_resources(trainable, {"cpu": 1.0, "gpu": 1.0} if gpu else {"cpu": 1.0})
    trainable._jabasray_trains_alone = True
    return trainable


def trains_alone(trainable: Any) -> bool:
    """Whether ``trainable`` (what :func:`packed` returned) trains every trial alone: the cost
    model's decision, or ``pack=False``."""
    return bool(getattr(trainable, "_jabasray_trains_alone", False))


# ----------------------------------------------------------------------------- the trial

def _coordinator(job: PackedJob, name: str, device: str | None, threads: int):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from jabasray.tuner.coordinator import PackCoordinator

    opts: dict[str, Any] = dict(name=name, namespace=COORDINATOR_NAMESPACE, lifetime="detached",
                                get_if_exists=True, num_cpus=0, max_concurrency=1000,
                                scheduling_strategy=NodeAffinitySchedulingStrategy(
                                    ray.get_runtime_context().get_node_id(), soft=False))
    if device is not None:        # see every GPU; the coordinator picks its own by index
        opts["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    return ray.remote(PackCoordinator).options(**opts).remote(
        job.spec_blob, job.stream_batch, job.members_per_device, job.space, threads, device,
        job.wait_s, job.idle_exit_s, job.max_units, job.checkpoint_every, job.run_ahead,
        600.0 if job.trials_per_device > job.members_per_device else 0.0, decision=job.decision)


def _start_gpu_coordinators(job: PackedJob, timeout_s: float = 60.0) -> int:
    """Start the coordinator of every free GPU of the cluster before Tune starts a trial: one
    Ray task per GPU holds it (so Ray's own GPU assignment names it, as a trial's would), starts
    that GPU's coordinator on its node and waits until it answers (CUDA context, data on the
    device). GPUs held by others past ``timeout_s`` are left to their first trial. Returns how
    many coordinators answered."""
    import ray

    def start_here() -> int:
        handles = [_coordinator(job, *d) for d in _devices(job)]
        ray.get([h.stats.remote() for h in handles])
        return len(handles)

    gpus = int(ray.available_resources().get("GPU", 0))
    task = ray.remote(num_gpus=1, num_cpus=0)(start_here)
    refs = [task.remote() for _ in range(gpus)]
    done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in pending:
        ray.cancel(ref, force=True)
    started = 0
    for ref in done:
        try:
            started += ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a GPU that cannot host one is the trial's to report
            log.warning("a packing coordinator did not start before the sweep (its first trial "
                        "starts it again): %s", str(e).strip().splitlines()[-1])
    log.info("packing coordinators started on %d of %d free GPU(s) before the first trial", started, gpus)
    return started


def _devices(job: PackedJob) -> list[tuple[str, str | None, int]]:
    """``(coordinator name, torch device or None, threads)`` this trial may use."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    base = f"pack/{job.token}/{node[:12]}"
    if job.gpu:
        gpu = ray.get_gpu_ids()
        if not gpu:
            raise RuntimeError("a packed GPU trial got no GPU from Ray")
        return [(f"{base}/gpu{gpu[0]}", f"cuda:{gpu[0]}", 1)]
    cpus = next((n["Resources"].get("CPU", 1.0) for n in ray.nodes() if n["NodeID"] == node), 1.0)
    count = max(1, int(cpus // job.cpus_per_device))
    return [(f"{base}/cpu{d}", None, job.threads) for d in range(count)]


def _register(job: PackedJob, key: str, config: dict, state: bytes | None):
    """Load the member into the best device's coordinator: ``(handle, reply)``."""
    import ray

    devices = _devices(job)
    deadline = time.monotonic() + 600.0
    while True:
        handles = [_coordinator(job, *d) for d in devices]
        try:
            aff = ray.get([h.affinity.remote(config) for h in handles])
            queued = job.trials_per_device > job.members_per_device     # a full one queues the load
            order = sorted((i for i in range(len(handles)) if aff[i][0] > 0 or queued),
                           key=lambda i: (aff[i][0] <= 0, aff[i][1], -aff[i][0], i))
            for i in order:
                reply = ray.get(handles[i].load.remote(key, config, state))
                if not reply.get("full"):
                    return handles[i], reply
        except ray.exceptions.RayActorError:        # a coordinator exited while idle: recreate
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no packing coordinator of {[d[0] for d in devices]} had a free slot "
                               f"for 600 s (members_per_device={job.members_per_device})")
        time.sleep(0.05)


def _read_checkpoint(checkpoint) -> bytes:
    """The member bytes of a checkpoint Tune hands a class Trainable (a folder path)."""
    path = checkpoint if isinstance(checkpoint, str) else checkpoint.path
    with open(os.path.join(path, CHECKPOINT_FILE), "rb") as f:
        return f.read()


def _trainable_class(job: PackedJob):
    """The class Trainable of :func:`packed` for ``job`` (see the module docstring)."""
    import ray
    from ray import tune

    from jabasray.tuner.coordinator import NotLoaded

    class PackedTrial(tune.Trainable):
        """One configuration: ``step()`` is one unit trained with the device's other members
        through its packing coordinator; ``save_checkpoint`` fetches the member's state only
        when Tune asks; ``reset_config`` swaps the member (``reuse_actors=True``);
        ``cleanup`` frees it (Tune stopped, paused or finished the trial)."""

        def setup(self, config: dict) -> None:
            self._key: str | None = None
            self._handle = None
            self._plain = None                     # PlainMember: an unpackable model
            self._state: bytes | None = None       # to load from (a restored checkpoint)
            self._final: bytes | None = None       # the state after max_units (came with the unit)
            self._units = 0

        # -- membership ----------------------------------------------------------------------
        def _join(self) -> None:
            """Pack's ``load`` (lazily: Tune restores a checkpoint after ``setup``)."""
            self._key = self.trial_id
            handle, reply = _register(job, self._key, self.config, self._state)
            if "unpackable" in reply:
                import cloudpickle
                import torch

                from jabasray.tuner.pack_runner import state_from_bytes
                from jabasray.tuner.trainable import PlainMember

                log.warning("trial %s trains unpacked: %s", self._key, reply["unpackable"])
                torch.set_num_threads(max(1, int(job.cpus_per_device / job.members_per_device)))
                self._plain = PlainMember(cloudpickle.loads(job.spec_blob), self.config, job.stream_batch,
                                          state_from_bytes(self._state) if self._state else None)
                self._units = self._plain.units
                return
            self._handle, self._units = handle, int(reply["units"])

        def _leave(self) -> None:
            """Pack's ``free`` (fire and forget: the coordinator drops the member)."""
            if self._handle is not None:
                self._handle.free.remote(self._key)
            self._handle = self._plain = None

        # -- Tune's Trainable API --------------------------------------------------------------
        def step(self) -> dict:
            if self._handle is None and self._plain is None:
                self._join()
            if self._plain is not None:
                metrics = self._plain.unit()
            else:
                try:
                    # usually trained ahead while Tune processed the previous result
                    metrics, blob = ray.get(self._handle.unit.remote(self._key))
                except (NotLoaded, ray.exceptions.RayActorError) as e:
                    # set aside and dropped, or the coordinator exited while this trial was
                    # away: load again from the last checkpoint Tune has of it
                    log.info("trial %s re-joins a pack from its last checkpoint (%s)", self._key, type(e).__name__)
                    self._handle = None
                    self._join()
                    metrics, blob = ray.get(self._handle.unit.remote(self._key))
                if blob is not None:
                    self._final = blob
            self._units = int(metrics["units"])
            out = dict(metrics)
            if self._units >= job.max_units:
                out[tune.result.DONE] = True
            return out

        def save_checkpoint(self, checkpoint_dir: str):
            if self._plain is not None:
                from jabasray.tuner.pack_runner import state_to_bytes
                blob = state_to_bytes(self._plain.state())
            elif self._handle is None:
                blob = self._state                 # restored and not trained since
            elif self._final is not None and self._units >= job.max_units:
                blob = self._final                 # the last unit brought it
            else:
                blob = ray.get(self._handle.state.remote(self._key))
            if blob is None:
                raise ValueError(f"trial {self.trial_id} has no state to save before its first unit")
            with open(os.path.join(checkpoint_dir, CHECKPOINT_FILE), "wb") as f:
                f.write(blob)
            return None

        def load_checkpoint(self, checkpoint) -> None:
            self._state = _read_checkpoint(checkpoint)
            if self._handle is not None or self._plain is not None:   # re-load the member from it
                self._leave()
                self._join()

        def reset_config(self, new_config: dict) -> bool:
            self._leave()
            self.config = dict(new_config)
            self._state = self._final = None
            self._units = 0
            return True

        def cleanup(self) -> None:
            self._leave()

    PackedTrial.__name__ = PackedTrial.__qualname__ = "packed_trial"
    return PackedTrial


def coordinator_stats(release: bool = False) -> dict[str, dict]:
    """``{coordinator name: PackCoordinator.stats()}`` of every packing coordinator alive in
    the connected Ray cluster: units run, members trained per unit (summed), speculative units
    discarded, members set aside, decision points learned, seconds training and idle (by what
    was awaited), and the packing decision the sweep was built from (``decision``: a
    :class:`~jabasray.planners.pack_cost.PackDecision` as a dict, with its ``reason``). A sweep
    whose trials train alone has no coordinator: it is listed as ``alone/<token>`` (by the
    process that called :func:`packed`) with zero counts and its decision. ``release=True``
    also ends them (they otherwise exit after ``idle_exit_s`` without members); call it after
    ``Tuner.fit()`` returns."""
    import ray

    out = {}
    for token in list(_ALONE_SWEEPS):      # sweeps that train alone have no coordinator
        out[f"alone/{token}"] = {"members": [], "units_run": 0, "member_units": 0, "units_discarded": 0,
                                 "units_unclaimed": 0, "set_aside": 0, "decisions": [], "busy_s": 0.0,
                                 "idle_s": {}, "alive_s": 0.0, "position": 0,
                                 "decision": dict(_ALONE_SWEEPS[token])}
        if release:
            del _ALONE_SWEEPS[token]
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] != COORDINATOR_NAMESPACE or not a["name"].startswith("pack/"):
            continue
        try:
            handle = ray.get_actor(a["name"], namespace=COORDINATOR_NAMESPACE)
            out[a["name"]] = ray.get(handle.stats.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ValueError):       # exited meanwhile
            continue
        if release:
            ray.kill(handle)
    return out


# ----------------------------------------------------------------------------- search order

def _sample(param_space: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """One configuration drawn from Tune domains (constants kept as they are)."""
    import numpy as np
    from .tune_internals import sample_classes
    Domain = sample_classes().Domain

    out = {}
    for k, v in param_space.items():
        if isinstance(v, Domain):
            out[k] = v.sample(random_state=np.random.RandomState(rng.randrange(2 ** 31)))
        elif isinstance(v, Mapping) and set(v) == {"grid_search"}:
            out[k] = rng.choice(list(v["grid_search"]))
        else:
            out[k] = v
    return out


def _make_search_class():
    from ray.tune.search import Searcher

    class _SimilaritySearch(Searcher):
        """Samples the param space in batches and emits every batch in kNN order (see
        :class:`SimilaritySearch`)."""

        def __init__(self, group_size: int = 8, batch_size: int | None = None,
                     batch_sizes: Sequence[int] | None = None, points: Sequence[Mapping] | None = None,
                     seed: int = 0, metric: str | None = None, mode: str | None = None,
                     first_wave: int | None = None, trainable: Any = None) -> None:
            super().__init__(metric=metric, mode=mode)
            check_int("group_size", group_size, min_value=1)
            # kNN groups serve packing only: a sweep whose trials train alone keeps the order
            # its configurations were sampled (or listed) in, as Tune's own searcher would
            self.similarity = not trains_alone(trainable)
            if first_wave is not None:
                check_int("first_wave", first_wave, min_value=1)
            self.wave_limit = first_wave           # None once the first result (or end) lifted it
            if batch_size is not None:
                check_int("batch_size", batch_size, min_value=1)
            self.group_size, self.batch_size = group_size, batch_size
            self.batch_sizes = [check_int(f"batch_sizes[{i}]", n, min_value=1)
                                for i, n in enumerate(batch_sizes or [])]
            self.points = [dict(p) for p in points] if points is not None else None
            self.seed = seed
            self.rng = random.Random(seed)
            self.param_space: Mapping[str, Any] | None = None
            self.buffer: list[dict] = []
            self.batches_done = 0
            self.emitted = 0

        def set_search_properties(self, metric, mode, config, **spec) -> bool:
            if metric:
                self._metric = metric
            if mode:
                self._mode = mode
            self.param_space = dict(config)
            return True

        def _next_batch(self) -> list[dict]:
            n = (self.batch_sizes[self.batches_done] if self.batches_done < len(self.batch_sizes)
                 else self.batch_size or self.group_size)
            self.batches_done += 1
            if self.points is not None:
                batch = self.points[:n]
                del self.points[:n]
            else:
                if self.param_space is None:
                    raise ValueError("SimilaritySearch needs the Tuner's param_space (or points=...)")
                batch = [_sample(self.param_space, self.rng) for _ in range(n)]
            if not batch or not self.similarity:
                return batch
            space = normalised_space(self.param_space or {})
            groups = similarity_order(batch, space, self.group_size, seed=self.seed + self.batches_done)
            return [batch[i] for g in groups for i in g]

        def suggest(self, trial_id: str):
            if self.wave_limit is not None and self.emitted >= self.wave_limit:
                return None                        # Tune asks again later
            if not self.buffer:
                self.buffer = self._next_batch()
                if not self.buffer:
                    return Searcher.FINISHED
            self.emitted += 1
            return self.buffer.pop(0)

        def on_trial_result(self, trial_id: str, result: dict) -> None:
            self.wave_limit = None

        def on_trial_complete(self, trial_id: str, result=None, error: bool = False) -> None:
            self.wave_limit = None

        def save(self, checkpoint_path: str) -> None:
            import json
            with open(checkpoint_path, "w") as f:
                json.dump({"buffer": self.buffer, "points": self.points, "batches_done": self.batches_done,
                           "emitted": self.emitted, "wave_limit": self.wave_limit,
                           "rng": repr(self.rng.getstate())}, f, default=str)

        def restore(self, checkpoint_path: str) -> None:
            import ast
            import json
            with open(checkpoint_path) as f:
                d = json.load(f)
            self.buffer, self.points = d["buffer"], d["points"]
            self.batches_done, self.emitted = d["batches_done"], d["emitted"]
            self.wave_limit = d.get("wave_limit")
            self.rng.setstate(ast.literal_eval(d["rng"]))

    return _SimilaritySearch


def SimilaritySearch(group_size: int = 8, batch_size: int | None = None,
                     batch_sizes: Sequence[int] | None = None, points: Sequence[Mapping] | None = None,
                     seed: int = 0, metric: str | None = None, mode: str | None = None,
                     first_wave: int | None = None, trainable: Any = None):
    """A Tune ``Searcher``: samples the Tuner's ``param_space`` (any Tune domain) in batches of
    ``batch_size`` (or the listed ``batch_sizes`` first) and emits each batch grouped by
    similarity (:func:`~jabasray.planners.pack_opt.similarity_order`, ``group_size``
    configurations per group), so trials that arrive together pack well. ``points``: emit
    these configurations (in similarity order per batch) instead of sampling; FINISHED after
    the last one. Use it with ASHA (``batch_size = num_samples`` orders the whole sweep).

    ``first_wave``: emit at most this many trials until the first trial reports a result (or
    ends), then the rest as Tune asks. Every admitted trial is a process that starts a Ray worker
    and imports Ray Tune, and processes started together share the CPUs, so none is ready early
    (``benchmarks/trial_startup.py``); with packed trials admitted beyond the packs' seats
    (``trials_per_device > members_per_device``), ``first_wave = members_per_device x devices``
    starts the trials that train first before the ones that wait for a seat. None: no limit.

    ``trainable``: the trainable :func:`packed` returned for this sweep. Where it trains every
    trial alone (:func:`trains_alone`), the configurations are emitted in the order they were
    sampled (or listed): grouping serves packing only, and it would change which trials an
    asynchronous scheduler such as ASHA sees first, so such a sweep is Tune's own sweep down to
    its trial order."""
    return _make_search_class()(group_size, batch_size, batch_sizes, points, seed, metric, mode,
                                first_wave, trainable)


class PackedHyperband:
    """Packed Hyperband for ``tune.Tuner`` (Pack paper, 5.2): Tune's ``HyperBandScheduler``
    (with the finished-bracket fix of :mod:`jabasray.tuner.schedulers`) with ``max_t=R`` and
    ``reduction_factor=eta`` and a :func:`SimilaritySearch` that samples each bracket's
    ``n`` configurations at once and emits them in kNN groups of ``members_per_device`` --
    ``pack_opt(T)`` of the bracket -- so each bracket's configurations arrive pack by pack.

    The brackets are TUNE's: the same ``s_max``, bracket sizes and rung lengths as Li et al.
    (Algorithm 1) for R a power of eta, but Tune keeps ``ceil(n_i / eta)`` configurations per
    halving where Li et al. keep ``floor`` (R = 81, s = 3: 34 -> 12 -> 4 -> 2 instead of
    34 -> 11 -> 3 -> 1; :func:`~jabasray.tuner.brackets.hyperband_schedule` with
    ``halving="ceil"`` lists them). We keep Tune's scheduler, so a packed sweep and an
    unpacked one under Tune's own ``HyperBandScheduler`` make the same decisions.

    Pass ``scheduler``, ``search_alg``, ``num_samples`` (one Hyperband iteration) and
    ``max_concurrent_trials`` to ``tune.TuneConfig`` (or call :meth:`tune_config`).
    ``trainable``: the sweep's trainable from :func:`packed` (see :func:`SimilaritySearch`).
    """

    def __init__(self, R: int, eta: int = 3, members_per_device: int = 8,
                 points: Sequence[Mapping] | None = None, seed: int = 0, trainable: Any = None) -> None:
        from jabasray.tuner.schedulers import hyperband_scheduler

        brackets = tune_hyperband_schedule(R, eta)
        self.brackets = brackets
        # Tune fills brackets from s = 0 (fewest configurations, most units) upwards
        self.bracket_sizes = [b.num_configs for b in reversed(brackets)]
        self.num_samples = sum(self.bracket_sizes)
        # Resources (1/members_per_device of a device per trial) bound how many trials run. The
        # limit only lifts Tune's "one pending trial at a time" for custom searchers; a lower one
        # would let a ConcurrencyLimiter hold back trials a HyperBand bracket waits for.
        self.max_concurrent_trials = self.num_samples
        # Tune's HyperBandScheduler plus the finished-bracket fix (see jabasray.tuner.schedulers)
        self.scheduler = hyperband_scheduler(max_t=R, reduction_factor=eta)
        self.search_alg = SimilaritySearch(group_size=members_per_device, batch_sizes=self.bracket_sizes,
                                           points=points, seed=seed, trainable=trainable)

    def tune_config(self, metric: str, mode: str, **kwargs):
        from ray import tune

        return tune.TuneConfig(metric=metric, mode=mode, scheduler=self.scheduler,
                               search_alg=self.search_alg, num_samples=self.num_samples,
                               max_concurrent_trials=self.max_concurrent_trials, **kwargs)
