"""Packed Hyperband on Ray Tune (Pack paper, section 5.2, ``Packed_Hyperband(N)``).

Implementation notes
--------------------
Three levels, as in Ray Tune's ``HyperBandScheduler``: a Hyperband run has brackets
(:mod:`jabasray.tuner.brackets`, Li et al.'s arithmetic), a bracket has rungs, a rung trains
``n_i`` configurations to ``r_i`` resource units (1 unit = ``TrainingSpec.steps_per_unit``
mini-batch steps). The bookkeeping (sampling, packing, successive halving) is the pure state
machine :class:`~jabasray.tuner.state.PackedHyperbandState`.

What differs from an ordinary Tune search is the unit of scheduling: a Tune TRIAL here is a
PACK of configurations, and the whole search is ONE ``tune.Tuner`` run driven by a Tune
``Searcher`` (:func:`_make_searcher`) whose suggestions are pack tasks:

1. at the start every bracket samples its ``n_0`` configurations (seeded, without
   replacement) and ``pack_opt`` (kNN by default, under the per-device ``memory_budget``)
   groups rung 0 of every bracket into packs;
2. each pack is one trial requesting one device (``resources_per_pack``, default one CPU):
   :func:`_pack_trial` builds or restores its members from their checkpoints, trains them as
   one :class:`~jabasray.engine.packing.PackedModel` on the shared input stream from step
   ``steps(r_{i-1})`` to ``steps(r_i)``, frees each member when done (load/free), evaluates it,
   saves ``member_<id>_step<n>/member.pt`` and reports every member's metric in one result;
3. when the last pack of a bracket's rung has reported, the searcher keeps the top
   ``n_{i+1} = floor(n_i / eta)`` (metric/mode, ties by configuration id), RE-PACKS them and
   suggests the next rung's packs; they continue from their checkpoints. Brackets advance
   independently, which equals running them one after another. The searcher answers "wait"
   (None) while a rung is in flight and FINISHED when every bracket is done.

Configurations that start at different steps are never packed together (they would need
different chunks of the stream).

Relation to Ray Tune's API: users describe ONE configuration (:class:`TrainingSpec`), give a
Tune ``param_space`` of discrete choices and call
``PackedHyperbandTuner(spec, param_space=..., hyperband=HyperbandConfig(...),
run_config=tune.RunConfig(...)).fit()``, the same shape as ``tune.Tuner(...).fit()``; the
result is a real ``ray.tune.ResultGrid`` with ONE ROW PER SAMPLED CONFIGURATION (its config
plus ``config_id``, one reported result per rung it reached, its last checkpoint), so
``get_best_result()`` names a single configuration. That grid is built directly from the
recorded per-rung results (:mod:`jabasray.tuner.result_grid`, a ``ResultGrid`` subclass; no
second Tune run, which used to cost as much wall-clock as the search on small problems).
``fit(result_grid=False)`` skips it and returns the plain :class:`PackedHyperbandResult`,
which is always available as ``tuner.search_result`` (the pack trials' own grid is
``tuner.packs_grid``). Member checkpoints live under ``<storage_path>/<name>_packs/members``,
which every node must reach (as Tune's own ``storage_path``).

Shared input stream: every configuration reads the stream of
:class:`~jabasray.tuner.training.SharedStream` (chunk size = largest batch size of the space),
so it sees the same batches alone or in any pack: the packed and the unpacked search
(``pack_method="none"``) select the same configurations up to floating-point ties.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from jabasray.engine.packing import estimate_memory_bytes, optimizer_kind, pack
from jabasray.planners.pack_opt import PackingPlan, SearchSpace, pack_opt
from jabasray.serialization import JsonMixin
from jabasray.tuner.brackets import Bracket, hyperband_schedule
from jabasray.tuner.state import ConfigRecord, PackedHyperbandResult, PackedHyperbandState
from jabasray.tuner.space import search_space_from_param_space
from jabasray.tuner.training import (SharedStream, TrainingSpec, build_member, cached_data,
                                     load_member_state, member_state, stream_batch_of, units_to_steps)
from jabasray.validation import check_choice, check_float, check_int

log = logging.getLogger(__name__)

PACK_METHODS = ("knn", "random", "batch_size", "none")

__all__ = ["HyperbandConfig", "ConfigRecord", "PackedHyperbandResult", "PackedHyperbandTuner",
           "PackedHyperbandState", "PACK_METHODS"]


@dataclass
class HyperbandConfig(JsonMixin):
    """Settings of one packed Hyperband run."""
    R: int = 81                          # max resource units per configuration
    eta: int = 3                         # halving rate (>= 2)
    memory_budget: float = 2e9           # bytes one device offers to a pack
    pack_method: str = "knn"             # knn | random | batch_size | none (unpacked)
    threshold: float | None = None       # kNN similarity threshold (None: memory only)
    max_pack_size: int | None = None     # optional cap on configurations per pack
    seed: int = 0                        # sampling + kNN centroids
    resources_per_pack: dict[str, float] = field(default_factory=lambda: {"cpu": 1})
    max_concurrent_packs: int | None = None   # None: as many as the cluster fits

    def __post_init__(self) -> None:
        check_int("R", self.R, min_value=1)
        check_int("eta", self.eta, min_value=2)
        check_float("memory_budget", self.memory_budget, min_value=0.0, min_exclusive=True)
        check_choice("pack_method", self.pack_method, PACK_METHODS)
        if self.threshold is not None:
            check_float("threshold", self.threshold, min_value=0.0)
        if self.max_pack_size is not None:
            check_int("max_pack_size", self.max_pack_size, min_value=1)
        if self.max_concurrent_packs is not None:
            check_int("max_concurrent_packs", self.max_concurrent_packs, min_value=1)


# ----------------------------------------------------------------------------- trial functions
# Module-level so Ray pickles them by reference; ``spec`` and the ``(train, val)`` datasets
# arrive via tune.with_parameters (the data is loaded ONCE by the driver and read from Ray's
# object store, instead of every trial process calling ``spec.data_fn()``).


def _pack_trial(config: dict, spec: TrainingSpec | None = None, data: tuple | None = None) -> None:
    """One Tune trial = one pack of configurations trained from ``start`` to their ``end`` step."""
    from ray import tune

    t_entry, wall_entry = time.perf_counter(), time.time()
    task = config["task"]
    torch.set_num_threads(int(task.get("threads", 1)))
    train, val = data if data is not None else cached_data(spec)
    stream = SharedStream(train, task["stream_batch"], spec.seed, spec.device)
    members = task["members"]
    starts = {m["start"] for m in members}
    if len(starts) != 1:
        raise ValueError(f"a pack's members must start at the same step, got {sorted(starts)}")
    start = starts.pop()
    models, opts, sizes = [], [], []
    for m in members:
        model, opt = build_member(spec, m["config"])
        if m.get("ckpt"):
            steps = load_member_state(model, opt, torch.load(m["ckpt"], weights_only=False))
            if steps != start:
                raise ValueError(f"checkpoint {m['ckpt']} holds {steps} steps, the rung starts at {start}")
        models.append(model)
        opts.append(opt)
        sizes.append(spec.batch_size_of(m["config"]))
    out_dir = task["ckpt_dir"]
    os.makedirs(out_dir, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    packed = pack(models, opts, sizes, loss_fn=spec.loss_fn)
    by_member = {mid: m for mid, m in zip(packed.member_ids, members)}
    # summed train losses by member id, kept on the device: no host sync per step
    loss_sum = torch.zeros(len(members), dtype=torch.float64, device=packed.device)
    active, index = [], None                              # member ids in the pack, as a tensor
    step = start

    def finish(mid: int, freed: tuple | None = None) -> None:
        m = by_member[mid]
        model, opt = freed if freed is not None else packed.free(mid)
        metric = float(spec.metric_fn(model, val))
        ckpt_dir = os.path.join(out_dir, f"member_{m['id']}_step{m['end']}")  # a Tune Checkpoint dir
        os.makedirs(ckpt_dir, exist_ok=True)
        path = os.path.join(ckpt_dir, "member.pt")
        torch.save(member_state(model, opt, m["end"]), path)
        n = m["end"] - start
        results[str(m["id"])] = {spec.metric: metric, "train_loss": float(loss_sum[mid]) / max(1, n),
                                 "steps": m["end"], "checkpoint": path}

    for mid in [i for i, m in by_member.items() if m["end"] <= start]:
        finish(mid)
    while len(packed):
        x, y = stream.batch(step, packed.max_batch_size)
        if packed.member_ids != active:                   # only after a member was freed
            active = packed.member_ids
            index = torch.tensor(active, device=loss_sum.device)
        loss_sum.index_add_(0, index, packed.train_step_tensor(x, y).double())
        step += 1
        done = [i for i in packed.member_ids if by_member[i]["end"] <= step]
        if done and len(done) == len(packed):             # everyone is done: one write-back
            ids = packed.member_ids
            for mid, freed in zip(ids, packed.free_all()):
                finish(mid, freed)
        else:
            for mid in done:
                finish(mid)                               # misaligned step counts: free early
    t_end = time.perf_counter()
    tune.report({"members": results, "pack_size": len(members),
                 "pack_setup_s": t0 - t_entry,             # data, stream, build + restore members
                 "pack_train_time_s": t_end - t0,          # train + evaluate + save members
                 "pack_started_at": wall_entry, "pack_ended_at": wall_entry + (t_end - t_entry)})


# ----------------------------------------------------------------------------- Tune searcher

def _members_of(result: dict) -> dict[str, dict[str, Any]]:
    """Per-member rows of a pack's result (Tune hands searchers FLATTENED results:
    ``members/<id>/<key>``)."""
    if isinstance(result.get("members"), dict):
        return result["members"]
    out: dict[str, dict[str, Any]] = {}
    for key, value in result.items():
        if key.startswith("members/"):
            _, cid, name = key.split("/", 2)
            out.setdefault(cid, {})[name] = value
    return out


def _make_searcher(state: PackedHyperbandState):
    """A Ray Tune ``Searcher`` whose trials are the pack tasks of ``state``."""
    from ray.tune.search import Searcher

    class PackedHyperbandSearcher(Searcher):
        """Suggests one pack task per trial; waits (None) while a bracket's rung is running;
        FINISHED once every bracket is done. Results go to the pure state machine."""

        def __init__(self) -> None:
            super().__init__(metric=None, mode=None)
            self.state = state
            self.trials: dict[str, dict] = {}
            self.errors: list[str] = []

        def suggest(self, trial_id: str):
            task = self.state.next_task()
            if task is None:
                return Searcher.FINISHED if self.state.finished or self.errors else None
            self.trials[trial_id] = task
            return {"task": task}

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
            task = self.trials.pop(trial_id, None)
            if task is None:
                return
            members = _members_of(result) if result and not error else {}
            if not members:
                self.errors.append(task["name"])
                return
            self.state.complete(task, members)

    return PackedHyperbandSearcher()


# ----------------------------------------------------------------------------- the driver

class PackedHyperbandTuner:
    """Packed Hyperband with Ray Tune (see the module docstring).

    Args:
        spec: how one configuration trains (model, optimizer, batch size, data, metric).
        param_space: Tune param space of discrete choices (``tune.choice`` / lists / constants).
        hyperband: R, eta, memory budget, packing method/threshold, resources per pack.
        run_config: ``tune.RunConfig``; ``name``/``storage_path`` place the experiment (the
            pack trials go to ``<name>_packs``, the per-configuration grid to ``<name>``; member
            checkpoints to ``<storage_path>/<name>_packs/members``, which every node must reach).
        memory_fn: bytes of one configuration for pack_opt; default ``spec.memory_fn`` or a
            modelled estimate (:func:`~jabasray.engine.packing.estimate_memory_bytes`).
        kinds: optional ``{key: "numeric" | "categorical"}`` overriding inferred kinds.
    """

    def __init__(self, spec: TrainingSpec, *, param_space: Mapping[str, Any],
                 hyperband: HyperbandConfig | None = None, run_config: Any = None,
                 memory_fn: Any = None, kinds: Mapping[str, str] | None = None) -> None:
        if not isinstance(spec, TrainingSpec):
            raise ValueError(f"spec must be a TrainingSpec, got {type(spec).__name__}")
        self.spec = spec
        self.space: SearchSpace = search_space_from_param_space(param_space, kinds)
        self.hb = hyperband or HyperbandConfig()
        self.run_config = run_config
        self._memory_fn = memory_fn or spec.memory_fn or self._modelled_memory
        self._mem_cache: dict[str, float] = {}
        self.brackets: list[Bracket] = hyperband_schedule(self.hb.R, self.hb.eta)
        self.stream_batch = stream_batch_of(spec, self.space)
        self._name = getattr(run_config, "name", None) or f"packed_hyperband_{int(time.time())}"
        self.search_result: PackedHyperbandResult | None = None
        self.packs_grid = None

    def _modelled_memory(self, config: Mapping[str, Any]) -> float:
        key = repr(sorted(config.items()))
        if key not in self._mem_cache:
            model, opt = build_member(self.spec, config)
            slots = {"adam": 2, "sgd": 1, "adagrad": 1}.get(optimizer_kind(opt, model), 2)
            self._mem_cache[key] = float(estimate_memory_bytes(model, self.spec.batch_size_of(config), slots))
        return self._mem_cache[key]

    def _storage(self) -> str:
        storage = getattr(self.run_config, "storage_path", None)
        if storage is None:
            storage = os.path.join(os.path.expanduser("~"), "ray_results")
        return os.fspath(storage)

    def _plan(self, configs: list[dict]) -> PackingPlan:
        if self.hb.pack_method == "none":
            return PackingPlan("none", [[i] for i in range(len(configs))],
                               [float(self._memory_fn(c)) for c in configs], self.hb.memory_budget)
        return pack_opt(configs, self.space, self._memory_fn, self.hb.memory_budget,
                        method=self.hb.pack_method, threshold=self.hb.threshold, seed=self.hb.seed,
                        max_pack_size=self.hb.max_pack_size)

    def make_state(self) -> PackedHyperbandState:
        """The pure bookkeeping object of one run (sampling, packing, successive halving)."""
        spec = self.spec
        return PackedHyperbandState(
            self.space, self.brackets, self._plan, lambda r: units_to_steps(r, spec.steps_per_unit),
            spec.metric, spec.mode, self.hb.seed,
            task_extra={"stream_batch": self.stream_batch,
                        "threads": int(self.hb.resources_per_pack.get("cpu", 1) or 1),
                        "ckpt_dir": os.path.join(self._storage(), f"{self._name}_packs", "members")})

    def _max_concurrent(self) -> int | None:
        """``max_concurrent_packs``, or as many packs as the running Ray cluster fits. Set
        explicitly because with a custom searcher and no limit Tune keeps ONE trial pending at
        a time, which serialises short pack trials on one worker and idles the other devices."""
        if self.hb.max_concurrent_packs is not None:
            return self.hb.max_concurrent_packs
        import ray

        if not ray.is_initialized():
            return None                                   # Tune starts Ray; its default applies
        total = ray.cluster_resources()
        fits = [int(total.get(k.upper() if k in ("cpu", "gpu") else k, 0) // v)
                for k, v in self.hb.resources_per_pack.items() if v]
        return max(1, min(fits) if fits else 1)

    def search(self) -> PackedHyperbandResult:
        """Run packed Hyperband as ONE Tune run whose trials are packs; no per-config grid."""
        from ray import tune

        state = self.make_state()
        searcher = _make_searcher(state)
        max_trials = sum(r.n for b in self.brackets for r in b.rungs)   # all singletons: upper bound
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(_pack_trial, spec=self.spec, data=cached_data(self.spec)),
                                dict(self.hb.resources_per_pack)),
            tune_config=tune.TuneConfig(search_alg=searcher, num_samples=max_trials,
                                        max_concurrent_trials=self._max_concurrent(),
                                        reuse_actors=True,
                                        trial_name_creator=lambda tr: tr.config["task"]["name"],
                                        trial_dirname_creator=lambda tr: tr.config["task"]["name"]),
            run_config=tune.RunConfig(name=f"{self._name}_packs", storage_path=self._storage(),
                                      verbose=getattr(self.run_config, "verbose", None) or 0))
        t0 = time.perf_counter()
        self.packs_grid = tuner.fit()
        elapsed = time.perf_counter() - t0
        if self.packs_grid.errors or searcher.errors:
            raise RuntimeError(f"packed Hyperband: pack trial(s) {searcher.errors} failed; first error: "
                               f"{self.packs_grid.errors[0] if self.packs_grid.errors else 'no result'}")
        if not state.finished:
            raise RuntimeError("packed Hyperband stopped before every bracket finished "
                               f"(queued {len(state.queue)}, running {state.outstanding})")
        self.search_result = state.result(elapsed)
        return self.search_result

    def fit(self, result_grid: bool = True):
        """Run the search; return a ``ray.tune.ResultGrid`` with one row per configuration
        (``result_grid=False``: the :class:`PackedHyperbandResult` instead)."""
        result = self.search()
        if not result_grid:
            return result
        return self._result_grid(result)

    def _result_grid(self, result: PackedHyperbandResult):
        """One ``ray.tune.ResultGrid`` row per configuration, built from the recorded
        per-rung results and member checkpoints (no second Tune run; see
        :mod:`jabasray.tuner.result_grid`)."""
        from jabasray.tuner.result_grid import build_result_grid

        return build_result_grid(result.records, experiment_path=os.path.join(self._storage(), self._name),
                                 metric=self.spec.metric, mode=self.spec.mode)
