"""The JABAS loop on a simulated clock: the driver's own planners and policies decide, a time model
and a convergence model stand in for the GPUs and the training; no Ray, no torch."""
