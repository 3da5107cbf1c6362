"""Tiny LightningModules, datasets and a recording logger shared by the Lightning tests (and their DDP workers)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset

from elastic_batches.lightning import ElasticModule
from elastic_batches.testing import inject_oom

ROWS = 40
FEATURES = 4

warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*litlogger.*")
warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")


class IdDataset(Dataset):
    """``ROWS`` samples ``{"id", "x", "y"}`` from a fixed generator: the id tells which sample a rank saw."""

    def __init__(self, rows: int = ROWS, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(rows, FEATURES, generator=generator)
        self.y = self.x @ torch.linspace(-1, 1, FEATURES).unsqueeze(1) + 0.1 * torch.randn(rows, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"id": index, "x": self.x[index], "y": self.y[index]}


def loader(batch_size: int, *, shuffle: bool = False, rows: int = ROWS, seed: int = 0) -> DataLoader:
    """A plain DataLoader over :class:`IdDataset`; shuffled with a fixed generator when asked."""
    generator = torch.Generator().manual_seed(1) if shuffle else None
    return DataLoader(IdDataset(rows, seed), batch_size=batch_size, shuffle=shuffle, generator=generator)


class Regression(pl.LightningModule):
    """An MLP regression; logs its losses; options cover schedulers, dict outputs, BatchNorm and OOM injection.

    Args:
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adam"``.
        scheduler: ``None``, or a Lightning lr scheduler config without the scheduler (interval, frequency).
        batchnorm: Put a BatchNorm1d after the first layer.
        oom: Keyword arguments of :func:`elastic_batches.testing.inject_oom` on ``self.net``, or a list
            of them (installed at ``on_fit_start``, in the worker process under ``ddp_spawn``).
        record_ids: Keep the sample ids each training batch held in ``self.seen``.
    """

    def __init__(
        self,
        *,
        optimizer: str = "sgd",
        scheduler: dict[str, Any] | None = None,
        batchnorm: bool = False,
        oom: dict[str, Any] | list[dict[str, Any]] | None = None,
        record_ids: bool = False,
        return_dict: bool = False,
        lr: float = 0.1,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, 16)]
        if batchnorm:
            layers.append(torch.nn.BatchNorm1d(16))
        layers += [torch.nn.Tanh(), torch.nn.Linear(16, 1)]
        self.net = torch.nn.Sequential(*layers)
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.oom = oom
        self.record_ids = record_ids
        self.return_dict = return_dict
        self.lr = lr
        self.seen: list[int] = []
        self.batch_outputs: list[Any] = []
        self._injections: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_fit_start(self) -> None:
        if self.oom is not None and not self._injections:
            specs = self.oom if isinstance(self.oom, list) else [self.oom]
            self._injections = [inject_oom(self.net, **spec) for spec in specs]

    def on_fit_end(self) -> None:
        for injection in self._injections:
            injection.remove()
        self._injections = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.record_ids:
            ids = batch.unwrap()["id"] if hasattr(batch, "unwrap") else batch["id"]
            self.seen.extend(int(i) for i in ids)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.return_dict:
            self.batch_outputs.append({k: v.detach().clone() for k, v in outputs.items()})

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        prediction = self(batch["x"])
        loss = torch.nn.functional.mse_loss(prediction.float(), batch["y"])
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_max_error", (prediction.float() - batch["y"]).abs().max(), reduce_fx="max", on_epoch=True)
        self.log("train_rows", float(len(batch["x"])), reduce_fx="sum", on_step=True, on_epoch=False)
        if self.return_dict:
            return {"loss": loss, "prediction": prediction.detach(), "mae": (prediction - batch["y"]).abs().mean()}
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss = torch.nn.functional.mse_loss(self(batch["x"]).float(), batch["y"])
        self.log("val_loss", loss, prog_bar=True)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("test_loss", torch.nn.functional.mse_loss(self(batch["x"]).float(), batch["y"]))

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        return {"id": batch["id"], "prediction": self(batch["x"])}

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=self.lr / 10)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.scheduler is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, **self.scheduler}}


class Manual(Regression):
    """Manual optimization: zero the gradients, backward, clip to norm 0.05, step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self(batch["x"]), batch["y"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        if isinstance(self, ElasticModule):
            self.elastic_backward(batch, self._loss)
        else:
            self.manual_backward(self._loss(batch))
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()


class ElasticManual(ElasticModule, Manual):
    """:class:`Manual` through ``elastic_backward``."""


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call: ``[(step, {name: value})]``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def values(self, name: str) -> list[float]:
        """Every value logged under ``name``, in order."""
        return [metrics[name] for _, metrics in self.records if name in metrics]


def quiet_trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Trainer arguments for short, silent, deterministic CPU runs."""
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "deterministic": True,
        "num_sanity_val_steps": 0,
    }
    kwargs.update(overrides)
    return kwargs


def parameters_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """Detached copies of the model's parameters (and buffers)."""
    return [t.detach().clone() for t in model.state_dict().values() if t.is_floating_point()]


def assert_same_parameters(
    got: list[torch.Tensor], want: list[torch.Tensor], rtol: float = 1e-5, atol: float = 1e-7
) -> None:
    """Every tensor equal within ``rtol`` relative (and a tiny absolute floor for values near 0)."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def fit(
    trainer_factory: Callable[..., pl.Trainer],
    model: pl.LightningModule,
    train: DataLoader,
    val: DataLoader | None = None,
    **kwargs: Any,
) -> pl.Trainer:
    """Build a trainer and fit ``model``; returns the trainer."""
    trainer = trainer_factory(**quiet_trainer_kwargs(**kwargs))
    trainer.fit(model, train, val)
    return trainer


class PaddedIdDataset(IdDataset):
    """:class:`IdDataset` whose samples also hold a ragged ``pad`` field (1 to 4 positions), for ``pad_values``."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**super().__getitem__(index), "pad": torch.ones(1 + index % 4)}


class PaddedRegression(Regression):
    """:class:`Regression` on padded batches; with ``cut_oom``, rank 1 runs out of memory cutting its second
    microbatch once in training and once in validation (installed in the worker process under ``ddp_spawn``)."""

    def __init__(self, *, cut_oom: bool = False) -> None:
        super().__init__()
        self.cut_oom = cut_oom
        self.cut_fired = 0
        self._cut: Any = None

    def _arm(self) -> None:
        from elastic_batches.testing import inject_oom_in_cut

        if self.cut_oom and self.global_rank == 1:
            self._cut = inject_oom_in_cut(calls=1)

    def _disarm(self) -> None:
        if self._cut is not None:
            self.cut_fired += self._cut.fired
            self._cut.remove()
            self._cut = None

    def on_train_epoch_start(self) -> None:
        self._arm() if self.current_epoch == 0 else None

    def on_train_epoch_end(self) -> None:
        self._disarm()

    def on_validation_epoch_start(self) -> None:
        self._arm() if self.current_epoch == 0 else None

    def on_validation_epoch_end(self) -> None:
        self._disarm()

    def teardown(self, stage: str) -> None:
        # A ddp_spawn worker ends right after the fit: its gloo group closes here, not in the interpreter's exit,
        # where its threads can still be joinable when destroyed (an abort of a finished worker).
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"]) + 0.0 * batch["pad"].sum()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"]) + 0.0 * batch["pad"].sum()
        self.log("val_loss", loss, sync_dist=True)
