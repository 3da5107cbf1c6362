"""What ``"auto"`` cannot split runs as Lightning runs it, and the user's metrics stay the user's.

Each run is compared with the plain ``lightning.pytorch.Trainer`` on the same model and data:
weights exactly equal (rtol=0: nothing is split, the same operations run), logged keys equal.
"""

from __future__ import annotations

import pickle
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_models import (
    Manual,
    RecordingLogger,
    Regression,
    assert_same_parameters,
    fit,
    loader,
    parameters_of,
    quiet_trainer_kwargs,
)
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

import elastic_batches as eb
from elastic_batches.lightning import ElasticAccumulation, Trainer
from elastic_batches.lightning._unsplittable import UnsplitWarnings

AUTO = {"accumulate_grad_batches": "auto"}
_MANUAL = r"Manual uses manual optimization .*run whole, as under Lightning's Trainer.*ElasticModule.*elastic_backward"


def _split(count: int = 2) -> ElasticAccumulation:
    return ElasticAccumulation(controllers={s: eb.SplitController(split_count=count) for s in ("train", "validate")})


def _ours(caught: Any, text: str) -> list[str]:
    return [str(w.message) for w in caught if text in str(w.message)]


# -- manual optimization without ElasticModule --------------------------------------------------


def test_manual_optimization_without_the_mixin_trains_as_the_plain_trainer_with_one_warning() -> None:
    reference = Manual()
    fit(pl.Trainer, reference, loader(10))
    model = Manual()
    with pytest.warns(UserWarning, match=_MANUAL) as caught:
        trainer = fit(Trainer, model, loader(10), callbacks=[_split()], **AUTO)
    assert len(_ours(caught, "manual optimization")) == 1  # 8 steps, one warning
    assert_same_parameters(parameters_of(model), parameters_of(reference), rtol=0, atol=0)
    assert trainer.elastic.controllers["train"].retry_count == 0


def test_an_oom_under_manual_optimization_without_the_mixin_is_lightnings_own() -> None:
    trainer = Trainer(**quiet_trainer_kwargs(**AUTO))
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        trainer.fit(Manual(oom={"phase": "forward", "calls": [0]}), loader(10))


def test_manual_optimization_still_splits_validation() -> None:
    reference = Manual()
    plain = fit(pl.Trainer, reference, loader(10), loader(20))
    model = Manual()
    with pytest.warns(UserWarning, match=_MANUAL):
        trainer = fit(Trainer, model, loader(10), loader(20), callbacks=[_split()], **AUTO)
    assert trainer.elastic.controllers["validate"].split_count == 2
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(float(plain.callback_metrics["val_loss"]))


# -- steps that take dataloader_iter ------------------------------------------------------------


class _IteratorSteps(Regression):
    """``training_step`` and ``validation_step`` that fetch their own batch from ``dataloader_iter``."""

    def _loss(self, dataloader_iter: Any) -> torch.Tensor:
        batch, _, _ = next(dataloader_iter)
        return torch.nn.functional.mse_loss(self(batch["x"]), batch["y"])

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        return self._loss(dataloader_iter)

    def validation_step(self, dataloader_iter: Any) -> None:  # type: ignore[override]
        self.log("val_loss", self._loss(dataloader_iter), batch_size=20)


def test_steps_taking_the_dataloader_iterator_run_as_under_the_plain_trainer_with_one_warning_per_stage() -> None:
    reference = _IteratorSteps()
    plain = fit(pl.Trainer, reference, loader(10), loader(20))
    model = _IteratorSteps()
    with pytest.warns(UserWarning, match=r"takes a dataloader_iter.*take \(batch, batch_idx\)") as caught:
        trainer = fit(Trainer, model, loader(10), loader(20), callbacks=[_split()], **AUTO)
    warned = _ours(caught, "accumulate_grad_batches='auto'")
    assert len(warned) == 2, warned  # train and validate, each once
    assert "_IteratorSteps.training_step" in warned[0] and "_IteratorSteps.validation_step" in warned[1]
    assert_same_parameters(parameters_of(model), parameters_of(reference), rtol=0, atol=0)
    assert float(trainer.callback_metrics["val_loss"]) == float(plain.callback_metrics["val_loss"])


def test_the_warnings_are_once_per_stage_and_case() -> None:
    unsplit = UnsplitWarnings()
    with pytest.warns(UserWarning) as caught:
        for stage in ("validate", "validate", "test"):
            unsplit.dataloader_iter(stage, "Model.validation_step")
            unsplit.batch(stage, "Model.validation_step", 3, TypeError("no rows"))
    assert len(caught) == 4  # (validate, test) x (dataloader_iter, batch of type int)


# -- the user's metrics stay the user's ------------------------------------------------------------


def _keys(logger: RecordingLogger) -> set[str]:
    return {name for _, metrics in logger.records for name in metrics}


def test_by_default_nothing_is_added_to_the_users_metrics_or_logger() -> None:
    plain_logger, auto_logger = RecordingLogger(), RecordingLogger()
    plain = fit(pl.Trainer, Regression(), loader(10), loader(20), logger=plain_logger, log_every_n_steps=1)
    model = Regression(oom={"phase": "backward", "calls": [0]})
    auto = fit(Trainer, model, loader(10), loader(20), logger=auto_logger, log_every_n_steps=1, **AUTO)
    assert auto.elastic.controllers["train"].split_count == 2
    for metrics in ("callback_metrics", "logged_metrics", "progress_bar_metrics"):
        assert set(getattr(auto, metrics)) == set(getattr(plain, metrics)), metrics
    assert _keys(auto_logger) == _keys(plain_logger)


class _RecordingBar(TQDMProgressBar):
    """Keeps the postfix text and ``get_metrics()`` after each training step."""

    def __init__(self) -> None:
        super().__init__()
        self.postfixes: list[str] = []
        self.metrics: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, i)
        self.postfixes.append(str(self.train_progress_bar.postfix))
        self.metrics.append(self.get_metrics(trainer, pl_module))


def test_the_split_count_leads_the_progress_bar_text_on_every_step_and_is_no_metric() -> None:
    bar = _RecordingBar()
    model = Regression(oom={"phase": "backward", "calls": [0]})
    kwargs = quiet_trainer_kwargs(enable_progress_bar=True, callbacks=[bar], max_epochs=1, **AUTO)
    Trainer(**kwargs).fit(model, loader(10))  # 4 steps: no logging step at log_every_n_steps=50
    assert len(bar.postfixes) == 4
    assert all(text.startswith("split=2, ") and "train_loss_step=" in text for text in bar.postfixes), bar.postfixes
    assert all("split" not in metrics for metrics in bar.metrics)


def test_the_rich_progress_bar_shows_the_split_count_first_and_stays_picklable() -> None:
    bar = RichProgressBar()
    model = Regression(oom={"phase": "backward", "calls": [0]})
    Trainer(**quiet_trainer_kwargs(enable_progress_bar=True, callbacks=[bar], max_epochs=1, **AUTO)).fit(
        model, loader(10)
    )
    assert bar._metric_component is not None
    assert list(bar._metric_component._metrics)[0] == "split" and bar._metric_component._metrics["split"] == "2"
    assert "split" not in bar.get_metrics(bar.trainer, model)
    assert pickle.loads(pickle.dumps(bar))._metric_component._metrics["split"] == "2"  # as Lightning pickles it
