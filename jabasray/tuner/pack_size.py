"""How many trials to pack per device when the user does not say: as many as fit its memory.

Pack (section 3, "Memory"; section 5.2) packs configurations "until the device runs out of
memory": the memory of a packed model is the sum of its members' (section 3: "when packing two
models the GPU memory usage is the sum of memory usage of two models"), bounded by the peak of
a training step. So the pack size K of a device is

    K = min(cap, max(1, floor(budget / m_max)))

with ``m_max`` the peak bytes of one member's training step at the largest configuration the
search may produce, and ``budget = fraction x total memory`` of the device (the rest is left to
the CUDA context, the allocator's fragmentation and the shared input stream).

``m_max`` comes from ``TrainingSpec.memory_fn`` when the user gives it (the maximum over the
probe configurations), else from a measurement on one GPU of the type the trials run on, in a
Ray task that holds that GPU (:func:`measure_member_bytes`): the member is built, one training
step at its batch size runs, and ``torch.cuda.max_memory_allocated`` gives the peak.

Which configurations are probed (:func:`probe_configs`): every key at the largest value its
domain can take (a member's memory grows with batch size and with any width-like numeric
hyper-parameter), and each categorical value of each categorical key once (an optimizer with
more state, another activation), the other keys held at their largest/first value. This is
not Pack's own procedure -- the paper measures the packed models it trains -- but the pack size
must be fixed before Tune starts any trial (each trial reserves ``1 / K`` of a device), so the
worst member is bounded up front.

On a CPU device memory does not bound the pack (host memory dwarfs these models and the
compute is shared), so the default stays :data:`CPU_MEMBERS`.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from jabasray.validation import check_float, check_int

log = logging.getLogger(__name__)

CPU_MEMBERS = 8          # members per CPU "device" when not given
MAX_MEMBERS = 64         # the cap on a GPU: beyond it the packed step stops gaining (Pack, Fig. 4)
MEMORY_FRACTION = 0.8    # of the device's total memory


def members_that_fit(member_bytes: float, total_bytes: float, fraction: float = MEMORY_FRACTION,
                     cap: int = MAX_MEMBERS) -> int:
    """``min(cap, max(1, floor(fraction * total_bytes / member_bytes)))`` (module docstring)."""
    check_float("member_bytes", member_bytes, min_value=0.0, min_exclusive=True)
    check_float("total_bytes", total_bytes, min_value=0.0, min_exclusive=True)
    check_float("fraction", fraction, min_value=0.0, min_exclusive=True)
    if fraction > 1.0:
        raise ValueError(f"fraction must be a number in (0.0, 1.0], got {fraction}")
    check_int("cap", cap, min_value=1)
    return min(cap, max(1, math.floor(fraction * total_bytes / member_bytes)))


def probe_configs(param_space: Mapping[str, Any]) -> list[dict]:
    """The configurations whose memory bounds every member's (module docstring): the base
    config (each key at its largest value, categoricals at their first), then one config per
    other categorical value of each categorical key. Constants are kept; a nested dict or a
    custom domain is passed through as it is (it has no largest value)."""
    from .space import listed_values, upper_value

    base: dict = {}
    categorical: dict[str, list] = {}
    for key, spec in param_space.items():
        values = listed_values(spec)
        if values is None:
            values = [upper_value(spec)]
        if not values:
            raise ValueError(f"param_space[{key!r}] has no value to probe")
        if len(values) > 1 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            base[key] = max(values)
        else:
            base[key] = values[0]
            if len(values) > 1:
                categorical[key] = values[1:]
    probes = [dict(base)]
    for key, others in categorical.items():
        probes += [{**base, key: v} for v in others]
    return probes


def measure_member_bytes(spec: Any, config: Mapping[str, Any], device: str) -> int:
    """Peak bytes of one member's training step on a CUDA ``device`` (module docstring): the
    member's model, optimizer state, one batch of its size and the step's activations and
    gradients, over what the device held before."""
    import torch
    from torch.utils.data import default_collate

    from .training import build_member, cached_data

    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device to measure a member's memory, got {device!r}")
    torch.cuda.set_device(dev)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    train, _ = cached_data(spec)
    size = spec.batch_size_of(config)
    idx = [i % len(train) for i in range(size)]
    x, y = (t.to(dev) for t in default_collate([train[i] for i in idx])[:2])
    model, opt = build_member(replace(spec, device=str(dev)), dict(config))
    for _ in range(2):                      # the second step holds the optimizer's state too
        opt.zero_grad(set_to_none=False)
        spec.loss_fn(model(x), y).backward()
        opt.step()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    del model, opt, x, y
    torch.cuda.empty_cache()
    return int(peak)


def _measure_on_a_gpu(spec_blob: bytes, probes: list[dict]) -> tuple[int, int, str]:
    """Ray task body (it holds one GPU): ``(max peak bytes over probes -- 0 without probes --,
    the device's total bytes, its name)``."""
    import cloudpickle
    import torch

    spec = cloudpickle.loads(spec_blob)
    peak = max((measure_member_bytes(spec, c, "cuda:0") for c in probes), default=0)
    props = torch.cuda.get_device_properties(0)
    return peak, int(props.total_memory), props.name


def _remote_measure(spec_blob: bytes, probes: list[dict]) -> tuple[int, int, str]:
    """:func:`_measure_on_a_gpu` in a Ray task holding one GPU (the driver of a sweep may have
    none; trials run on the cluster's GPUs)."""
    import ray

    if not ray.is_initialized():
        raise ValueError("members_per_device: give it, or call ray.init() before packed() so that "
                         "one member's memory can be measured on a GPU")
    task = ray.remote(num_gpus=1, num_cpus=0)(_measure_on_a_gpu)
    return ray.get(task.remote(spec_blob, probes), timeout=600)


def choose_members_per_device(spec: Any, param_space: Mapping[str, Any] | None, gpu: bool,
                              measure: Callable[[bytes, list[dict]], tuple[int, int, str]] | None = None) -> int:
    """``members_per_device`` when the user gave none: :data:`CPU_MEMBERS` on CPU; on a GPU
    :func:`members_that_fit` of the worst probe configuration's peak -- from
    ``spec.memory_fn`` when given, else measured -- and the GPU's total memory, both from a Ray
    task holding one GPU (``measure``: that task, replaceable in tests)."""
    import cloudpickle

    if not gpu:
        return CPU_MEMBERS
    if param_space is None:
        raise ValueError("members_per_device must be given when param_space is not (the pack "
                         "size is chosen from the memory of the space's largest configuration)")
    probes = probe_configs(param_space)
    use_fn = spec.memory_fn is not None
    measured, total, name = (measure or _remote_measure)(cloudpickle.dumps(spec), [] if use_fn else probes)
    peak = max(float(spec.memory_fn(c)) for c in probes) if use_fn else float(measured)
    source = "TrainingSpec.memory_fn" if use_fn else "measured"
    k = members_that_fit(peak, total)
    log.info("members_per_device=%d chosen from memory: the largest of %d probe configuration(s) "
             "needs %.1f MiB (%s) of the %.1f GiB of a %s, %.0f%% of which is the budget",
             k, len(probes), peak / 2 ** 20, source, total / 2 ** 30, name, MEMORY_FRACTION * 100)
    return k


__all__: Sequence[str] = ["members_that_fit", "probe_configs", "measure_member_bytes",
                          "choose_members_per_device", "CPU_MEMBERS", "MAX_MEMBERS", "MEMORY_FRACTION"]
