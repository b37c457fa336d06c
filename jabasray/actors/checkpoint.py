"""Epoch checkpoints of a JABAS run: the driver's state (JSON) + the worker state (torch).

Layout: ``<run>/checkpoints/epoch_<NNNN>/{driver.json, worker.pt}`` where NNNN is the number of
completed epochs. A checkpoint is written into a temporary folder and renamed into place, so a
crash never leaves a half-written one; ``latest_checkpoint`` only sees complete ones.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..serialization import JsonMixin
from ..types import ClusterSpec
from .metrics import MetricsHistory

log = logging.getLogger(__name__)

_NAME = re.compile(r"^epoch_(\d{4,})$")


@dataclass
class DriverState(JsonMixin):
    """What the driver needs to continue a run at an epoch boundary."""

    epochs_done: int                          # completed epochs
    iteration: int                            # global iterations done (for LR warm-up)
    cluster: ClusterSpec                      # GPUs still usable (failed pairs removed)
    allocation: dict[str, int]                # allocation for the next epoch
    adaptive: dict = field(default_factory=dict)                  # AdaptiveBatchController state
    forecast: list[float] = field(default_factory=list)           # prediction for the next epoch
    metrics: MetricsHistory = field(default_factory=MetricsHistory)
    job_config: dict = field(default_factory=dict)                # JobConfig.to_dict() of the run


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder (Ray Train's ``Checkpoint.path`` shape)."""

    path: Path

    @property
    def epochs_done(self) -> int:
        return int(_NAME.match(self.path.name).group(1))

    def load_driver_state(self) -> DriverState:
        return DriverState.load(self.path / "driver.json")

    def load_worker_state(self) -> dict[str, Any]:
        import torch
        return torch.load(self.path / "worker.pt", map_location="cpu", weights_only=False)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, state: DriverState, worker_state: dict[str, Any],
                    keep: int = 2) -> Checkpoint:
    """Write ``epoch_<state.epochs_done>`` atomically; keep only the newest ``keep`` ones."""
    import torch

    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"epoch_{state.epochs_done:04d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp_"))
    try:
        torch.save(worker_state, tmp / "worker.pt")
        state.save(tmp / "driver.json")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old.path, ignore_errors=True)
    log.debug("checkpoint %s written", final)
    return Checkpoint(final)


def list_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [Checkpoint(p) for p in root.iterdir()
             if p.is_dir() and _NAME.match(p.name) and (p / "driver.json").exists()
             and (p / "worker.pt").exists()]
    return sorted(found, key=lambda c: c.epochs_done)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    cps = list_checkpoints(run_dir)
    return cps[-1] if cps else None
