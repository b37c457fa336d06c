"""The JABAS loop on a simulated clock (no Ray, no torch): the driver's own planners and
policies decide, a time model (the iteration-time model from profiles) and a convergence model
(gradient statistics) stand in for the GPUs.

* :mod:`.loop`: :func:`simulate` one job under one policy; :mod:`.policies`: JABAS, static,
  SimiGrad, Pollux, Pollux-AS; :mod:`.baselines`: equal-local-batch plans and goodput.
* :mod:`.replay`: a recorded run re-simulated beside what ran.
* :mod:`.clusters`: the JABAS paper's clusters (Table 1) at any size; profiles of unmeasured types.
* :mod:`.jabas_profiles`: the JABAS quick start's published V100/P100 profiles.
* :mod:`.convergence`: progress per sample, the metric and the two groups' similarity at a batch
  from gradient statistics (Pollux's traces, or runs recorded by benchmarks/record_convergence.py).
"""
