"""Keep your own training loop (Ray Train's style) under JABAS's adaptive batching, virtual
stream workers and re-placement: ``JabasTorchTrainer(train_loop_per_worker, ...).fit()``, and
inside the loop ``prepare_data_loader``, ``prepare_model``, ``prepare_optimizer``,
``epochs``, ``report``, ``get_context`` (:mod:`.api`; how the loop and the GPU actor take
turns: :mod:`.bridge`)."""
from .api import (LoopContext, epochs, get_context, prepare_data_loader, prepare_model,
                  prepare_optimizer, report)
from .trainer import JabasTorchTrainer

__all__ = ["JabasTorchTrainer", "LoopContext", "epochs", "get_context", "prepare_data_loader",
           "prepare_model", "prepare_optimizer", "report"]
