"""Exceptions that user-facing commands turn into one line (no torch, no ray imports)."""
from __future__ import annotations


class JobFailed(RuntimeError):
    """A training job stopped for a reason that is not the user's input (e.g. GPU actors kept
    dying); the message is one line saying what failed and where the last checkpoint is."""
