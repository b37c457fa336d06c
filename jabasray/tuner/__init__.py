"""Ray Tune integration: packed trials and packed Hyperband (Pack paper, section 5).

* :func:`hyperband_brackets` / :func:`hyperband_schedule`: Li et al.'s bracket arithmetic.
* :class:`TrainingSpec`: how ONE configuration trains (model, optimizer, batch size, data,
  metric as functions of the config).
* :class:`PackedHyperbandTuner`: packed Hyperband; ``fit()`` returns a ``ray.tune.ResultGrid``
  with one row per sampled configuration (a :class:`PackedResultGrid`, built directly from the
  recorded results).
* :func:`make_trainable`: the same spec as an ordinary one-configuration Tune trainable (for
  Ray Tune's own schedulers, e.g. the unpacked ``HyperBandScheduler`` baseline).

Ray is imported lazily: the bracket arithmetic and the spec work without it.
"""
from jabasray.tuner.brackets import Bracket, Rung, hyperband_brackets, hyperband_schedule

__all__ = ["packed", "SimilaritySearch", "PackedHyperband", "PackedJob", "hyperband_brackets", "hyperband_schedule", "Bracket", "Rung", "TrainingSpec",
           "PackedHyperbandTuner", "HyperbandConfig", "PackedHyperbandResult", "ConfigRecord",
           "make_trainable", "search_space_from_param_space", "PackedResultGrid", "build_result_grid"]


def __getattr__(name: str):
    if name in ("TrainingSpec",):
        from jabasray.tuner import training
        return getattr(training, name)
    if name in ("PackedHyperbandTuner", "HyperbandConfig", "PackedHyperbandResult", "ConfigRecord"):
        from jabasray.tuner import packed_hyperband
        return getattr(packed_hyperband, name)
    if name in ("PackedResultGrid", "build_result_grid"):
        from jabasray.tuner import result_grid
        return getattr(result_grid, name)
    if name in ("packed", "SimilaritySearch", "PackedHyperband", "PackedJob"):
        from jabasray.tuner import packed_trials as _packed
        return getattr(_packed, name)
    if name == "make_trainable":
        from jabasray.tuner.trainable import make_trainable
        return make_trainable
    if name == "search_space_from_param_space":
        from jabasray.tuner.space import search_space_from_param_space
        return search_space_from_param_space
    raise AttributeError(f"module 'jabasray.tuner' has no attribute {name!r}")
