"""Per-step cost of the real-data models: measured CPU time and counted FLOPs, for the wall-time estimates.

One local step = forward + backward of one mini-batch + a FedDecaySGD step (reference backend), on
uint8 images through the model's input stage, as the simulator runs it. FLOPs are counted by
``torch.utils.flop_counter`` (forward + backward). Writes nothing; prints a markdown table.

    python experiments/step_times.py              # all models, 1 thread, 5 timed steps each
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from fedopt_kernels import FedDecaySGD
from fedopt_kernels.sim.data.image_input import InputSpec
from fedopt_kernels.sim.models.build import build_model

CASES = [  # (label, model, input shape, classes, batch)
    ("FedAvg CNN, FEMNIST", "fedavg-cnn", (1, 28, 28), 62, 32),
    ("FedAvg CNN, CIFAR-10", "fedavg-cnn", (3, 32, 32), 10, 32),
    ("FedAvg CNN, CIFAR-10", "fedavg-cnn", (3, 32, 32), 10, 50),
    ("ResNet-18 (GN), CIFAR-10", "resnet18-gn", (3, 32, 32), 10, 50),
]


def measure(model_name, shape, classes, batch, steps, device):
    torch.manual_seed(0)
    spec = InputSpec(mean=(0.5,) * shape[0], std=(0.25,) * shape[0], augment=True)
    model = build_model(model_name, shape, classes, spec).to(device)
    opt = FedDecaySGD(model.parameters(), lr=0.01, beta=0.5, backend="reference")
    opt.start_round()
    x = torch.randint(0, 256, (batch,) + shape, dtype=torch.uint8, device=device)
    y = torch.randint(0, classes, (batch,), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    with FlopCounterMode(display=False) as fc:
        step()
    flops = fc.get_total_flops()
    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps, flops, sum(p.numel() for p in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, {args.threads} thread(s), mean of {args.steps} steps after one warm-up step\n")
    print("| model | params | batch | GFLOP per step (fwd+bwd) | measured ms per step |")
    print("|---|---|---|---|---|")
    for label, name, shape, classes, batch in CASES:
        sec, flops, n = measure(name, shape, classes, batch, args.steps, device)
        print(f"| {label} | {n / 1e6:.2f}M | {batch} | {flops / 1e9:.2f} | {1e3 * sec:.1f} |", flush=True)


if __name__ == "__main__":
    main()
