"""The GPU actor of a ``train_loop_per_worker`` job, and the job's engine-side callables.

The driver, the sampler, the batch-size rule and the interval protocol are the hooks API's
(:class:`jabasray.actors.gpu_actor.GPUActor`): the loop enters them only through the callables
here, each of which lets the process's loop run (:mod:`.bridge`) until it hands over what the
engine asks for -

* ``dataset_fn()``: the dataset of the loop's ``prepare_data_loader``;
* ``collate_fn(samples)``: that DataLoader's ``collate_fn`` (``default_collate`` if none), the
  job's collate hook: the actors' loaders batch a rank's micro-batches with it (then split
  them and join each round's, as for the hooks API's ``collate_fn``), the probe and the
  profiler too;
* ``model_fn()``: the model of ``prepare_model`` (a model that was already handed over means a new
  placement or a throwaway worker: the loop is entered again, the old run abandoned);
* ``optimizer_fn(params)``: the optimizer of ``prepare_optimizer`` (it must hold ``params``);
* ``step_fn(module, batch)``: the loss of the loop's next batch (:meth:`LoopRun.step`), called
  from the engine's thread only (``runs_on_caller_thread``); ``step_fn.grad_scaler()``: the
  enabled GradScaler the loop passes to ``epochs()``, which the engine scales the losses with.

:class:`LoopGPUActor` adds what the hooks cannot see: after each engine step the loop finishes
its iteration (and at an epoch end its epoch) before the interval goes on, the loop's own state
(``epochs(**state)``) travels in the actor's state dict, and its reports in the interval reply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch.utils.data import default_collate

from ..actors.gpu_actor import GPUActor, IntervalReply, IntervalRequest, _to_cpu
from . import bridge


@dataclass
class LoopCallables:
    """The engine-side callables of one loop (picklable: they travel to every actor)."""

    fn: Callable
    config: Any = None
    total_epochs: int | None = None

    def _run(self) -> "bridge.LoopRun":
        bridge.install_backward()
        run = bridge.active()
        if run is None or run.finished:
            run = bridge.start(self.fn, self.config, self.total_epochs)
        return run

    def dataset_fn(self) -> Any:
        run = self._run()
        if run.model is not None or (run.pending is not None and run.pending[0] != "loader"):
            run = bridge.start(self.fn, self.config, self.total_epochs)
        loader = run.until("loader")
        return getattr(loader, "dataset", loader)

    def model_fn(self) -> Any:
        run = self._run()
        if run.model is not None or (run.pending is not None and run.pending[0] not in ("loader", "model")):
            run = bridge.start(self.fn, self.config, self.total_epochs)
        model = run.until("model")
        run.model = model
        return model

    def optimizer_fn(self, params: list) -> Any:
        run = self._run()
        payload = run.until("optimizer")
        if run.optimizer is None:
            from .api import engine_optimizer
            run.optimizer = engine_optimizer(run, payload)
            run.loop_optimizers = payload if isinstance(payload, tuple) else (payload,)
        opt = run.optimizer
        if {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in params}:
            return opt
        # a copy of the loop's model (the profiler measures one): the same optimizer over it
        return clone_optimizer(opt, [p for p in run.model.parameters() if p.requires_grad], params)

    def collate_fn(self, samples: list) -> Any:
        """The loop's DataLoader's ``collate_fn`` (torch's ``default_collate`` if it has none)
        on ``samples``: the job's ``collate_fn`` hook, so the actors' loaders, the probe and
        the profiler batch the loop's samples as its own DataLoader would."""
        return self.loop_collate()(samples)

    def loop_collate(self) -> Callable:
        """The collate function of the loop's ``prepare_data_loader`` (read, not run: the loop
        runs only up to that call where it has not yet reached it)."""
        run = self._run()
        source = run.loader if run.loader is not None else run.until("loader")
        fn = getattr(source, "collate_fn", None)
        return fn if fn is not None else default_collate

    def step_fn(self, module: Any, batch: Any) -> Any:
        run = bridge.active()
        if run is None:
            raise RuntimeError("step_fn of a train_loop_per_worker job called before model_fn")
        return run.step(module, batch)

    # the loop is a coroutine of the engine's thread (bridge): the engine issues every VSW's
    # step from that thread (IIDPWorker's per-VSW "one_thread" scheme)
    step_fn.runs_on_caller_thread = True  # type: ignore[attr-defined]


def _loop_grad_scaler() -> Any:
    """The loop's enabled GradScaler (``epochs(scaler=...)``), asked by the engine every step."""
    run = bridge.active()
    return run.grad_scaler() if run is not None and not run.finished else None


# the engine scales the loop's losses with the loop's GradScaler (IIDPWorker.set_grad_scaler)
LoopCallables.step_fn.grad_scaler = _loop_grad_scaler  # type: ignore[attr-defined]


def clone_optimizer(opt: Any, originals: list, params: list) -> Any:
    """An optimizer like ``opt`` (its class, its param groups' settings, fresh state) over
    ``params``, the parameters of a copy of the model whose parameters are ``originals`` (in the
    same order); a :class:`~.api.JointOptimizer` is cloned optimizer by optimizer."""
    from .api import JointOptimizer

    if len(originals) != len(params) or any(a.shape != b.shape for a, b in zip(originals, params)):
        raise ValueError("prepare_optimizer: the optimizer(s) must hold exactly the trainable "
                         "parameters of the prepared model (build them from model.parameters() "
                         "after prepare_model)")
    mapping = {id(a): b for a, b in zip(originals, params)}

    def one(o: Any) -> Any:
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [mapping[id(p)] for p in g["params"]]} for g in o.param_groups]
        return type(o)(groups)

    if isinstance(opt, JointOptimizer):
        return JointOptimizer([one(o) for o in opt.optimizers])
    return one(opt)


class LoopGPUActor(GPUActor):
    """:class:`GPUActor` hosting a ``train_loop_per_worker`` (module notes)."""

    def setup(self, rdv: Any, slot: Any = None, bucket_plan: Any = None) -> int:
        rank = super().setup(rdv, slot, bucket_plan)
        self._loop = bridge.active()
        self._loop.total_epochs = self.job.epochs
        self._set_context(None)
        return rank

    def _set_context(self, req: IntervalRequest | None) -> None:
        from .api import LoopContext
        w = self.worker
        ctx = LoopContext(world_rank=self.slot.rank, world_size=self.world_size,
                          epoch=req.epoch if req is not None else 0,
                          global_batch=(req.local_batch * sum(req.layout)) if req is not None else 0,
                          local_batch=req.local_batch if req is not None else 0,
                          num_vsw=getattr(w, "num_vsw", 0), num_accumulation=getattr(w, "num_ga", 0))
        self._loop.context = ctx

    def run_interval(self, req: IntervalRequest) -> IntervalReply:
        run = self._loop
        run.epoch = req.epoch
        run.reports = []
        self._set_context(req)
        reply = super().run_interval(req)
        for rep in run.reports:          # report(): a mean over reports and ranks
            for k, v in rep.items():
                key = f"report/{k}"
                reply.metric_sums[key] = reply.metric_sums.get(key, 0.0) + v
                reply.metric_counts[key] = reply.metric_counts.get(key, 0) + 1
        run.reports = []
        return reply

    def _step_scheduler(self, epoch_end: bool) -> None:
        self._loop.after_step(epoch_end)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["loop"] = _to_cpu(self._loop.extra_state())
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        loop = state.pop("loop", None)
        super().load_state_dict(state)
        self._loop.restore(loop)

    def _probe_steps(self, *args: Any, **kwargs: Any) -> Any:
        """The cost probe's throwaway worker gets a loop of its own; the job's is kept."""
        kept = bridge.set_active(None)
        try:
            return super()._probe_steps(*args, **kwargs)
        finally:
            throwaway = bridge.set_active(kept)
            if throwaway is not None and throwaway is not kept:
                throwaway.abandon()

    def shutdown(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.finish()
        super().shutdown()
