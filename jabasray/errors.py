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
