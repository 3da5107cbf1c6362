"""``Trainer(accumulate_grad_batches="auto", strategy="ddp")`` on 2 CPU processes, one of them short of memory.

What it shows:

- ``strategy="ddp", accelerator="cpu", devices=2``: Lightning starts the second process itself
  and gives each rank its own shard of the data (DistributedSampler), as for any DataLoader;
- rank 1 runs on a simulated device (``MemoryBudget``) that cannot hold a whole batch, rank 0
  has all the memory it wants: rank 1 runs out of memory, both ranks learn of it, agree on the
  same split count and retry the same batch — nobody waits forever in a collective;
- the weights equal those of the plain DDP Trainer on the same data (printed).

Run it: ``python examples/lightning_ddp.py`` (``--quick`` for a short run). The last line each
rank prints starts with ``RESULT`` and holds a JSON summary (the tests read it).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_auto import Classifier, make_data, step_peak_bytes, trainer_kwargs
from torch.utils.data import DataLoader

from elastic_batches.lightning import Trainer
from elastic_batches.testing import MemoryBudget


def main(quick: bool = False) -> dict[str, Any]:
    """Train on 2 processes with and without ``"auto"``; print and return this rank's summary."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*litlogger.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    samples, batch_size, epochs = (2048, 512, 2) if quick else (8192, 512, 3)  # batch_size: per rank
    train, val = make_data(samples), make_data(samples // 4, seed=1)
    rank = int(os.environ.get("LOCAL_RANK", 0))  # set by Lightning in the process it starts

    # rank 1: a device that holds a step on a quarter of its batch, not on the whole batch (DDP
    # keeps its gradient buckets, and ElasticStep its reduction bucket, on top: each a gradient's
    # worth of this small model, counted in the margin); rank 0: no limit
    limit = None
    if rank == 1:
        small, whole = step_peak_bytes(train, batch_size // 4), step_peak_bytes(train, batch_size)
        parameters = sum(p.numel() * p.element_size() for p in Classifier().parameters())
        limit = (small + whole) // 2 + 2 * parameters

    ddp = {"strategy": "ddp", "devices": 2}
    reference = Classifier()
    plain = pl.Trainer(**trainer_kwargs(epochs, **ddp))
    plain.fit(reference, DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=256))

    model = Classifier()
    trainer = Trainer(accumulate_grad_batches="auto", **trainer_kwargs(epochs, **ddp))
    with MemoryBudget(limit_bytes=limit) as memory:
        trainer.fit(model, DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=256))

    controller = trainer.elastic.controllers["train"]
    with torch.no_grad():
        difference = max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
    summary = {
        "rank": trainer.global_rank,
        "limit_bytes": limit,
        "own_ooms": memory.oom_count,
        "oom_retries": controller.retry_count,
        "split_count": controller.split_count,
        "microbatch_size": controller.microbatch_size,
        "batches_per_epoch": len(trainer.train_dataloader),
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "max_relative_difference": difference,
    }
    print(
        f"rank {summary['rank']}: {summary['own_ooms']} OOMs of its own, {controller.retry_count} retries agreed; "
        f"batches of {batch_size} as {controller.split_count} microbatches; {summary['batches_per_epoch']} batches "
        f"per epoch (its shard); weights vs plain DDP: largest relative difference {difference:.1e}"
    )
    print("RESULT " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller dataset, two epochs")
    main(quick=parser.parse_args().quick)
    # Lightning leaves the process group open after fit: close it once the trainer and its DDP model are
    # collected, so that no gloo thread is still running when the interpreter exits
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
