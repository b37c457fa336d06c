"""Exceptions that user-facing commands turn into one line (no torch, no ray imports)."""
from __future__ import annotations

import re
from typing import Any, Callable


class JobFailed(RuntimeError):
    """A training job stopped for a reason that is not the user's input (e.g. GPU actors kept
    dying); the message is one line saying what failed and where the last checkpoint is."""


class StorageUnavailable(JobFailed):
    """The run's storage cannot be used where the driver runs: unreachable, or a local folder
    that is not shared with the node the driver (re)started on. One line; the run's completed
    work stays where it was committed."""


class DatasetMismatch(ValueError):
    """``dataset_fn`` built a different dataset on some GPU actor than the probe did (one line
    naming the node): samples would be duplicated or missed."""


class HookError(ValueError):
    """A user hook (``loss_fn``, ``step_fn``, ``eval_fn``, ``collate_fn``, ``dataset_fn``, ...)
    raised. The message is one line naming the hook and the original error; ``traceback`` holds
    the original traceback as text, so it survives pickling across Ray (where ``__cause__`` and
    traceback objects do not); in the process that caught it the original is also chained as
    ``__cause__``."""

    def __init__(self, hook: str, error: str, traceback: str = "") -> None:
        super().__init__(f"{hook} raised {error}")
        self.hook, self.error, self.traceback = hook, error, traceback
        frames = user_frames(traceback)
        if frames:   # printed under the one line (PEP 678 notes): where the user's code failed
            self.__notes__ = [frames]

    @classmethod
    def from_exception(cls, hook: str, exc: BaseException) -> "HookError":
        import traceback as tb

        first = str(exc).splitlines()[0] if str(exc) else ""
        error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        return cls(hook, error, "".join(tb.format_exception(type(exc), exc, exc.__traceback__)))

    def __reduce__(self):   # keeps hook, error and traceback text across pickling
        return (type(self), (self.hook, self.error, self.traceback))

    def __str__(self) -> str:
        return f"{self.hook} raised {self.error}"


class HookCall:
    """A user hook that, when it raises, raises :class:`jabasray.errors.HookError` naming the
    hook (``name``) with the original error chained and its traceback kept as text. Errors that
    already are HookErrors (a hook calling another) pass through unchanged. Identities and
    profile-cache keys are those of ``fn`` (``job_identity.callable_identity`` and the
    profiler's ``callable_fingerprint`` look through the wrapper)."""

    def __init__(self, name: str, fn: Callable) -> None:
        self.name, self.fn = name, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except HookError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the hook's name
            raise HookError.from_exception(self.name, e) from e

    def __getattr__(self, name: str) -> Any:   # e.g. a loss module's attributes
        if name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)


def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are not the user's: the standard library, jabasray, and the
    installed packages it runs the user's code through (found without importing them)."""
    import importlib.util
    import os
    import sysconfig

    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    for name in ("jabasray", "torch", "ray", "cloudpickle", "pyarrow"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.add(os.path.dirname(spec.origin))
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line \d+, in ')


def user_frames(traceback_text: str, library_dirs: tuple[str, ...] | None = None) -> str:
    """The frames of ``traceback_text`` (Python's formatted traceback) that are the user's
    code: every ``File ...`` entry, with its source lines, whose file is outside
    ``library_dirs`` (default :func:`_library_dirs`). Empty when there are none."""
    import os

    dirs = _library_dirs() if library_dirs is None else library_dirs
    kept: list[str] = []
    keep = False
    for line in traceback_text.splitlines():
        m = _FRAME.match(line)
        if m:
            path = os.path.realpath(m.group("path"))
            keep = not path.startswith(dirs) and not m.group("path").startswith("<frozen ")
        elif not line.startswith("    "):   # the header, the exception lines: not a frame
            keep = False
        if keep:
            kept.append(line)
    return ("your code, where it failed:\n" + "\n".join(kept)) if kept else ""


class NodesGone(RuntimeError):
    """A placement found Ray nodes it was pinned to no longer alive (the driver re-plans on the
    live cluster). ``ray_node_ids``: the ids that are gone."""

    def __init__(self, message: str, ray_node_ids: list[str]) -> None:
        super().__init__(message)
        self.ray_node_ids = list(ray_node_ids)


class PlacementTimeout(RuntimeError):
    """The resources of a placement did not appear within the placement timeout; the message
    (one line) names what is missing and where."""


class RendezvousFailed(RuntimeError):
    """A GPU actor could not join its process group (the driver's rendezvous store or a peer
    did not answer in time: a closed port, a wrong network interface); one line. The driver
    treats it as a failure of that actor."""


class PreflightFailed(RuntimeError):
    """The pre-flight check found a GPU node that cannot open a TCP connection to the driver's
    rendezvous address, or no port of the range to listen on; one line naming the node and port."""
