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
