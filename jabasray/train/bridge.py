"""The user's training loop as a coroutine of the GPU actor (the engine side and the loop side).

``train_loop_per_worker`` runs as a coroutine (a greenlet) on the thread of the process that
hosts the engine (a GPU actor, the probe task, a profiling task) and started it: the loop runs
only while the engine waits for it, and the engine only while the loop waits in one of
jabasray's calls (:class:`LoopRun` ``request``). A hand-over is a switch of stacks on that one
thread (a few microseconds; no other thread to wake, no cache lines moving between cores),
twice per batch. torch's per-thread state (grad mode, autocast, mode stacks, the CUDA stream) is
kept per side and swapped at each switch (:mod:`.torch_state`), so each side sees its own as
on a thread of its own. Every waiting point of the loop is a *request* the engine answers:

============  =====================================  =============================================
request       made by (loop side)                    answered by (engine side) with
============  =====================================  =============================================
``loader``    ``prepare_data_loader(loader)``        the prepared loader (its dataset is the job's)
``model``     ``prepare_model(model)``               the prepared model (the engine holds ``model``)
``optimizer`` ``prepare_optimizer(optimizer)``       the same optimizer, its ``step``/``zero_grad``
                                                     acting at the global iteration boundary
``epochs``    ``epochs(n, **state)`` at its start    the first epoch the driver runs (``state``
                                                     restored first where a checkpoint has it)
``batch``     the prepared loader's ``next()``       the engine's micro-batch of this step, or the
                                                     end of the epoch
``loss``      ``loss.backward()`` on that batch      "done" once the engine back-propagated it (and,
                                                     at the iteration's last batch, updated)
``epoch_end`` ``epochs()`` after an epoch            the next epoch, or None: training is over
============  =====================================  =============================================

The engine never runs the user's step itself: its ``step_fn(module, batch)`` (:class:`LoopStepFn`
in :mod:`.actor`) hands the batch to the loop and returns the loss the loop called ``backward()``
on; the engine then back-propagates it with its own scaling, buckets and all-reduce (JABAS/IIDP
section 4), exactly as for a ``step_fn`` of the hooks API. ``Tensor.backward`` is routed to the
engine only in a loop between a batch and its loss; everywhere else it is torch's own. The engine
calls the loop only from the thread that started it: the loop's step_fn is marked
``runs_on_caller_thread``, so :class:`~jabasray.engine.iidp.IIDPWorker` issues per-VSW steps from
that thread too (``"one_thread"``).
"""
from __future__ import annotations

import inspect
import logging
import threading
import weakref
from typing import Any, Callable

import greenlet
import torch

from ..errors import HookError
from . import torch_state

log = logging.getLogger(__name__)

LOOP_NAME = "train_loop_per_worker"
STOP = object()            # the loader's answer at the end of an epoch

_process_lock = threading.Lock()
_active: "LoopRun | None" = None   # the run the engine of this process trains now


class _Abandoned(BaseException):
    """Raised inside a loop the engine no longer needs (a throwaway model, a new placement):
    unwinds the user's function."""


class _LoopGreenlet(greenlet.greenlet):
    """The coroutine of one :class:`LoopRun` (``loop_run``: its run, for the loop-side lookups)."""

    def __init__(self, run: "LoopRun") -> None:
        super().__init__(run._main)
        self.loop_run = run


class _Raise:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def call_loop(fn: Callable, config: Any) -> Any:
    """``fn(config)`` when ``fn`` takes an argument, else ``fn()`` (Ray Train's convention)."""
    return fn(config) if takes_config(fn) else fn()


def takes_config(fn: Callable) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return True
    return bool(params)


class LoopRun:
    """One execution of ``train_loop_per_worker`` as a coroutine (module notes).

    Engine side: :meth:`advance`, :meth:`until`, :meth:`step`, :meth:`after_step`,
    :meth:`finish`, :meth:`abandon`. Loop side: :meth:`request`. What the loop handed over
    (``model``, ``optimizer``, ``dataset``, ``state``) and the context the engine sets
    (``epoch``, ``context``) are plain attributes.
    """

    def __init__(self, fn: Callable, config: Any, total_epochs: int | None = None) -> None:
        self.fn, self.config, self.total_epochs = fn, config, total_epochs
        self.glet: _LoopGreenlet | None = None   # created by the first advance, on its thread
        self._thread: int | None = None          # that thread's ident
        self._loop_state: Any = None             # torch's state of the side not running
        self._engine_state: Any = None           # (torch_state module)
        self._outer_state: Any = None            # of whoever threw into the loop (greenlet's kill)
        self._handed: tuple | None = None        # (module, batch, context) the loop's next batch request takes
        self.started = self.finished = False
        self.pending: tuple[str, Any] | None = None   # the loop's request not yet answered
        self.model: Any = None          # the user's module (the engine's main VSW)
        self.proxy: Any = None          # what prepare_model returned
        self.optimizer: Any = None      # the optimizer the engine steps
        self.loop_optimizers: tuple = ()  # what the loop handed to prepare_optimizer
        self.loader: Any = None         # the user's DataLoader (or dataset) given to prepare_data_loader
        self.state: dict[str, Any] = {}     # epochs(**state)
        self.entered = False            # the loop's epochs() request was answered
        self.scaler: Any = None         # the enabled GradScaler of epochs(**state): the engine's
        self.restore_state: dict | None = None   # the checkpoint's loop state, loaded at epochs()
        self.epoch = 0                  # the epoch the engine trains
        self.current_module: Any = None  # the VSW module of the batch in flight
        self.in_step = False            # a batch is out, its loss not back yet
        self.update_done = False        # the last backward ended a global iteration
        self.context: Any = None        # train.api.LoopContext, set by the actor
        self.reports: list[dict] = []   # report() calls since the engine last read them
        self.engine_context: dict = {}  # the engine's autocast and CUDA stream for this batch
        self.loop_context: Any = None   # (loop side) those contexts, entered for the forward

    def in_loop(self) -> bool:
        """Whether the caller is this run's loop (not the engine)."""
        return self.glet is not None and greenlet.getcurrent() is self.glet

    # ------------------------------------------------------------------ loop side
    def request(self, kind: str, payload: Any = None) -> Any:
        """(loop) Hand ``(kind, payload)`` to the engine and wait for its answer; a batch the
        engine handed along with its answer to the previous loss (:meth:`step`) is taken
        without a hand-over."""
        if kind == "batch" and self._handed is not None:
            (self.current_module, batch, self.engine_context), self._handed = self._handed, None
            self.in_step = True
            return batch
        held = torch_state.refusal()
        if held is not None:
            raise ValueError(f"{LOOP_NAME} made a jabasray call ({kind!r}) {held}; leave it first")
        self._loop_state = torch_state.swap(self._engine_state)
        try:
            reply = self.glet.parent.switch((kind, payload))
        except BaseException:
            # thrown in, not answered by advance (greenlet kills a suspended loop whose thread
            # ends): unwind on the loop's own state; the thrower's is put back at the end (_main)
            self._outer_state = torch_state.swap(self._loop_state)
            raise
        if isinstance(reply, _Raise):
            raise reply.exc
        return reply

    def _main(self, first: Any) -> tuple[str, Any]:
        final: tuple[str, Any]
        if isinstance(first, _Raise):
            final = ("abandoned", None)
        else:
            try:
                final = ("done", call_loop(self.fn, self.config))
            except _Abandoned:
                final = ("abandoned", None)
            except BaseException as e:  # noqa: BLE001 - handed to the engine, which raises it
                final = ("error", e)
        self.finished = True
        back, self._outer_state = self._outer_state or self._engine_state, None
        torch_state.swap(back)
        return final             # to the engine's advance (the greenlet's parent)

    # ------------------------------------------------------------------ engine side
    def advance(self, reply: Any = None) -> tuple[str, Any]:
        """Answer the pending request with ``reply`` (the first call starts the loop) and wait
        for the loop's next request; an error of the loop is raised here, naming the loop."""
        if self.finished:
            raise RuntimeError(f"{LOOP_NAME} has already returned")
        here = greenlet.getcurrent()
        if not self.started:
            self.started = True
            self._thread = threading.get_ident()
            self._loop_state = torch_state.fresh()
            self.glet = _LoopGreenlet(self)
        elif self._thread != threading.get_ident():
            raise RuntimeError(f"{LOOP_NAME} runs on the thread that started it; it cannot be "
                               f"advanced from another thread")
        if self.glet.parent is not here:
            self.glet.parent = here          # where the loop's requests and its end return to
        self._engine_state = torch_state.swap(self._loop_state)
        req = self.glet.switch(reply)        # the loop swapped the engine's state back in
        self.pending = req
        if req[0] == "error":
            exc = req[1]
            if isinstance(exc, (HookError, ValueError)):
                raise exc
            raise HookError.from_exception(LOOP_NAME, exc) from exc
        return req

    def until(self, kind: str) -> Any:
        """Let the loop run, answering what it asks on the way (:meth:`_answer`), until it
        requests ``kind``; return that request's payload (the request stays pending)."""
        while True:
            if self.pending is None:
                self.advance(None)
            elif self.pending[0] == kind:
                return self.pending[1]
            else:
                self.advance(self._answer(kind))

    def _answer(self, wanted: str) -> Any:
        """The engine's answer to the pending request on the way to ``wanted``."""
        kind, payload = self.pending
        if kind == "loader":
            from .api import PreparedLoader
            self.loader = payload
            return PreparedLoader(self, payload)
        if kind == "model":
            from .api import prepare_proxy
            self.model = payload
            self.proxy = prepare_proxy(self, payload)
            return self.proxy
        if kind == "optimizer":
            if self.optimizer is None:
                from .api import engine_optimizer
                self.optimizer = engine_optimizer(self, payload)
                self.loop_optimizers = payload if isinstance(payload, tuple) else (payload,)
            return payload
        if kind == "epochs":
            n, state = payload
            if self.total_epochs is not None and n != self.total_epochs:
                raise ValueError(f"epochs: {LOOP_NAME} asks for epochs({n}) but JobConfig.epochs "
                                 f"is {self.total_epochs}; make them equal")
            self.state = dict(state)
            self.entered = True
            self.scaler = loop_scaler(self.state)
            if self.scaler is not None:
                from .api import attach_scaler
                attach_scaler(self, self.scaler)
            if self.restore_state:
                self._load_extra(self.restore_state)
                self.restore_state = None
            return self.epoch
        if kind == "epoch_end":
            return self.epoch
        if kind == "loss":
            self.in_step = False
            return None
        if kind == "batch":
            raise ValueError(f"{LOOP_NAME} asked for a batch where the engine expects "
                             f"{wanted!r}; read batches only inside the epochs() loop")
        if kind == "done":
            raise ValueError(f"{LOOP_NAME} returned before training ended; its batches must come "
                             f"from the prepared loader inside `for epoch in epochs(n, ...)`")
        raise RuntimeError(f"{LOOP_NAME}: unexpected request {kind!r}")

    def grad_scaler(self) -> Any:
        """(engine side) The enabled ``torch.amp.GradScaler`` the loop passes to
        ``epochs(**state)``, or None: the engine scales the losses with it
        (:meth:`~jabasray.engine.iidp.IIDPWorker.set_grad_scaler`). Before the loop entered
        ``epochs()`` it runs up to that call, which stays pending (answered with the first batch)."""
        if self.entered:
            return self.scaler
        _, state = self.until("epochs")
        return loop_scaler(state)

    def step(self, module: Any, batch: Any) -> Any:
        """The engine's ``step_fn``: hand ``batch`` (for ``module``, the main VSW or a replica)
        to the loop and return the loss it calls ``backward()`` on."""
        ctx = engine_context(module)
        if self.pending is not None and self.pending[0] == "loss":
            # an earlier batch of this iteration: its loss is answered and this batch handed
            # along, so that the loop's next batch request takes it without a hand-over
            self.in_step, self.update_done = False, False
            self._handed = (module, batch, ctx)
            try:
                kind, payload = self.advance(None)
            finally:
                taken, self._handed = self._handed is None, None
            if taken:
                return self._loss(kind, payload)
        self.until("batch")
        self.current_module, self.in_step, self.update_done = module, True, False
        self.engine_context = ctx
        return self._loss(*self.advance(batch))

    def _loss(self, kind: str, payload: Any) -> Any:
        """The loss of the batch just handed to the loop: its next request must be its loss."""
        if kind != "loss":
            self.in_step = False
            raise ValueError(f"{LOOP_NAME} did not call backward() on the loss of a batch "
                             f"before {'asking for the next one' if kind == 'batch' else kind!r}: "
                             f"every batch of the prepared loader must be trained on")
        return payload

    def after_step(self, epoch_end: bool) -> None:
        """After the engine's update: let the loop finish its iteration (``optimizer.step()``
        returns True, its scheduler, its logging) up to its next batch request; at the end of
        the epoch end the loader's iteration too, up to ``epochs()``."""
        if self.pending is not None and self.pending[0] == "loss":
            self.in_step, self.update_done = False, True
            self.advance(None)
        if epoch_end:
            while self.pending is not None and self.pending[0] == "batch":
                self.advance(STOP)

    def finish(self) -> None:
        """Training is over: ``epochs()`` ends and the loop runs to its end."""
        try:
            while self.started and not self.finished and self.pending is not None:
                kind = self.pending[0]
                if kind == "epoch_end":
                    self.advance(None)
                elif kind == "batch":
                    self.advance(STOP)
                else:
                    break
        except Exception as e:  # noqa: BLE001 - after training: logged, not fatal
            log.warning("%s failed after training: %s", LOOP_NAME, e)
        self.abandon()

    def abandon(self) -> None:
        """Unwind the loop (its model is no longer the engine's). From another thread than the
        loop's it cannot be switched to: it stays suspended, as a blocked thread would."""
        if self.started and not self.finished:
            if self._thread != threading.get_ident():
                log.debug("%s not unwound: abandoned from another thread", LOOP_NAME)
                return
            try:
                self.advance(_Raise(_Abandoned()))
            except Exception:  # noqa: BLE001 - the loop is being thrown away
                pass

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict:
        """``state_dict()`` of every object given to ``epochs(**state)`` but the prepared model
        and optimizer (the engine checkpoints those): schedulers, scalers, other optimizers."""
        return {k: v.state_dict() for k, v in self.state.items() if not self._engine_owned(v)}

    def restore(self, loop_state: dict | None) -> None:
        if not loop_state:
            return
        if self.state:
            self._load_extra(loop_state)
        else:
            self.restore_state = loop_state   # loaded when the loop enters epochs()

    def _load_extra(self, loop_state: dict) -> None:
        for k, sd in loop_state.items():
            if k not in self.state:
                raise ValueError(f"epochs: the checkpoint holds state {k!r} but epochs() got "
                                 f"{sorted(self.state)}; pass the same keyword arguments")
            self.state[k].load_state_dict(sd)

    def _engine_owned(self, obj: Any) -> bool:
        return (obj is self.proxy or obj is self.model or obj is self.optimizer
                or any(obj is o for o in self.loop_optimizers))


def loop_scaler(state: dict) -> Any:
    """The enabled ``torch.amp.GradScaler`` among ``epochs(**state)``'s objects, or None; two
    are a one-line ValueError."""
    found = [k for k, v in state.items() if isinstance(v, torch.amp.GradScaler) and v.is_enabled()]
    if len(found) > 1:
        raise ValueError(f"epochs: at most one enabled GradScaler (the engine scales every loss "
                         f"with one scale), got {', '.join(found)}")
    return state[found[0]] if found else None


# each VSW module's first parameter (walking a module's parameters costs more than the switch)
_first_param: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Parameter]" = weakref.WeakKeyDictionary()


def engine_context(module: Any) -> dict:
    """(engine side) What the engine's thread-local state says about the forward of a batch
    for ``module``: its autocast (device type, dtype) where enabled and, on CUDA, its current
    stream. The loop enters the same before the user's forward (:func:`enter_engine_context`),
    since autocast and the current stream are each side's own (:mod:`.torch_state`)."""
    ctx: dict = {}
    param = _first_param.get(module) if isinstance(module, torch.nn.Module) else None
    if param is None:
        try:
            param = next(module.parameters())
        except (StopIteration, AttributeError):
            return ctx
        _first_param[module] = param
    dev = param.device                   # (the same Parameter after .to(): its data is moved)
    if torch.is_autocast_enabled(dev.type):
        ctx["autocast"] = (dev.type, torch.get_autocast_dtype(dev.type))
    if dev.type == "cuda":
        ctx["stream"] = torch.cuda.current_stream(dev)
    return ctx


def enter_engine_context(run: "LoopRun") -> None:
    """(loop side) Enter the engine's autocast and CUDA stream for the batch just received;
    left before the loss goes back (:func:`leave_engine_context`)."""
    import contextlib

    leave_engine_context(run)
    ctx = run.engine_context
    if not ctx:
        return
    stack = contextlib.ExitStack()
    if "stream" in ctx:
        stack.enter_context(torch.cuda.stream(ctx["stream"]))
    if "autocast" in ctx:
        device_type, dtype = ctx["autocast"]
        stack.enter_context(torch.autocast(device_type, dtype=dtype))
    run.loop_context = stack


def leave_engine_context(run: "LoopRun") -> None:
    stack, run.loop_context = run.loop_context, None
    if stack is not None:
        stack.close()


# ---------------------------------------------------------------------- the process's run
def active() -> "LoopRun | None":
    return _active


def start(fn: Callable, config: Any, total_epochs: int | None) -> LoopRun:
    """A new run as this process's active one (the previous one, if any, is abandoned)."""
    global _active
    with _process_lock:
        old, _active = _active, LoopRun(fn, config, total_epochs)
        run = _active
    if old is not None:
        old.abandon()
    return run


def set_active(run: "LoopRun | None") -> "LoopRun | None":
    """Make ``run`` the active run without abandoning the previous one (returned)."""
    global _active
    with _process_lock:
        old, _active = _active, run
    return old


def current_run() -> "LoopRun | None":
    """(loop side) The run whose loop is calling, else None."""
    return getattr(greenlet.getcurrent(), "loop_run", None)


def user_run(what: str) -> LoopRun:
    """(loop side) The calling loop's run, else a one-line ValueError naming ``what``."""
    run = current_run()
    if run is None:
        raise ValueError(f"{what} must be called inside {LOOP_NAME} run by "
                         f"jabasray.train.JabasTorchTrainer(...).fit()")
    return run


# ---------------------------------------------------------------------- backward routing
_torch_backward = torch.Tensor.backward


def _loop_backward(self: torch.Tensor, gradient: Any = None, retain_graph: Any = None,
                   create_graph: bool = False, inputs: Any = None) -> None:
    run = current_run()
    if run is None or not run.in_step:
        return _torch_backward(self, gradient, retain_graph, create_graph, inputs)
    if gradient is not None or create_graph or inputs is not None:
        raise ValueError("loss.backward(): jabasray back-propagates the batch's loss itself; "
                         "gradient=, create_graph= and inputs= are not supported in the loop")
    leave_engine_context(run)
    if self.dim() != 0:
        raise ValueError(f"loss.backward(): the loss must be a scalar (a per-sample mean), got "
                         f"shape {tuple(self.shape)}")
    run.request("loss", self)


_torch_scale = torch.amp.GradScaler.scale


def _loop_scale(self: Any, outputs: Any) -> Any:
    """``GradScaler.scale`` of a scaler the engine does not know (the one given to ``epochs()``
    has the loop-side methods of :func:`~.api.attach_scaler`): refused in a loop's step, where
    the engine back-propagates the loss and would not unscale the gradient."""
    run = current_run()
    if run is not None and run.in_step and self.is_enabled():
        raise ValueError("GradScaler: an enabled scaler must be passed to epochs(..., scaler=scaler) "
                         "before training, so that jabasray scales, unscales and steps with it")
    return _torch_scale(self, outputs)


def install_backward() -> None:
    """Route ``Tensor.backward`` of loops to the engine, and refuse an enabled GradScaler the
    engine does not know in a loop's step (idempotent, process-wide; everything else keeps
    torch's own)."""
    if torch.Tensor.backward is not _loop_backward:
        torch.Tensor.backward = _loop_backward
    if torch.amp.GradScaler.scale is not _loop_scale:
        torch.amp.GradScaler.scale = _loop_scale
