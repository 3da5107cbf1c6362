"""A plain PyTorch training loop whose batch does not have to fit in memory.

Two changes to an ordinary loop: wrap the DataLoader in ``MicrobatchingDataLoader`` and call
``step.backward(batch, loss_fn)`` instead of ``loss_fn(batch).backward()``. When a batch runs out
of memory, it is cut into more microbatches and retried; the gradient is the full batch's.

On a CUDA machine the real memory limit applies. Elsewhere (and with ``--simulate-kib``) the loop
runs inside ``elastic_batches.testing.MemoryBudget``, a simulated device with that much memory.

    python examples/plain_loop.py                 # 5 epochs
    python examples/plain_loop.py --small         # a few seconds (what CI runs)
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="a tiny run, for CI")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--simulate-kib", type=int, default=None, help="simulated device memory (default on CPU: 1300)")
    args = parser.parse_args()
    epochs, samples = (1, 1024) if args.small else (args.epochs, 8192)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows each change of the split count

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    features = torch.randn(samples, 128)
    labels = (features[:, :10].sum(dim=1) > 0).long()
    dataset = TensorDataset(features, labels)

    # 1. Wrap the DataLoader you already have (or pass MicrobatchingDataLoader the dataset and arguments).
    loader = eb.MicrobatchingDataLoader(DataLoader(dataset, batch_size=args.batch_size, shuffle=True))

    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    # 2. One ElasticStep, sharing the loader's controller (the loader tags batches with what it learned).
    step = eb.ElasticStep(model, controller=loader.controller, device=device, memory=None)  # learned from OOMs

    # 3. The loss of one microbatch, as a mean over its samples. It receives exactly what the plain
    #    DataLoader yields (here a list [features, labels]), cut to the microbatch's rows.
    def loss_fn(batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    simulate = args.simulate_kib if args.simulate_kib is not None else (None if device.type == "cuda" else 1300)
    device_memory = MemoryBudget(limit_bytes=simulate * 1024) if simulate else contextlib.nullcontext()

    for epoch in range(epochs):
        for batch in loader:
            with device_memory:
                loss = step.backward(batch, loss_fn)  # the full batch's mean loss, detached
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        controller = loader.controller
        print(
            f"epoch {epoch}: loss {loss.item():.4f}, {controller.split_count} microbatches per batch of "
            f"{args.batch_size}, {controller.oom_count} OOMs caught so far"
        )

    # 4. The learned split count is part of the loader's state: save it with your checkpoint, and a
    #    resumed run starts at the right count instead of running out of memory again.
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict()}
    resumed = eb.MicrobatchingDataLoader(DataLoader(dataset, batch_size=args.batch_size, shuffle=True))
    resumed.load_state_dict(checkpoint["loader"])
    print(f"a resumed loader starts at {resumed.controller.split_count} microbatches per batch")


if __name__ == "__main__":
    main()
