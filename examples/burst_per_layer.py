"""A model and batch size where DeepPool's burst plan differs per layer.

The digits CNN of the main job plans every layer on the same GPU count: its layers all have
little compute and few parameters, so whatever pays for one pays for all. This model has two
wide convolutions (much compute, few parameters: spreading them over GPUs costs almost no
gradient synchronisation) and a wide fully connected layer (8 M parameters, 32 MB of gradient:
its ring all-reduce costs more than the compute it would share at a small global batch). Under
the amplification limit (DeepPool section 4.2) the planner then gives the convolutions more
GPUs than the fully connected head (e.g. conv 2-4 GPUs, fc 1 at B_G 32 on 4 GPUs; the exact
counts follow the layer times measured on this host).

    python examples/burst_per_layer.py                   # profile, plan and print per layer
    python examples/burst_per_layer.py --global-batch 64 --gpus 4 --amp-limit 2

The same model trains in burst mode through the CLI (this file is a ``--script``):

    jabasray train --script examples/burst_per_layer.py --parallelism burst \\
        --initial-global-batch 32 --min-global-batch 32 --max-global-batch 64 --epochs 1
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from jabasray.data import load_digits_split


class WideHeadCNN(nn.Module):
    """conv(1 -> c) - relu - conv(c -> c) - relu - flatten - fc(64 c -> hidden) - relu - fc(-> 10)
    on 1 x 8 x 8 digits."""

    def __init__(self, channels: int = 64, hidden: int = 4096) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.fc1 = nn.Linear(channels * 64, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def model_fn() -> nn.Module:
    return WideHeadCNN()


def dataset():
    return load_digits_split()[0]


def val_dataset():
    return load_digits_split()[1]


def main() -> None:
    from jabasray.actors.burst_host import DEFAULT_NETWORK
    from jabasray.planners.burst import candidate_gpu_counts, plan_burst
    from jabasray.profiler.layer_graph import build_layer_graph

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--amp-limit", type=float, default=2.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = model_fn()
    x = dataset().tensors[0][:64]
    graph = build_layer_graph(model, x, args.global_batch, candidate_gpu_counts(args.gpus))
    plan = plan_burst(graph, DEFAULT_NETWORK, args.gpus, args.amp_limit)
    params = {name: sum(p.numel() for p in mod.parameters())
              for name, mod in model.named_modules() if name}
    print(f"B_G {args.global_batch} on {args.gpus} GPUs, amplification limit {args.amp_limit}, "
          f"network {DEFAULT_NETWORK.bandwidth / 1e9:.0f} GB/s + {DEFAULT_NETWORK.latency * 1e6:.0f} us")
    print(f"{'layer':10s} {'params':>9s} {'GPUs':>5s}")
    for name, g in plan.gpu_counts.items():
        print(f"{name:10s} {params.get(name, 0):9d} {g:5d}")
    print(f"predicted iteration {plan.iteration_time * 1e3:.1f} ms; distinct GPU counts: "
          f"{sorted(set(plan.gpu_counts.values()))}")


if __name__ == "__main__":
    main()
