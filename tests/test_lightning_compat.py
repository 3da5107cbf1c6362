"""Unchanged Lightning code under ``accumulate_grad_batches="auto"`` behaves as under the plain Trainer.

Each test runs the same LightningModule under ``lightning.pytorch.Trainer`` and under
``elastic_batches.lightning.Trainer(accumulate_grad_batches="auto")``, whole and split in two
(``SplitController(split_count=2)``), and asserts Lightning's own behaviour: the order of the
hooks, what a failing or skipped step leaves behind, batches that cannot be cut, ``self.log``'s
checks at the call, the checkpoint's keys, the Trainer's signature and environment defaults,
LightningCLI, and weights equal within 1e-6.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_models import (
    Regression,
    assert_same_parameters,
    fit,
    loader,
    parameters_of,
    quiet_trainer_kwargs,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import elastic_batches as eb
from elastic_batches.lightning import ElasticAccumulation, Trainer

EXACT = {"rtol": 1e-6, "atol": 1e-6}


def _auto(split: int = 1, **elastic: Any) -> Callable[..., pl.Trainer]:
    """A factory of ``Trainer(accumulate_grad_batches="auto")`` whose train controller starts at ``split``."""

    def factory(**kwargs: Any) -> pl.Trainer:
        controllers = {stage: eb.SplitController(split_count=split) for stage in ("train", "validate", "predict")}
        callback = ElasticAccumulation(controllers=controllers, **elastic)
        callbacks = [*kwargs.pop("callbacks", []), callback]
        return Trainer(accumulate_grad_batches="auto", callbacks=callbacks, **kwargs)

    return factory


TRAINERS = {"plain": pl.Trainer, "auto": _auto(), "auto-split-2": _auto(2)}

# -- self.log: Lightning's checks at the call -----------------------------------------------------


class _LogChecks(Regression):
    """Logs a value Lightning refuses, and records whether the refusal came inside the step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refused: list[str] = []
        self.logged_at_the_call: list[bool] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        try:
            self.log("two_values", torch.ones(2))
        except ValueError as err:
            self.refused.append(str(err))
        self.logged_at_the_call.append("training_step.train_loss" in self.trainer._results)
        return loss

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        try:
            self.log("predicted", 1.0)
        except MisconfigurationException as err:
            self.refused.append(str(err))
        return super().predict_step(batch, batch_idx)


@pytest.mark.parametrize("name", list(TRAINERS), ids=list(TRAINERS))
def test_self_log_checks_its_value_and_the_hook_at_the_call_inside_the_step(name: str) -> None:
    model = _LogChecks()
    trainer = TRAINERS[name](**quiet_trainer_kwargs(max_epochs=1, limit_train_batches=1))
    trainer.fit(model, loader(10))
    trainer.predict(model, loader(10), return_predictions=False)
    microbatches = 2 if name == "auto-split-2" else 1
    assert len(model.refused) == microbatches + 4 * microbatches
    assert all("must have a single element" in message for message in model.refused[:microbatches])
    assert all("predict" in message for message in model.refused[microbatches:])
    assert model.logged_at_the_call == ([False, False] if name == "auto-split-2" else [True])  # split: combined later


# -- checkpoints ----------------------------------------------------------------------------------


def _keys(tree: Any, prefix: str = "") -> set[str]:
    if not isinstance(tree, dict):
        return {prefix}
    return {key for k, v in tree.items() for key in _keys(v, f"{prefix}/{k}")} or {prefix}


def _checkpoint(factory: Callable[..., pl.Trainer], path: Path, model: pl.LightningModule, epochs: int) -> None:
    """Fit for ``epochs`` with a ``ModelCheckpoint`` that writes ``path`` at each epoch's end (during the fit)."""
    checkpoint = ModelCheckpoint(dirpath=path.parent, filename=path.stem)
    fit(factory, model, loader(10), max_epochs=epochs, enable_checkpointing=True, callbacks=[checkpoint])


def test_a_checkpoint_has_the_plain_trainers_keys_plus_the_callbacks_state(tmp_path: Path) -> None:
    _checkpoint(pl.Trainer, tmp_path / "plain.ckpt", Regression(), 1)
    _checkpoint(_auto(2), tmp_path / "auto.ckpt", Regression(), 1)
    plain = torch.load(tmp_path / "plain.ckpt", weights_only=False)
    auto = torch.load(tmp_path / "auto.ckpt", weights_only=False)
    assert _keys({k: v for k, v in auto.items() if k != "callbacks"}) == _keys(
        {k: v for k, v in plain.items() if k != "callbacks"}
    )
    assert auto["loops"] == plain["loops"]
    assert set(auto["callbacks"]) == set(plain["callbacks"]) | {"ElasticAccumulation"}
    restored = ElasticAccumulation()
    restored.load_state_dict(auto["callbacks"]["ElasticAccumulation"])
    assert restored.controllers["train"].split_count == 2


@pytest.mark.parametrize("way", ["plain-into-auto", "auto-into-plain"])
def test_checkpoints_resume_both_ways_as_an_uninterrupted_run(tmp_path: Path, way: str) -> None:
    reference = Regression()
    fit(pl.Trainer, reference, loader(10), max_epochs=4)
    first, then = (pl.Trainer, _auto(2)) if way == "plain-into-auto" else (_auto(2), pl.Trainer)
    _checkpoint(first, tmp_path / "half.ckpt", Regression(), 2)
    resumed = Regression()
    trainer = then(**quiet_trainer_kwargs(max_epochs=4))
    if way == "auto-into-plain":  # Lightning's warning for any callback state the Trainer has no callback for
        with pytest.warns(UserWarning, match="ElasticAccumulation"):
            trainer.fit(resumed, loader(10), ckpt_path=tmp_path / "half.ckpt")
    else:
        trainer.fit(resumed, loader(10), ckpt_path=tmp_path / "half.ckpt")
    assert trainer.global_step == 16
    assert_same_parameters(parameters_of(resumed), parameters_of(reference), **EXACT)


# -- the Trainer's signature ------------------------------------------------------------------------


def test_the_trainer_has_lightnings_signature_with_auto_accepted() -> None:
    ours, lightnings = inspect.signature(Trainer).parameters, inspect.signature(pl.Trainer).parameters
    assert list(ours) == list(lightnings)
    assert all(ours[name].default == lightnings[name].default for name in ours)
    assert "auto" in str(ours["accumulate_grad_batches"].annotation)


@pytest.mark.parametrize("accumulate", [None, "auto"], ids=["no-auto", "auto-from-the-environment"])
def test_pl_trainer_environment_variables_set_the_defaults(monkeypatch: pytest.MonkeyPatch, accumulate: Any) -> None:
    monkeypatch.setenv("PL_TRAINER_MAX_EPOCHS", "7")
    monkeypatch.setenv("PL_TRAINER_LOG_EVERY_N_STEPS", "3")
    if accumulate is not None:
        monkeypatch.setenv("PL_TRAINER_ACCUMULATE_GRAD_BATCHES", accumulate)
    trainer = Trainer(logger=False, enable_checkpointing=False, log_every_n_steps=5)
    assert (trainer.max_epochs, trainer.log_every_n_steps) == (7, 5)  # an argument given wins over the environment
    assert (trainer.elastic is not None) == (accumulate == "auto")


def test_accumulate_grad_batches_reads_the_outer_accumulation_from_construction_on() -> None:
    elastic = ElasticAccumulation(accumulate_grad_batches=3)
    trainer = Trainer(**quiet_trainer_kwargs(accumulate_grad_batches="auto", callbacks=[elastic]))
    assert trainer.accumulate_grad_batches == 3
    trainer.fit(Regression(), loader(10))
    assert trainer.accumulate_grad_batches == 3 and trainer.global_step == 4


def test_lightning_cli_with_the_trainer_class_takes_accumulate_grad_batches_auto() -> None:
    from lightning.pytorch.cli import LightningCLI

    arguments = ["--trainer.accumulate_grad_batches", "auto", "--trainer.max_epochs", "1", "--trainer.logger", "false"]
    arguments += ["--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false"]
    arguments += ["--model.lr", "0.05"]
    cli = LightningCLI(Regression, trainer_class=Trainer, args=arguments, run=False, save_config_callback=None)
    assert isinstance(cli.trainer, Trainer) and isinstance(cli.trainer.elastic, ElasticAccumulation)
    assert (cli.trainer.max_epochs, cli.model.lr) == (1, 0.05)
    cli.trainer.fit(cli.model, loader(10))
    assert cli.trainer.global_step == 4
