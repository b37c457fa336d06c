"""Ray Tune integration: packed training inside Tune's own API (Pack paper, sections 3 and 5).

* :func:`packed`: a Tune class Trainable from a :class:`TrainingSpec`; every configuration is
  its own Tune trial whose ``step()`` is one unit, checkpointing only when Tune asks, and the
  trials of one device train as ONE packed model (a per-device packing coordinator actor,
  :mod:`jabasray.tuner.coordinator`).
* :func:`SimilaritySearch`: a Tune searcher that emits similar configurations together
  (normalised kNN order; any Tune domain) where the sweep packs.
* :func:`trains_alone`: whether a trainable from :func:`packed` trains every trial alone.
* :class:`PackedHyperband`: packed Hyperband on Tune's ``HyperBandScheduler``.
* :func:`coordinator_stats`: what the packing coordinators did (units, packs, time).
* :func:`hyperband_brackets` / :func:`hyperband_schedule`: Hyperband bracket arithmetic, Li et
  al.'s (``floor`` halving) or Tune's (``halving="ceil"``).
* :func:`make_trainable`: the same spec as an ordinary unpacked function trainable.

Ray is imported lazily: the bracket arithmetic and the spec work without it.
"""
from jabasray.tuner.brackets import Bracket, Rung, hyperband_brackets, hyperband_schedule

__all__ = ["packed", "trains_alone", "SimilaritySearch", "PackedHyperband", "PackedJob", "coordinator_stats",
           "TrainingSpec",
           "make_trainable", "hyperband_brackets", "hyperband_schedule", "Bracket", "Rung"]


def __getattr__(name: str):
    if name == "TrainingSpec":
        from jabasray.tuner.training import TrainingSpec
        return TrainingSpec
    if name in ("packed", "trains_alone", "SimilaritySearch", "PackedHyperband", "PackedJob", "coordinator_stats"):
        from jabasray.tuner import packed_trials
        return getattr(packed_trials, name)
    if name == "make_trainable":
        from jabasray.tuner.trainable import make_trainable
        return make_trainable
    raise AttributeError(f"module 'jabasray.tuner' has no attribute {name!r}")
