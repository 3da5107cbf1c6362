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
from torch.utils.data import DataLoader

import elastic_batches as eb
from elastic_batches.lightning import ElasticAccumulation, ElasticModule, Trainer

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

# -- hook order -----------------------------------------------------------------------------------

_ORDERED = (
    "on_train_batch_start",
    "training_step",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "optimizer_step",
    "on_train_batch_end",
)


class _HookCallback(pl.Callback):
    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.calls = calls

    def on_train_batch_start(self, *args: Any) -> None:
        self.calls.append(("callback", "on_train_batch_start"))

    def on_before_zero_grad(self, *args: Any) -> None:
        self.calls.append(("callback", "on_before_zero_grad"))

    def on_before_backward(self, *args: Any) -> None:
        self.calls.append(("callback", "on_before_backward"))

    def on_after_backward(self, *args: Any) -> None:
        self.calls.append(("callback", "on_after_backward"))

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.calls.append(("callback", "on_before_optimizer_step"))

    def on_train_batch_end(self, *args: Any) -> None:
        self.calls.append(("callback", "on_train_batch_end"))


class _Hooked(Regression):
    """Records every call of the hooks around a training batch, then runs Lightning's own."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[str, str]] = []
        for name in _ORDERED:
            setattr(self, name, self._recorded(name, getattr(self, name)))

    def _recorded(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(("module", name))
            return method(*args, **kwargs)

        return recorded


_SECOND_MICROBATCH = [
    ("module", "training_step"),
    ("callback", "on_before_backward"),
    ("module", "on_before_backward"),
    ("module", "backward"),
    ("callback", "on_after_backward"),
    ("module", "on_after_backward"),
]


def _with_a_second_microbatch(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The plain order with a second microbatch after the first one's backward: no second zero_grad."""
    out = []
    for call in calls:
        out.append(call)
        if call == ("module", "on_after_backward"):
            out.extend(_SECOND_MICROBATCH)
    return out


def _hooked_fit(factory: Callable[..., pl.Trainer]) -> _Hooked:
    model = _Hooked()
    fit(factory, model, loader(10), max_epochs=1, limit_train_batches=2, callbacks=[_HookCallback(model.calls)])
    return model


def test_hook_order_is_the_plain_trainers_training_step_zero_grad_backward() -> None:
    plain = _hooked_fit(pl.Trainer)
    assert plain.calls[:6] == [
        ("callback", "on_train_batch_start"),
        ("module", "on_train_batch_start"),
        ("module", "optimizer_step"),
        ("module", "training_step"),
        ("callback", "on_before_zero_grad"),
        ("module", "on_before_zero_grad"),
    ]
    whole, split = _hooked_fit(_auto()), _hooked_fit(_auto(2))
    assert whole.calls == plain.calls
    assert split.calls == _with_a_second_microbatch(plain.calls)
    assert_same_parameters(parameters_of(whole), parameters_of(plain), **EXACT)
    assert_same_parameters(parameters_of(split), parameters_of(plain), **EXACT)


class _RaisesOnSecondBatch(Regression):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        if batch_idx == 1:
            raise KeyError("raised by training_step")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("name", list(TRAINERS), ids=list(TRAINERS))
def test_a_batch_whose_training_step_raises_is_neither_zeroed_nor_counted(name: str) -> None:
    model = _RaisesOnSecondBatch()
    trainer = TRAINERS[name](**quiet_trainer_kwargs(max_epochs=1))
    with pytest.raises(KeyError, match="raised by training_step"):
        trainer.fit(model, loader(10))
    zero_grad = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad
    assert (zero_grad.total.ready, zero_grad.total.completed) == (1, 1)
    reference = Regression()  # the first batch's step, and its gradients still in .grad
    fit(pl.Trainer, reference, loader(10), max_epochs=1, limit_train_batches=1)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, **EXACT)


class _ZeroesToZeros(Regression):
    """``optimizer_zero_grad`` that leaves zero tensors (``set_to_none=False``): backward accumulates into them."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize(
    "oom", [{"phase": "forward", "calls": [0, 3]}, {"phase": "backward", "calls": [0, 3]}], ids=["forward", "backward"]
)
def test_zero_grad_in_the_first_microbatch_stays_exact_across_retries(oom: dict[str, Any]) -> None:
    reference = _ZeroesToZeros()
    fit(pl.Trainer, reference, loader(10))
    model = _ZeroesToZeros(oom=oom)
    trainer = fit(_auto(), model, loader(10))
    assert trainer.elastic is not None and trainer.elastic.controllers["train"].retry_count == 2
    assert_same_parameters(parameters_of(model), parameters_of(reference), **EXACT)


class _OneElementLoss(Regression):
    """A loss of shape ``[1, 1]``: Lightning backpropagates any one-element tensor."""

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        return super().training_step(batch, batch_idx).reshape(1, 1)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batch_outputs.append(outputs["loss"].shape)


@pytest.mark.parametrize("name", list(TRAINERS), ids=list(TRAINERS))
def test_a_one_element_loss_that_is_not_a_scalar_trains_as_under_the_plain_trainer(name: str) -> None:
    reference = _OneElementLoss()
    fit(pl.Trainer, reference, loader(10))
    model = _OneElementLoss()
    fit(TRAINERS[name], model, loader(10))
    assert model.batch_outputs == reference.batch_outputs == [torch.Size([1, 1])] * 8
    assert_same_parameters(parameters_of(model), parameters_of(reference), **EXACT)


# -- training_step returning None ---------------------------------------------------------------


class _SkipsOddBatches(Regression):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


@pytest.mark.parametrize("name", list(TRAINERS), ids=list(TRAINERS))
def test_a_batch_whose_training_step_returns_none_is_skipped_as_lightning_skips_it(name: str) -> None:
    reference = _SkipsOddBatches(optimizer="adam")
    plain = fit(pl.Trainer, reference, loader(10))
    model = _SkipsOddBatches(optimizer="adam")
    trainer = fit(TRAINERS[name], model, loader(10))
    assert trainer.global_step == plain.global_step == 8
    assert_same_parameters(parameters_of(model), parameters_of(reference), **EXACT)


class _NoneOnSecondMicrobatch(ElasticModule, Regression):
    def on_train_microbatch_start(self, microbatch: eb.Microbatch) -> None:
        self.microbatch_index = microbatch.index

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if self.microbatch_index == 1 else loss


def test_some_microbatches_returning_none_and_others_a_loss_is_a_clear_error() -> None:
    trainer = _auto(2)(**quiet_trainer_kwargs())
    mix = r"returned None on microbatch\(es\) \[1\] and a loss on microbatch\(es\) \[0\]"
    with pytest.raises(ValueError, match=mix):
        trainer.fit(_NoneOnSecondMicrobatch(), loader(10))


# -- batches that cannot be cut -------------------------------------------------------------------


class _IndexedBatches(Regression):
    """Batches that are an int, or a dict of an int and ``None``: the step looks its rows up itself."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        generator = torch.Generator().manual_seed(2)
        self.x, self.y = torch.randn(4, 5, 4, generator=generator), torch.randn(4, 5, 1, generator=generator)

    def _rows(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        index = batch if isinstance(batch, int) else batch["index"]
        return self.x[index], self.y[index]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self._rows(batch)
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = self._rows(batch)
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), batch_size=len(x))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(self._rows(batch)[0])


def _indexed(kind: str) -> DataLoader:
    if kind == "int":
        return DataLoader(list(range(4)), batch_size=None)
    return DataLoader(list(range(4)), batch_size=1, collate_fn=lambda samples: {"index": samples[0], "note": None})


@pytest.mark.parametrize("kind", ["int", "dict-of-int-and-none"])
def test_batches_that_cannot_be_cut_run_whole_at_split_one_in_every_stage(kind: str) -> None:
    reference = _IndexedBatches()
    plain = pl.Trainer(**quiet_trainer_kwargs())
    plain.fit(reference, _indexed(kind), _indexed(kind))
    want_val = plain.validate(reference, _indexed(kind), verbose=False)
    want_predictions = plain.predict(reference, _indexed(kind))
    model = _IndexedBatches()
    trainer = _auto()(**quiet_trainer_kwargs())
    trainer.fit(model, _indexed(kind), _indexed(kind))
    assert_same_parameters(parameters_of(model), parameters_of(reference), rtol=0, atol=0)
    assert trainer.validate(model, _indexed(kind), verbose=False) == want_val
    for got, want in zip(trainer.predict(model, _indexed(kind)), want_predictions, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


_UNSPLIT = (
    r"a batch of type int that cannot be split .*run whole, as under Lightning's Trainer.*register_batch_type\(int"
)


def _whole(trainer: pl.Trainer, stage: str, model: pl.LightningModule) -> Any:
    if stage == "fit":
        trainer.fit(model, _indexed("int"))
        return parameters_of(model)
    if stage == "validate":
        return trainer.validate(model, _indexed("int"), verbose=False)
    return trainer.predict(model, _indexed("int"))


@pytest.mark.parametrize("stage", ["fit", "validate", "predict"])
def test_a_batch_that_cannot_be_cut_runs_whole_at_split_two_with_one_warning_naming_register_batch_type(
    stage: str,
) -> None:
    want = _whole(pl.Trainer(**quiet_trainer_kwargs()), stage, _IndexedBatches())
    with pytest.warns(UserWarning, match=_UNSPLIT) as caught:
        got = _whole(_auto(2)(**quiet_trainer_kwargs()), stage, _IndexedBatches())
    assert len([w for w in caught if "cannot be split" in str(w.message)]) == 1  # 8 (4) batches, one warning
    if stage == "validate":
        assert got == want
    else:
        assert_same_parameters(got, want, rtol=0, atol=0)


def test_an_oom_in_a_whole_batch_that_cannot_be_cut_is_lightnings_own_and_not_retried() -> None:
    trainer = _auto()(**quiet_trainer_kwargs())
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        trainer.fit(_IndexedBatches(oom={"phase": "forward", "calls": [0]}), _indexed("int"))
    assert trainer.elastic.controllers["train"].retry_count == 0


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
    assert all(ours[name].default == lightnings[name].default for name in ours if name != "accumulate_grad_batches")
    assert "auto" in str(ours["accumulate_grad_batches"].annotation)
    # None: PL_TRAINER_ACCUMULATE_GRAD_BATCHES, else Lightning's 1 (LightningCLI passes every default)
    assert ours["accumulate_grad_batches"].default is None
    assert Trainer(logger=False, enable_checkpointing=False).accumulate_grad_batches == 1


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


_CLI_ARGUMENTS = ["--trainer.max_epochs", "1", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
_CLI_ARGUMENTS += ["--trainer.enable_progress_bar", "false"]


def test_pl_trainer_accumulate_grad_batches_auto_is_honoured_under_lightning_cli(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setenv("PL_TRAINER_ACCUMULATE_GRAD_BATCHES", "auto")
    cli = LightningCLI(Regression, trainer_class=Trainer, args=_CLI_ARGUMENTS, run=False, save_config_callback=None)
    assert isinstance(cli.trainer.elastic, ElasticAccumulation)
    given = ["--trainer.accumulate_grad_batches", "2", *_CLI_ARGUMENTS]  # an argument given wins over the variable
    cli = LightningCLI(Regression, trainer_class=Trainer, args=given, run=False, save_config_callback=None)
    assert cli.trainer.elastic is None and cli.trainer.accumulate_grad_batches == 2


def test_pl_trainer_accumulate_grad_batches_auto_is_refused_by_lightnings_own_trainer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PL_TRAINER_ACCUMULATE_GRAD_BATCHES", "auto")
    refused = r"PL_TRAINER_ACCUMULATE_GRAD_BATCHES=auto reached lightning\.pytorch\.trainer\.trainer\.Trainer, which"
    with pytest.raises(ValueError, match=refused + r".*trainer_class=elastic_batches\.lightning\.Trainer"):
        pl.Trainer(logger=False, enable_checkpointing=False)
