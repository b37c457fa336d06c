"""Layer graphs of VGG-16, WideResNet-101-2 and Inception-v3 without torchvision.

Each model is a list of :class:`Node` (name, input names, output shape, forward FLOPs and
parameters per sample) written out from the architectures' definitions (the same layer shapes
as torchvision's ``vgg16``, ``wide_resnet101_2`` and ``inception_v3`` without the auxiliary
head).  A convolution is one node together with its BatchNorm and ReLU, the granularity of
DeepPool's layers.  ``to_layer_graph`` turns a model into the planner's
:class:`~jabasray.planners.burst.LayerGraph` with a FLOP/byte-derived compute-time model per GPU
count (per-GPU batch = global batch / g):

    fwd(b) = c0 + max(F * b / peak, (M_in + M_out) * b / mem_bw + P / mem_bw)
    bwd(b) = 2 c0 + max(2 F * b / peak, 2 (M_in + M_out) * b / mem_bw + 2 P / mem_bw)
    comp(g) = fwd(B / g) + bwd(B / g)

(F forward FLOPs per sample, M activation bytes per sample, P parameter bytes, c0 kernel launch
overhead).  Big-weight, low-FLOP layers (VGG's fully connected layers) then barely scale with
more GPUs while convolutions scale almost linearly, the heterogeneity of DeepPool's Fig. 5.

Parameter counts match torchvision (checked by ``tests/test_burst.py``): VGG-16 138,357,544;
WideResNet-101-2 126,886,696; Inception-v3 without the auxiliary classifier 23,834,568.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jabasray.planners.burst import LayerGraph, LayerSpec  # noqa: E402

BYTES = 4  # fp32


@dataclass
class Node:
    name: str
    inputs: list[str]
    shape: tuple[int, int, int]     # output (C, H, W) per sample
    flops: float                    # forward FLOPs per sample
    params: int                     # parameter count
    in_elems: int                   # input elements per sample (all inputs)

    @property
    def out_elems(self) -> int:
        c, h, w = self.shape
        return c * h * w


class _Builder:
    """Tracks output shapes while a model is written down layer by layer."""

    def __init__(self, shape: tuple[int, int, int]) -> None:
        self.nodes: list[Node] = []
        self.shapes: dict[str, tuple[int, int, int]] = {"": shape}

    def _add(self, name: str, inputs: list[str], shape: tuple[int, int, int], flops: float,
             params: int) -> str:
        in_elems = sum(_elems(self.shapes[i]) for i in inputs)
        self.nodes.append(Node(name, [i for i in inputs if i], shape, flops, params, in_elems))
        self.shapes[name] = shape
        return name

    def conv(self, name: str, x: str, out: int, k: int | tuple[int, int], stride: int = 1,
             pad: int | tuple[int, int] = 0, bn: bool = True, bias: bool = False) -> str:
        kh, kw = (k, k) if isinstance(k, int) else k
        ph, pw = (pad, pad) if isinstance(pad, int) else pad
        c, h, w = self.shapes[x]
        ho, wo = (h + 2 * ph - kh) // stride + 1, (w + 2 * pw - kw) // stride + 1
        params = c * out * kh * kw + (out if bias else 0) + (2 * out if bn else 0)
        flops = 2.0 * c * out * kh * kw * ho * wo + (4.0 * out * ho * wo if bn else 0.0)
        return self._add(name, [x], (out, ho, wo), flops, params)

    def pool(self, name: str, x: str, k: int, stride: int, pad: int = 0) -> str:
        c, h, w = self.shapes[x]
        ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        return self._add(name, [x], (c, ho, wo), float(c * ho * wo * k * k), 0)

    def global_pool(self, name: str, x: str) -> str:
        c, h, w = self.shapes[x]
        return self._add(name, [x], (c, 1, 1), float(c * h * w), 0)

    def linear(self, name: str, x: str, out: int) -> str:
        n_in = _elems(self.shapes[x])
        return self._add(name, [x], (out, 1, 1), 2.0 * n_in * out, n_in * out + out)

    def concat(self, name: str, xs: Sequence[str]) -> str:
        c = sum(self.shapes[x][0] for x in xs)
        _, h, w = self.shapes[xs[0]]
        return self._add(name, list(xs), (c, h, w), 0.0, 0)

    def add(self, name: str, xs: Sequence[str]) -> str:
        shape = self.shapes[xs[0]]
        return self._add(name, list(xs), shape, float(_elems(shape)), 0)


def _elems(shape: tuple[int, int, int]) -> int:
    return shape[0] * shape[1] * shape[2]


# --------------------------------------------------------------------------- models
def vgg16() -> list[Node]:
    """VGG-16 (configuration D), 224x224 input: 13 conv + 5 max-pool + 3 FC (bias, no BN)."""
    b = _Builder((3, 224, 224))
    x = ""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    conv_i = pool_i = 0
    for v in cfg:
        if v == "M":
            pool_i += 1
            x = b.pool(f"pool{pool_i}", x, 2, 2)
        else:
            conv_i += 1
            x = b.conv(f"conv{conv_i}", x, int(v), 3, pad=1, bn=False, bias=True)
    x = b.linear("fc6", x, 4096)
    x = b.linear("fc7", x, 4096)
    b.linear("fc8", x, 1000)
    return b.nodes


def wide_resnet101_2() -> list[Node]:
    """WideResNet-101-2: ResNet-101 bottlenecks [3, 4, 23, 3] with twice the inner width."""
    b = _Builder((3, 224, 224))
    x = b.conv("conv1", "", 64, 7, stride=2, pad=3)
    x = b.pool("maxpool", x, 3, 2, pad=1)
    in_ch = 64
    for stage, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 23), (512, 3)], start=1):
        width = planes * 2
        for blk in range(blocks):
            stride = 2 if (blk == 0 and stage > 1) else 1
            p = f"layer{stage}.{blk}"
            y = b.conv(f"{p}.conv1", x, width, 1)
            y = b.conv(f"{p}.conv2", y, width, 3, stride=stride, pad=1)
            y = b.conv(f"{p}.conv3", y, planes * 4, 1)
            short = x
            if blk == 0:
                short = b.conv(f"{p}.downsample", x, planes * 4, 1, stride=stride)
            x = b.add(f"{p}.add", [y, short])
            in_ch = planes * 4
    x = b.global_pool("avgpool", x)
    b.linear("fc", x, 1000)
    assert in_ch == 2048
    return b.nodes


def inception_v3() -> list[Node]:
    """Inception-v3 at 299x299 (torchvision layout, no auxiliary classifier)."""
    b = _Builder((3, 299, 299))
    x = b.conv("Conv2d_1a_3x3", "", 32, 3, stride=2)
    x = b.conv("Conv2d_2a_3x3", x, 32, 3)
    x = b.conv("Conv2d_2b_3x3", x, 64, 3, pad=1)
    x = b.pool("maxpool1", x, 3, 2)
    x = b.conv("Conv2d_3b_1x1", x, 80, 1)
    x = b.conv("Conv2d_4a_3x3", x, 192, 3)
    x = b.pool("maxpool2", x, 3, 2)

    def block_a(p: str, x: str, pool_features: int) -> str:
        b1 = b.conv(f"{p}.branch1x1", x, 64, 1)
        b5 = b.conv(f"{p}.branch5x5_1", x, 48, 1)
        b5 = b.conv(f"{p}.branch5x5_2", b5, 64, 5, pad=2)
        d = b.conv(f"{p}.branch3x3dbl_1", x, 64, 1)
        d = b.conv(f"{p}.branch3x3dbl_2", d, 96, 3, pad=1)
        d = b.conv(f"{p}.branch3x3dbl_3", d, 96, 3, pad=1)
        bp = b.pool(f"{p}.avgpool", x, 3, 1, pad=1)
        bp = b.conv(f"{p}.branch_pool", bp, pool_features, 1)
        return b.concat(f"{p}.cat", [b1, b5, d, bp])

    def block_b(p: str, x: str) -> str:
        b3 = b.conv(f"{p}.branch3x3", x, 384, 3, stride=2)
        d = b.conv(f"{p}.branch3x3dbl_1", x, 64, 1)
        d = b.conv(f"{p}.branch3x3dbl_2", d, 96, 3, pad=1)
        d = b.conv(f"{p}.branch3x3dbl_3", d, 96, 3, stride=2)
        bp = b.pool(f"{p}.maxpool", x, 3, 2)
        return b.concat(f"{p}.cat", [b3, d, bp])

    def block_c(p: str, x: str, c7: int) -> str:
        b1 = b.conv(f"{p}.branch1x1", x, 192, 1)
        s = b.conv(f"{p}.branch7x7_1", x, c7, 1)
        s = b.conv(f"{p}.branch7x7_2", s, c7, (1, 7), pad=(0, 3))
        s = b.conv(f"{p}.branch7x7_3", s, 192, (7, 1), pad=(3, 0))
        d = b.conv(f"{p}.branch7x7dbl_1", x, c7, 1)
        d = b.conv(f"{p}.branch7x7dbl_2", d, c7, (7, 1), pad=(3, 0))
        d = b.conv(f"{p}.branch7x7dbl_3", d, c7, (1, 7), pad=(0, 3))
        d = b.conv(f"{p}.branch7x7dbl_4", d, c7, (7, 1), pad=(3, 0))
        d = b.conv(f"{p}.branch7x7dbl_5", d, 192, (1, 7), pad=(0, 3))
        bp = b.pool(f"{p}.avgpool", x, 3, 1, pad=1)
        bp = b.conv(f"{p}.branch_pool", bp, 192, 1)
        return b.concat(f"{p}.cat", [b1, s, d, bp])

    def block_d(p: str, x: str) -> str:
        b3 = b.conv(f"{p}.branch3x3_1", x, 192, 1)
        b3 = b.conv(f"{p}.branch3x3_2", b3, 320, 3, stride=2)
        s = b.conv(f"{p}.branch7x7x3_1", x, 192, 1)
        s = b.conv(f"{p}.branch7x7x3_2", s, 192, (1, 7), pad=(0, 3))
        s = b.conv(f"{p}.branch7x7x3_3", s, 192, (7, 1), pad=(3, 0))
        s = b.conv(f"{p}.branch7x7x3_4", s, 192, 3, stride=2)
        bp = b.pool(f"{p}.maxpool", x, 3, 2)
        return b.concat(f"{p}.cat", [b3, s, bp])

    def block_e(p: str, x: str) -> str:
        b1 = b.conv(f"{p}.branch1x1", x, 320, 1)
        t = b.conv(f"{p}.branch3x3_1", x, 384, 1)
        t = b.concat(f"{p}.branch3x3_cat", [b.conv(f"{p}.branch3x3_2a", t, 384, (1, 3), pad=(0, 1)),
                                            b.conv(f"{p}.branch3x3_2b", t, 384, (3, 1), pad=(1, 0))])
        d = b.conv(f"{p}.branch3x3dbl_1", x, 448, 1)
        d = b.conv(f"{p}.branch3x3dbl_2", d, 384, 3, pad=1)
        d = b.concat(f"{p}.branch3x3dbl_cat", [b.conv(f"{p}.branch3x3dbl_3a", d, 384, (1, 3), pad=(0, 1)),
                                               b.conv(f"{p}.branch3x3dbl_3b", d, 384, (3, 1), pad=(1, 0))])
        bp = b.pool(f"{p}.avgpool", x, 3, 1, pad=1)
        bp = b.conv(f"{p}.branch_pool", bp, 192, 1)
        return b.concat(f"{p}.cat", [b1, t, d, bp])

    x = block_a("Mixed_5b", x, 32)
    x = block_a("Mixed_5c", x, 64)
    x = block_a("Mixed_5d", x, 64)
    x = block_b("Mixed_6a", x)
    for name, c7 in [("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)]:
        x = block_c(name, x, c7)
    x = block_d("Mixed_7a", x)
    x = block_e("Mixed_7b", x)
    x = block_e("Mixed_7c", x)
    x = b.global_pool("avgpool", x)
    b.linear("fc", x, 1000)
    return b.nodes


MODELS: dict[str, Callable[[], list[Node]]] = {
    "vgg16": vgg16, "wide_resnet101_2": wide_resnet101_2, "inception_v3": inception_v3}


# --------------------------------------------------------------------------- timing model
@dataclass(frozen=True)
class GPUSpeed:
    """Roofline-style device model (defaults: a V100-class GPU, fp32)."""

    peak_flops: float = 14e12        # achievable FLOP/s
    mem_bw: float = 800e9            # achievable bytes/s
    launch: float = 10e-6            # seconds per kernel launch


def layer_time(node: Node, per_gpu_batch: float, gpu: GPUSpeed) -> float:
    """Forward + backward seconds of one node (module docstring formula)."""
    act = (node.in_elems + node.out_elems) * BYTES * per_gpu_batch
    par = node.params * BYTES
    fwd = gpu.launch + max(node.flops * per_gpu_batch / gpu.peak_flops, (act + par) / gpu.mem_bw)
    bwd = 2 * gpu.launch + max(2 * node.flops * per_gpu_batch / gpu.peak_flops,
                               2 * (act + par) / gpu.mem_bw)
    return fwd + bwd


def to_layer_graph(nodes: list[Node], global_batch: int, gpu_counts: Sequence[int],
                   gpu: GPUSpeed = GPUSpeed()) -> LayerGraph:
    """Planner input: per-count compute times at per-GPU batch ``global_batch / g``."""
    layers = []
    for n in nodes:
        comp = {int(g): layer_time(n, global_batch / g, gpu) for g in gpu_counts}
        layers.append(LayerSpec(n.name, comp, float(n.out_elems * BYTES * global_batch),
                                float(n.params * BYTES), list(n.inputs)))
    return LayerGraph(layers)


def param_count(nodes: list[Node]) -> int:
    return sum(n.params for n in nodes)
