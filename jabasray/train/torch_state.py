"""torch's thread-local state, kept apart for two coroutines that share one OS thread.

The user's loop and the engine take turns on one thread (:mod:`.bridge`). torch keeps part of
its state per thread - what a ``with`` block of one side may leave set while the other side
runs: the loop asks for its next batch inside ``torch.no_grad()`` or an ``autocast`` block,
calls ``loss.backward()`` inside ``autocast`` or ``saved_tensors_hooks``, wraps its loop in
``with torch.device(...)``; the engine hands a batch over from inside its own autocast. Each
side therefore sees only its own state: at every switch :func:`swap` captures the state of the
side that stops (:class:`TorchState`) and installs that of the side that resumes, setting only
what differs, so the common switch (nothing differs) costs a few reads.

Kept per side (torch's per-thread state a training loop can change):

* grad mode; autograd's multithreading switch (``set_multithreading_enabled``);
* autocast: per device type (:data:`AUTOCAST_DEVICES`) enabled and dtype, the cast cache
  switch and the nesting depth (the cache of cast weights is cleared when a side leaves its
  outermost autocast, as on its own thread);
* the ``__torch_function__`` mode stack (``with torch.device(...)``, ``set_default_device``);
* the default ``saved_tensors_hooks`` stack (``save_on_cpu``, activation offloading);
* CUDA (once initialised): the current device and its current stream.

Not kept, refused instead by the loop's side (:func:`refusal`): inference mode and
``__torch_dispatch__`` modes at a hand-over (torch offers no setter for the first; the second
holds infrastructure modes); neither can train a batch. Process-wide already, as with threads:
anomaly detection (``set_detect_anomaly``), the default dtype, RNGs, deterministic algorithms.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

_C, _AG = torch._C, torch._C._autograd

#: device types whose autocast state is kept per side
AUTOCAST_DEVICES: tuple[str, ...] = ("cpu", "cuda")


# One side's state (module notes), a plain tuple (switches are hot):
# (grad, multithreading, nesting, autocast, function_modes, saved_hooks, cuda) where
# ``autocast`` is None for the thread's baseline (no autocast block open, nothing enabled: the
# dtypes are torch's defaults), else ``(((enabled, dtype) per AUTOCAST_DEVICES), cache_enabled)``;
# ``cuda`` is None (not initialised) or ``(device index, current torch.cuda.Stream)``.
TorchState = tuple

_is_grad, _set_grad = _C.is_grad_enabled, _C._set_grad_enabled
_is_mt, _set_mt = _C._is_multithreading_enabled, _C._set_multithreading_enabled
_inc, _dec = _C.autocast_increment_nesting, _C.autocast_decrement_nesting
_any_autocast = _C._is_any_autocast_enabled
_n_modes, _pop_mode, _push_mode = (_C._len_torch_function_stack, _C._pop_torch_function_stack,
                                   _C._push_on_torch_function_stack)
_top_hooks, _pop_hooks, _push_hooks = (_AG._top_saved_tensors_default_hooks,
                                       _AG._pop_saved_tensors_default_hooks,
                                       _AG._push_saved_tensors_default_hooks)


def _autocast_details() -> tuple:
    return (tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES),
            torch.is_autocast_cache_enabled())


def capture() -> TorchState:
    """The current side's state; its mode and hook stacks are taken off the thread (the
    other side's are installed next, by :func:`apply`)."""
    nesting = _inc() - 1     # torch reads the autocast nesting depth only by moving it
    _dec()
    autocast = _autocast_details() if nesting or _any_autocast() else None
    modes: tuple = ()
    if _n_modes():
        popped = []
        while _n_modes():
            popped.append(_pop_mode())
        modes = tuple(reversed(popped))
    hooks: tuple = ()
    if _top_hooks(True) is not None:
        popped = []
        while (top := _top_hooks(True)) is not None:
            popped.append(top)
            _pop_hooks()
        hooks = tuple(reversed(popped))
    cuda = None
    if torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        cuda = (dev, torch.cuda.current_stream(dev))
    return (_is_grad(), _is_mt(), nesting, autocast, modes, hooks, cuda)


def apply(target: TorchState, current: TorchState) -> None:
    """Install ``target`` on this thread, whose state was ``current`` (just captured)."""
    grad, mt, nesting, autocast, modes, hooks, cuda = target
    if grad != current[0]:
        _set_grad(grad)
    if mt != current[1]:
        _set_mt(mt)
    if autocast != current[3]:
        per_device, cache = autocast if autocast is not None else _baseline()
        for d, (enabled, dtype) in zip(AUTOCAST_DEVICES, per_device):
            torch.set_autocast_dtype(d, dtype)
            torch.set_autocast_enabled(d, enabled)
        torch.set_autocast_cache_enabled(cache)
    if nesting != current[2]:
        for _ in range(nesting - current[2]):
            _inc()
        for _ in range(current[2] - nesting):
            _dec()
    for mode in modes:
        _push_mode(mode)
    for pack, unpack in hooks:
        _push_hooks(pack, unpack)
    if cuda is not None or current[6] is not None:
        # a side that last ran before CUDA was initialised had a new thread's device and stream
        want = cuda if cuda is not None else (0, torch.cuda.default_stream(0))
        have = current[6]
        if have is None or want[0] != have[0] or want[1] != have[1]:
            torch.cuda.set_device(want[0])
            torch.cuda.set_stream(want[1])


def swap(target: TorchState) -> TorchState:
    """Install ``target``; returns the state it replaced (module notes)."""
    current = capture()
    if current != target or current[4] or current[5]:
        # (capture took the mode and hook stacks off the thread: they go back even when equal)
        apply(target, current)
    return current


_BASELINE: list = []


def _baseline() -> tuple:
    """The autocast details of a thread that never entered autocast (read once, on a new thread)."""
    if not _BASELINE:
        t = threading.Thread(target=lambda: _BASELINE.append(_autocast_details()), name="torch-state")
        t.start()
        t.join()
    return _BASELINE[0]


def fresh() -> TorchState:
    """The state of a new thread of this process: what the loop starts with, as it did on a
    thread of its own (grad on, no autocast, no modes or hooks; CUDA: the current device's
    default stream)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(capture()), name="torch-state")
    t.start()
    t.join()
    return out[0]


def refusal() -> str | None:
    """(loop side, at a hand-over) What the loop holds that cannot be kept apart from the
    engine (module notes), as the start of a one-line error; None when nothing."""
    if torch.is_inference_mode_enabled():
        return "inside torch.inference_mode()"
    if _C._len_torch_dispatch_stack():
        return "inside a TorchDispatchMode"
    return None
