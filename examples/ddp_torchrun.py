"""DDP with elastic batches: one rank has less memory than the other, and both agree on the split.

Run on a CPU (gloo):

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py

Rank 1 trains under a simulated device (``elastic_batches.testing.MemoryBudget``) that cannot
hold the forward and backward of a whole batch; rank 0 has no limit. In the first step rank 1
runs out of memory, the ranks' vote tells rank 0, and both retry the same batch in more
microbatches: every rank prints the same split count, and the update is the one the whole
batch would have given. On a GPU, drop the budget: the real OOMs take the same path.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def peak_bytes(width: int, batch: tuple[torch.Tensor, torch.Tensor], split_count: int) -> int:
    """Simulated memory of one step on a throwaway copy of the model (no DDP: nothing to communicate)."""
    model = make_model(width)
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=split_count))
    with MemoryBudget() as budget:
        step.backward(batch, lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1]))
    return budget.peak_bytes


def train(args: argparse.Namespace, rank: int, world_size: int) -> int:
    """Train on this rank; returns the split count the ranks agreed on."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(args.batch_size * world_size * args.steps, 16, generator=generator)
    dataset = TensorDataset(features, features[:, :1].sin() + 0.1 * torch.randn(len(features), 1, generator=generator))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = eb.MicrobatchingDataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = nn.parallel.DistributedDataParallel(make_model(args.width))
    step = eb.ElasticStep(model, controller=loader.controller)  # the loader tags batches with what the step learns
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    # Rank 1's simulated device holds about three quarters of what a whole batch needs; halves fit.
    sample = next(iter(loader)).unwrap()
    whole, halves = peak_bytes(args.width, sample, 1), peak_bytes(args.width, sample, 2)
    budget = MemoryBudget((whole + halves) // 2 if rank == 1 else None)

    sampler.set_epoch(0)
    for index, batch in enumerate(loader):
        optimizer.zero_grad(set_to_none=True)
        with budget:  # forward and backward of every microbatch run on the simulated device
            loss = step.backward(batch, lambda mb: nn.functional.mse_loss(model(mb[0]), mb[1]))
        step.optimizer_step(optimizer)  # an OOM here would raise on every rank, not hang
        print(
            f"rank {rank}: step {index} loss {loss.item():.4f} split count {step.controller.split_count} "
            f"(OOMs on this rank so far: {budget.oom_count})",
            flush=True,
        )

    return step.controller.split_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps to run")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per rank and step (the batch optimized)")
    parser.add_argument("--width", type=int, default=128, help="hidden width of the MLP")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        split_count = train(args, rank, world_size)  # the DDP model and its reducer are gone when it returns
        counts = [None] * world_size
        dist.all_gather_object(counts, split_count)
        print(f"rank {rank}: agreed split count {split_count}; all ranks: {counts}", flush=True)
        if len(set(counts)) != 1:
            raise SystemExit(f"rank {rank}: the ranks disagree on the split count: {counts}")
    finally:
        dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks can hang the peer
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
