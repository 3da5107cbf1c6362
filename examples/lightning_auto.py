"""An unchanged LightningModule trained with ``Trainer(accumulate_grad_batches="auto")`` on a device too small.

What it shows:

- the LightningModule and the DataLoaders are plain Lightning code; the only change is the
  Trainer class and ``accumulate_grad_batches="auto"``;
- a simulated device (``MemoryBudget``) that holds a training step on a quarter of a batch but
  not on the whole batch: the first batch runs out of memory, is split, and retried; every
  later batch runs as microbatches from the start;
- gradient clipping, an lr scheduler, validation and ``self.log`` work as in any Trainer, and
  the split count shows in the progress bar (``split=4``) and in a console line when it changes;
- the trained weights match those of the plain ``lightning.pytorch.Trainer`` given all the
  memory it needs (printed: the largest relative difference).

Run it: ``python examples/lightning_auto.py`` (``--quick`` for a few seconds' run).
"""

from __future__ import annotations

import argparse
import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_batches.lightning import ElasticAccumulation, Trainer
from elastic_batches.testing import MemoryBudget


class Classifier(pl.LightningModule):
    """A plain LightningModule: nothing in it knows about microbatches."""

    def __init__(self, features: int = 32, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_data(samples: int, features: int = 32, classes: int = 10, seed: int = 0) -> TensorDataset:
    """Gaussian clusters, one per class (the same clusters for every seed; ``seed`` draws the samples)."""
    centers = 2 * torch.randn(classes, features, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (samples,), generator=generator)
    x = centers[y] + torch.randn(samples, features, generator=generator)
    return TensorDataset(x, y)


def trainer_kwargs(epochs: int, **overrides: Any) -> dict[str, Any]:
    """The run's Trainer arguments (the same for the plain and the elastic Trainer)."""
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": epochs,
        "gradient_clip_val": 1.0,
        "deterministic": True,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    kwargs.update(overrides)
    return kwargs


def step_peak_bytes(train: TensorDataset, batch_size: int) -> int:
    """Peak simulated memory of a plain Trainer training on batches of ``batch_size`` rows.

    Two steps: in the second, the optimizer's state is in memory next to the activations. The
    model is built outside the budget, as in :func:`main`: its parameters are not counted.
    """
    model = Classifier()
    with MemoryBudget() as memory:
        trainer = pl.Trainer(**trainer_kwargs(1, limit_train_batches=2, limit_val_batches=0))
        trainer.fit(model, DataLoader(train, batch_size=batch_size))
    return memory.peak_bytes


def main(quick: bool = False) -> dict[str, Any]:
    """Train with a plain Trainer (all the memory) and with ``"auto"`` (a small device); print and return a summary."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*litlogger.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    samples, batch_size, epochs = (1024, 256, 2) if quick else (8192, 512, 4)
    train, val = make_data(samples), make_data(samples // 4, seed=1)

    # the simulated device holds a step on a quarter of a batch, not on the whole batch
    limit = (step_peak_bytes(train, batch_size // 4) + step_peak_bytes(train, batch_size)) // 2
    print(f"simulated device: {limit / 2**20:.2f} MiB (a whole batch of {batch_size} needs more)")

    reference = Classifier()
    plain = pl.Trainer(**trainer_kwargs(epochs))
    plain.fit(reference, DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=256))

    model = Classifier()
    # memory=None: learned from the OOMs alone, as described above (memory="auto" would measure with the budget)
    trainer = Trainer(
        accumulate_grad_batches="auto", callbacks=[ElasticAccumulation(memory=None)], **trainer_kwargs(epochs)
    )
    with MemoryBudget(limit_bytes=limit) as memory:
        trainer.fit(model, DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=256))

    controller = trainer.elastic.controllers["train"]
    with torch.no_grad():
        difference = max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
    summary = {
        "split_count": controller.split_count,
        "microbatch_size": controller.microbatch_size,
        "oom_retries": controller.retry_count,
        "peak_bytes": memory.peak_bytes,
        "limit_bytes": limit,
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "plain_val_acc": float(plain.callback_metrics["val_acc"]),
        "max_relative_difference": difference,
    }
    print(
        f"batches of {batch_size} ran as {controller.split_count} microbatches of at most {controller.microbatch_size} "
        f"after {controller.retry_count} OOM retries; peak {memory.peak_bytes / 2**20:.2f} MiB"
    )
    print(f"val_acc {summary['val_acc']:.3f} (plain Trainer with all the memory: {summary['plain_val_acc']:.3f})")
    print(f"weights vs the plain Trainer: largest relative difference {difference:.1e}")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller dataset, two epochs")
    main(quick=parser.parse_args().quick)
