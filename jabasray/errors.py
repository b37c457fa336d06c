"""Exceptions that user-facing commands turn into one line (no torch, no ray imports)."""
from __future__ import annotations


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
