"""Keep your own training loop (Ray Train's style) under JABAS's adaptive batching, virtual
stream workers and re-placement: ``JabasTorchTrainer(train_loop_per_worker, ...).fit()``, and
inside the loop ``prepare_data_loader``, ``prepare_model``, ``prepare_optimizer``,
``epochs``, ``report``, ``get_context`` (:mod:`.api`; how the loop and the GPU actor take
turns: :mod:`.bridge`). ``JobConfig`` is here too, so that a port of a Ray Train script
imports what it changes from one place."""
from ..config import JobConfig
from .api import (LoopContext, epochs, get_context, prepare_data_loader, prepare_model,
                  prepare_optimizer, report)
from .trainer import JabasTorchTrainer

__all__ = ["JabasTorchTrainer", "JobConfig", "LoopContext", "epochs", "get_context", "prepare_data_loader",
           "prepare_model", "prepare_optimizer", "report"]
