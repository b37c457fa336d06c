"""Grouping keys of the pack: which members can run as one batched computation and share one
fused optimizer update (architecture, structure, activations, optimizer kind); the memory model
``pack_opt`` uses."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["architecture_key", "structure_key", "activation_signature", "batchable", "optimizer_kind",
           "estimate_memory_bytes", "ACTIVATION_TYPES"]


def architecture_key(model: nn.Module) -> tuple:
    """Hashable key: members with equal keys are batched together with ``vmap``.

    The key is (class, repr, parameter names/shapes/dtypes). ``repr`` lists every sub-module
    with its arguments (layer sizes, activation classes), so it separates architectures whose
    parameters have the same shapes but whose ``forward`` differs (e.g. ReLU vs Tanh MLPs).
    """
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters())
    return (type(model).__module__, type(model).__qualname__, repr(model), params)


#: Elementwise activation modules that may differ between members of ONE batched group (the
#: folded execution applies each member's own activation to its rows).
ACTIVATION_TYPES = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.GELU, nn.ELU, nn.SiLU,
                    nn.Softplus, nn.Mish, nn.Hardtanh, nn.ReLU6, nn.CELU, nn.SELU)


def structure_key(model: nn.Module) -> tuple:
    """:func:`architecture_key` with every elementwise activation leaf replaced by a
    placeholder: members equal under this key differ at most in their activations."""
    mods = tuple((n, "ACT" if isinstance(m, ACTIVATION_TYPES)
                  else (type(m).__qualname__, m.extra_repr()))
                 for n, m in model.named_modules())
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters())
    return (type(model).__module__, type(model).__qualname__, mods, params)


def activation_signature(model: nn.Module) -> tuple:
    return tuple((n, repr(m)) for n, m in model.named_modules() if isinstance(m, ACTIVATION_TYPES))


def batchable(model: nn.Module) -> bool:
    """Stacking (vmap or folded layers) needs a buffer-free, deterministic module."""
    if any(True for _ in model.buffers()):
        return False
    return not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())


def optimizer_kind(optimizer: torch.optim.Optimizer, model: nn.Module) -> str:
    """``"sgd"``/``"sgd_momentum"``/``"sgd_nesterov"``, ``"adam"``, ``"adagrad"`` when the fused
    update reproduces it, else ``"generic"``.

    Fusing needs one parameter group holding exactly ``model.parameters()`` in order, float
    hyperparameters and none of the flags our fused forms do not implement.
    """
    if len(optimizer.param_groups) != 1:
        return "generic"
    g = optimizer.param_groups[0]
    if [id(p) for p in g["params"]] != [id(p) for p in model.parameters()]:
        return "generic"
    if g.get("maximize") or g.get("differentiable") or g.get("capturable") or g.get("fused"):
        return "generic"
    if any(isinstance(v, torch.Tensor) for v in g.values() if not isinstance(v, list)):
        return "generic"
    t = type(optimizer)
    if t is torch.optim.SGD:   # split by structure so one group needs one fused update
        return "sgd" if g["momentum"] == 0 else ("sgd_nesterov" if g["nesterov"] else "sgd_momentum")
    if t is torch.optim.Adam and not g.get("amsgrad") and not g.get("decoupled_weight_decay"):
        return "adam"
    if t is torch.optim.Adagrad:
        return "adagrad"
    return "generic"


def estimate_memory_bytes(model: nn.Module, batch_size: int, optimizer_slots: int = 2,
                          activation_floats_per_sample: int | None = None) -> int:
    """Modelled training memory of one member (bytes): weights + gradients + optimizer slots
    + forward activations and their gradients (``activation_floats_per_sample`` per sample,
    default: the sum of the output widths of all weight matrices/filters). A coarse model for
    ``pack_opt``; on a GPU use measured peaks (``torch.cuda.max_memory_allocated``) instead."""
    n_params = sum(p.numel() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    if activation_floats_per_sample is None:
        activation_floats_per_sample = sum(int(p.shape[0]) for p in model.parameters() if p.dim() > 1)
    return int(elem * (n_params * (2 + optimizer_slots) + 2 * batch_size * activation_floats_per_sample))
