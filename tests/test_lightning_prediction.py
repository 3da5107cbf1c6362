"""Lightning with a memory probe: an unfrozen backbone is measured again, and the split returns to the fewest.

``BackboneFinetuning`` unfreezes the backbone after the first epoch: every microbatch then
accumulates the backbone's gradients too (bytes per microbatch, not per row), which the model
measured before did not hold. Before, the model planned one-row microbatches from then on.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_batches.lightning import ElasticAccumulation, Trainer
from elastic_batches.memory import RECOVER_AFTER
from elastic_batches.testing import MemoryBudget


class _Finetuned(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh())
        self.head = nn.Linear(128, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


class _Counts(pl.Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.counts.append(trainer.elastic.controllers["train"].split_count)  # type: ignore[attr-defined]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_unfrozen_backbone_is_measured_again_and_the_split_returns_to_the_fewest() -> None:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 8, generator=generator), torch.randn(512, 1, generator=generator))
    budget = MemoryBudget(200_000)  # unfrozen: 4 microbatches of 32 rows fit, 2 of 64 do not
    counts = _Counts()
    epochs = 1 + (2 * RECOVER_AFTER + 4) // 4 + 1  # 4 batches an epoch: two narrowings of the margin after it
    model = _Finetuned()  # its parameters outside the budget, as a device's memory before the run
    with budget, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            accumulate_grad_batches="auto",
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            callbacks=[
                ElasticAccumulation(memory=budget),
                BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0),
                counts,
            ],
        )
        trainer.fit(model, DataLoader(data, batch_size=128))
    assert budget.oom_count <= 2  # the unfrozen backbone's first batch
    assert all(count < 128 for count in counts.counts[1:])  # no more one-row microbatches
    assert counts.counts[-1] <= 5  # max(fewest + 1, 1.1 * fewest), fewest = 4
