"""``elastic_batches.lightning`` in one process: real ``Trainer`` runs on CPU against a plain-Trainer reference.

Every equivalence test trains the same model twice, with ``lightning.pytorch.Trainer`` on
whole batches and with ``accumulate_grad_batches="auto"`` where out-of-memory errors force the
batches to be split, and compares the weights within 1e-5 relative (float32, deterministic).
"""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from _lightning_models import (
    ElasticManual,
    IdDataset,
    Manual,
    RecordingLogger,
    Regression,
    assert_same_parameters,
    fit,
    loader,
    parameters_of,
    quiet_trainer_kwargs,
)
from lightning.pytorch.callbacks import BatchSizeFinder, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

import elastic_batches as eb
import elastic_batches.lightning as ebl
from elastic_batches.lightning import ElasticAccumulation, ElasticDataModule, ElasticModule, Trainer
from elastic_batches.testing import MemoryBudget, inject_oom

AUTO = {"accumulate_grad_batches": "auto"}


def _relative_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got, want, strict=True))


# -- the package ------------------------------------------------------------------------------


def test_public_names_import_and_have_docstrings() -> None:
    for name in ebl.__all__:
        assert getattr(ebl, name).__doc__, name
    assert issubclass(Trainer, pl.Trainer)


def test_import_without_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [
        n for n in sys.modules if n == "elastic_batches.lightning" or n.startswith("elastic_batches.lightning.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(ImportError, match=r'pip install "elastic-batches\[lightning\]"'):
        importlib.import_module("elastic_batches.lightning")


def test_accumulate_grad_batches_auto_adds_the_callback_and_an_int_keeps_lightnings_meaning() -> None:
    auto = Trainer(**quiet_trainer_kwargs(**AUTO))
    assert isinstance(auto.elastic, ElasticAccumulation) and auto.accumulate_grad_batches == 1
    mine = ElasticAccumulation(accumulate_grad_batches=3)
    assert Trainer(**quiet_trainer_kwargs(callbacks=[mine], **AUTO)).elastic is mine
    plain = Trainer(**quiet_trainer_kwargs(accumulate_grad_batches=2))
    assert plain.elastic is None and plain.accumulate_grad_batches == 2


def test_an_unknown_string_is_refused() -> None:
    with pytest.raises(ValueError, match="must be an int or 'auto'"):
        Trainer(accumulate_grad_batches="max")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accumulate_grad_batches": 0}, "must be an int >= 1"),
        ({"controllers": {"training": eb.SplitController()}}, r"unknown stage\(s\) \['training'\]"),
        ({"gather": "layer"}, r"gather must be one of \['auto', 'attempt', 'module'\], got 'layer'"),
    ],
    ids=["accumulate-0", "unknown-stage", "gather"],
)
def test_callback_arguments_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ElasticAccumulation(**kwargs)


def test_a_memory_that_is_no_probe_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"ElasticAccumulation: memory must be 'auto', None or an .*MemoryProbe"):
        ElasticAccumulation(memory="cuda")


# -- training equals the plain Trainer ----------------------------------------------------------


@pytest.mark.parametrize(
    ("oom", "optimizer", "clip"),
    [
        ({"phase": "forward", "calls": [0]}, "sgd", {}),
        ({"phase": "backward", "calls": [0, 3]}, "adam", {"gradient_clip_val": 0.05}),
        ({"phase": "backward", "calls": [1]}, "sgd", {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    ],
    ids=["forward-oom-sgd", "backward-oom-adam-clip-norm", "backward-oom-sgd-clip-value"],
)
def test_weights_equal_the_plain_trainer(oom: dict[str, Any], optimizer: str, clip: dict[str, Any]) -> None:
    reference = Regression(optimizer=optimizer)
    plain = fit(pl.Trainer, reference, loader(10, shuffle=True), **clip)
    model = Regression(optimizer=optimizer, oom=oom)
    trainer = fit(Trainer, model, loader(10, shuffle=True), **clip, **AUTO)
    assert trainer.elastic is not None and trainer.elastic.controllers["train"].retry_count >= 1
    assert trainer.global_step == plain.global_step == 8
    assert trainer.estimated_stepping_batches == plain.estimated_stepping_batches
    assert_same_parameters(parameters_of(model), parameters_of(reference))


def test_a_memory_budget_forces_a_split_and_the_weights_still_equal_the_plain_trainer() -> None:
    reference = Regression()
    fit(pl.Trainer, reference, loader(20))
    model = Regression()
    with MemoryBudget(limit_bytes=4_800):  # a step on 20 rows needs ~5.9 kB here, on 10 rows ~3.8 kB
        # memory=None: the OOM-driven search (memory="auto" would measure with the active budget and predict)
        trainer = fit(Trainer, model, loader(20), callbacks=[ElasticAccumulation(memory=None)], **AUTO)
    controller = trainer.elastic.controllers["train"]
    assert controller.split_count > 1 and controller.retry_count >= 1
    assert_same_parameters(parameters_of(model), parameters_of(reference))


def test_a_memory_probe_predicts_the_split_without_an_oom_and_the_weights_equal_the_plain_trainer() -> None:
    reference = Regression()
    fit(pl.Trainer, reference, loader(20))
    model = Regression()
    budget = MemoryBudget(limit_bytes=4_800)  # as above: 20 rows do not fit, 10 do
    with budget:
        trainer = fit(Trainer, model, loader(20), callbacks=[ElasticAccumulation(memory=budget)], **AUTO)
    controller = trainer.elastic.controllers["train"]
    assert controller.predicting() and controller.split_count > 1
    assert budget.oom_count == controller.oom_count == 0  # the first batch measured a microbatch at a time
    assert_same_parameters(parameters_of(model), parameters_of(reference))


def test_the_callback_on_a_plain_trainer_with_an_outer_accumulation() -> None:
    reference = Regression()
    fit(pl.Trainer, reference, loader(10), accumulate_grad_batches=2)
    model = Regression(oom={"phase": "backward", "calls": [0, 2]})
    elastic = ElasticAccumulation(accumulate_grad_batches=2)
    trainer = fit(pl.Trainer, model, loader(10), callbacks=[elastic])
    assert trainer.global_step == 4 and elastic.controllers["train"].retry_count >= 1
    assert_same_parameters(parameters_of(model), parameters_of(reference))


def test_bf16_mixed_splits_with_no_more_error_than_bf16_itself() -> None:
    # Microbatches round differently from the whole batch in bfloat16: the split run is held to
    # the distance between bf16 and float32 training, and the unsplit run to exact equality.
    float32 = Regression()
    fit(pl.Trainer, float32, loader(10))
    reference = Regression()
    fit(pl.Trainer, reference, loader(10), precision="bf16-mixed")
    unsplit = Regression()
    fit(Trainer, unsplit, loader(10), precision="bf16-mixed", **AUTO)
    split = Regression(oom={"phase": "forward", "calls": [0]})
    trainer = fit(Trainer, split, loader(10), precision="bf16-mixed", **AUTO)
    assert trainer.elastic.controllers["train"].split_count == 2
    assert_same_parameters(parameters_of(unsplit), parameters_of(reference), rtol=0, atol=0)
    bf16_error = _relative_difference(parameters_of(reference), parameters_of(float32))
    assert _relative_difference(parameters_of(split), parameters_of(reference)) <= 2 * bf16_error


def test_16_mixed_with_a_grad_scaler_scales_every_microbatch() -> None:
    def plugin() -> MixedPrecision:
        return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))

    float32 = Regression()
    fit(pl.Trainer, float32, loader(10))
    reference = Regression()
    fit(pl.Trainer, reference, loader(10), plugins=[plugin()])
    split = Regression(oom={"phase": "backward", "calls": [0]})
    trainer = fit(Trainer, split, loader(10), plugins=[plugin()], **AUTO)
    assert trainer.elastic.controllers["train"].split_count == 2
    fp16_error = _relative_difference(parameters_of(reference), parameters_of(float32))
    assert _relative_difference(parameters_of(split), parameters_of(reference)) <= 2 * fp16_error


@pytest.mark.parametrize(
    "scheduler",
    [{"interval": "step", "frequency": 3}, {"interval": "epoch", "frequency": 1}],
    ids=["step-every-3", "epoch"],
)
def test_lr_schedulers_step_as_in_the_plain_trainer(scheduler: dict[str, Any]) -> None:
    monitor_plain, monitor_auto = LearningRateMonitor("step"), LearningRateMonitor("step")
    reference = Regression(scheduler=scheduler)
    fit(pl.Trainer, reference, loader(10), callbacks=[monitor_plain], logger=RecordingLogger())
    model = Regression(scheduler=scheduler, oom={"phase": "forward", "calls": [0, 4]})
    fit(Trainer, model, loader(10), callbacks=[monitor_auto], logger=RecordingLogger(), **AUTO)
    assert monitor_auto.lrs == monitor_plain.lrs
    assert_same_parameters(parameters_of(model), parameters_of(reference))


# -- logging ------------------------------------------------------------------------------------


def test_logged_values_are_the_full_batch_values_and_a_retry_leaves_nothing() -> None:
    plain_logger, auto_logger = RecordingLogger(), RecordingLogger()
    fit(pl.Trainer, Regression(), loader(10), loader(20), logger=plain_logger, log_every_n_steps=1)
    model = Regression(oom={"phase": "backward", "calls": [0, 3]})
    fit(Trainer, model, loader(10), loader(20), logger=auto_logger, log_every_n_steps=1, **AUTO)
    for name in ("train_loss_step", "train_loss_epoch", "train_max_error_epoch", "train_rows", "val_loss"):
        want = plain_logger.values(name)
        assert want, name
        assert auto_logger.values(name) == pytest.approx(want, rel=1e-5), name
    assert auto_logger.values("train_rows") == [10.0] * 8


_CHANGE = (
    "elastic_batches: train split count 1 -> 2 (largest microbatch 5 rows; microbatches of at most 5 rows fit; "
    "1 OOM retries so far)"
)


def test_log_metrics_logs_the_elastic_metrics_and_each_change_is_an_info_line(caplog: pytest.LogCaptureFixture) -> None:
    recording = RecordingLogger()
    model = Regression(oom={"phase": "backward", "calls": [0]})
    elastic = ElasticAccumulation(log_metrics=True)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer = fit(Trainer, model, loader(10), logger=recording, log_every_n_steps=1, callbacks=[elastic], **AUTO)
    assert recording.values("elastic/split_count") == [2.0] * 8
    assert recording.values("elastic/microbatch_size") == [5.0] * 8
    assert recording.values("elastic/oom_retries") == [1.0] * 8
    assert trainer.progress_bar_metrics["elastic/split_count"] == 2.0  # shown in the progress bar
    changes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("elastic_batches:")]
    assert changes == [_CHANGE]  # through Lightning's rank-zero messages


def test_a_change_of_split_count_reaches_the_console_without_any_logging_set_up() -> None:
    """As Lightning's own "GPU available" lines do, in a fresh process where nothing configured logging."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from _lightning_models import Regression, fit, loader
from elastic_batches.lightning import Trainer
model = Regression(oom={{"phase": "backward", "calls": [0]}})
fit(Trainer, model, loader(10), max_epochs=1, accumulate_grad_batches="auto")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _CHANGE in result.stdout + result.stderr


def test_training_step_dict_outputs_reach_on_train_batch_end_combined() -> None:
    reference = Regression(return_dict=True)
    fit(pl.Trainer, reference, loader(10), max_epochs=1)
    model = Regression(return_dict=True, oom={"phase": "forward", "calls": [0]})
    fit(Trainer, model, loader(10), max_epochs=1, **AUTO)
    for got, want in zip(model.batch_outputs, reference.batch_outputs, strict=True):
        assert got.keys() == want.keys() == {"loss", "prediction", "mae"}
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)


class _MetricModel(Regression):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import torchmetrics

        self.mae = torchmetrics.MeanAbsoluteError()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        prediction = self(batch["x"])
        self.mae.update(prediction, batch["y"])
        self.log("train_mae", self.mae, on_step=False, on_epoch=True)
        return torch.nn.functional.mse_loss(prediction, batch["y"])


def test_a_torchmetrics_metric_counts_each_sample_once_despite_retries() -> None:
    plain_logger, auto_logger = RecordingLogger(), RecordingLogger()
    fit(pl.Trainer, _MetricModel(), loader(10), logger=plain_logger)
    fit(Trainer, _MetricModel(oom={"phase": "backward", "calls": [1, 4]}), loader(10), logger=auto_logger, **AUTO)
    assert auto_logger.values("train_mae") == pytest.approx(plain_logger.values("train_mae"), rel=1e-5)


# -- checkpoints, early stopping, resume ----------------------------------------------------------


def test_model_checkpoint_and_early_stopping_behave_as_in_the_plain_trainer(tmp_path: Any) -> None:
    def callbacks(name: str) -> list[pl.Callback]:
        return [
            ModelCheckpoint(dirpath=tmp_path / name, monitor="val_loss", save_top_k=2),
            EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0),
        ]

    common = {"max_epochs": 6, "enable_checkpointing": True}
    plain = fit(pl.Trainer, Regression(), loader(10), loader(20), callbacks=callbacks("plain"), **common)
    model = Regression(oom={"phase": "backward", "calls": [0]})
    auto = fit(Trainer, model, loader(10), loader(20), callbacks=callbacks("auto"), **common, **AUTO)
    assert auto.current_epoch == plain.current_epoch < 6  # stopped early, at the same epoch
    plain_ckpt, auto_ckpt = plain.checkpoint_callback, auto.checkpoint_callback
    assert float(auto_ckpt.best_model_score) == pytest.approx(float(plain_ckpt.best_model_score), rel=1e-5)
    assert sorted(p.split("/")[-1] for p in auto_ckpt.best_k_models) == sorted(
        p.split("/")[-1] for p in plain_ckpt.best_k_models
    )


def test_resume_from_a_checkpoint_keeps_the_learned_split_count_and_says_it_was_restored(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    reference = Regression()
    fit(pl.Trainer, reference, loader(20), max_epochs=4)

    budget = 4_800  # a step on 20 rows needs ~5.9 kB here, on 10 rows ~3.8 kB
    first = Regression()
    with MemoryBudget(limit_bytes=budget):
        trainer = fit(Trainer, first, loader(20), max_epochs=2, **AUTO)
    learned = trainer.elastic.controllers["train"]
    assert learned.split_count > 1
    trainer.save_checkpoint(tmp_path / "half.ckpt")

    resumed = Regression()
    again = Trainer(**quiet_trainer_kwargs(max_epochs=4, **AUTO))
    caplog.clear()
    with MemoryBudget(limit_bytes=budget) as memory, caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        again.fit(resumed, loader(20), ckpt_path=tmp_path / "half.ckpt")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("elastic_batches:")]
    restored = f"elastic_batches: train split count {learned.split_count}, restored from the checkpoint ("
    assert len(lines) == 1 and lines[0].startswith(restored), lines  # no "1 -> 2" line, which reads as a new OOM
    assert lines[0].endswith(f"; {learned.retry_count} OOM retries before it)")
    controller = again.elastic.controllers["train"]
    assert controller.split_count == learned.split_count
    assert (controller.oom_count, memory.oom_count) == (learned.oom_count, 0)  # no OOM descent after resume
    assert_same_parameters(parameters_of(resumed), parameters_of(reference))


# -- validate, test, predict ----------------------------------------------------------------------


def test_evaluation_stages_split_with_their_own_controllers() -> None:
    model = Regression()
    plain = pl.Trainer(**quiet_trainer_kwargs(logger=RecordingLogger()))
    want_val = plain.validate(model, loader(20), verbose=False)
    want_test = plain.test(model, loader(20), verbose=False)
    want_predictions = plain.predict(model, loader(20))

    trainer = Trainer(**quiet_trainer_kwargs(logger=RecordingLogger(), **AUTO))
    # 2 batches per stage; the first OOMs, then 2 + 2 forward calls: stage starts at calls 0, 5, 10
    with inject_oom(model.net, phase="forward", calls=[0, 5, 10]):
        got_val = trainer.validate(model, loader(20), verbose=False)
        got_test = trainer.test(model, loader(20), verbose=False)
        got_predictions = trainer.predict(model, loader(20))
    controllers = trainer.elastic.controllers
    assert [controllers[s].retry_count for s in ("validate", "test", "predict", "train")] == [1, 1, 1, 0]
    assert len({id(c) for c in controllers.values()}) == 4
    assert got_val[0]["val_loss"] == pytest.approx(want_val[0]["val_loss"], rel=1e-6)
    assert got_test[0]["test_loss"] == pytest.approx(want_test[0]["test_loss"], rel=1e-6)
    assert len(got_predictions) == len(want_predictions) == 2
    for got, want in zip(got_predictions, want_predictions, strict=True):
        assert got["id"].tolist() == want["id"].tolist()  # concatenated in the original order
        torch.testing.assert_close(got["prediction"], want["prediction"], rtol=1e-6, atol=1e-7)


def test_split_evaluation_false_leaves_evaluation_batches_whole() -> None:
    model = Regression()
    elastic = ElasticAccumulation(split_evaluation=False)
    trainer = pl.Trainer(**quiet_trainer_kwargs(callbacks=[elastic]))
    with inject_oom(model.net, phase="forward", calls=0), pytest.raises(torch.OutOfMemoryError, match="injected"):
        trainer.validate(model, loader(20), verbose=False)


def test_teardown_leaves_the_trainer_as_it_was() -> None:
    trainer = Trainer(**quiet_trainer_kwargs(**AUTO))
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    trainer.fit(Regression(), loader(10))
    assert trainer.fit_loop.epoch_loop.automatic_optimization is loop
    assert not {"validation_step", "test_step", "predict_step"} & set(vars(trainer.strategy))


# -- warnings and refusals ------------------------------------------------------------------------


def test_batchnorm_with_a_split_warns_once() -> None:
    model = Regression(batchnorm=True, oom={"phase": "forward", "calls": [0]})
    with pytest.warns(UserWarning, match=r"BatchNorm layers in training mode \(BatchNorm1d 'net.1'\)") as record:
        fit(Trainer, model, loader(10), **AUTO)
    assert sum("BatchNorm1d" in str(w.message) for w in record) == 1


def test_batch_size_finder_with_auto_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="BatchSizeFinder cannot be combined with accumulate_grad_batches='auto'"):
        Trainer(**quiet_trainer_kwargs(callbacks=[BatchSizeFinder()], **AUTO))


class _Tunable(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 10

    def train_dataloader(self) -> DataLoader:
        return loader(self.batch_size)


def test_batch_size_finder_with_the_callback_is_a_clear_error_before_any_search() -> None:
    trainer = pl.Trainer(**quiet_trainer_kwargs(callbacks=[BatchSizeFinder(), ElasticAccumulation()]))
    with pytest.raises(ValueError, match="BatchSizeFinder cannot be combined with accumulate_grad_batches='auto'"):
        trainer.fit(_Tunable())


def test_fsdp1_is_refused_with_the_fsdp2_way_to_go() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    elastic = ElasticAccumulation()
    trainer = SimpleNamespace(callbacks=[elastic], strategy=FSDPStrategy())  # FSDPStrategy needs a GPU to run
    with pytest.raises(ValueError, match="does not support FSDPStrategy.*ModelParallelStrategy"):
        elastic.setup(trainer, Regression(), "fit")  # type: ignore[arg-type]


def test_manual_optimization_with_elastic_backward_equals_the_plain_manual_run() -> None:
    reference = Manual()
    fit(pl.Trainer, reference, loader(10))
    model = ElasticManual(oom={"phase": "backward", "calls": [0]})
    trainer = fit(Trainer, model, loader(10), **AUTO)
    assert trainer.elastic.controllers["train"].split_count == 2
    assert_same_parameters(parameters_of(model), parameters_of(reference))


@pytest.mark.parametrize("trainer_class", [Trainer, pl.Trainer], ids=["with-callback", "plain-trainer"])
def test_manual_optimization_keeps_one_step_and_its_gradient_sync_for_the_fit(
    monkeypatch: pytest.MonkeyPatch, trainer_class: Any
) -> None:
    """A step made anew every batch would rebuild its sync: DDP's buffers, and a separate vote every step."""
    built: list[torch.nn.Module] = []
    original = eb.step.gradient_sync_for

    def counted(model: torch.nn.Module, **options: Any) -> Any:
        built.append(model)
        return original(model, **options)

    monkeypatch.setattr(eb.step, "gradient_sync_for", counted)
    model = ElasticManual()
    fit(trainer_class, model, loader(10), **(AUTO if trainer_class is Trainer else {}))
    assert len(built) == 1  # 2 epochs of 4 batches


# -- the mixins ---------------------------------------------------------------------------------


class _Tokens(ElasticModule, pl.LightningModule):
    """A loss that is a mean over the non-ignored targets of the batch (label -100 is ignored)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 3)
        self.microbatches: list[tuple[int, int, float]] = []

    def elastic_count(self, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (microbatch["labels"] != -100).sum()

    def on_train_microbatch_start(self, microbatch: eb.Microbatch) -> None:
        self.microbatches.append((microbatch.index, microbatch.count, microbatch.weight))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.net(batch["x"])  # [B, T, 3]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _token_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(12, 5, 4, generator=generator)
    labels = torch.randint(0, 3, (12, 5), generator=generator)
    labels[torch.arange(12).unsqueeze(1) < torch.arange(5)] = -100  # sample i keeps min(i + 1, 5) targets
    samples = [{"x": x[i], "labels": labels[i]} for i in range(12)]
    return DataLoader(samples, batch_size=12)


def test_module_mixin_weights_microbatches_by_counted_items_and_calls_its_hooks() -> None:
    reference = _Tokens()
    fit(pl.Trainer, reference, _token_loader(), max_epochs=3)
    model = _Tokens()
    with inject_oom(model.net, phase="forward", calls=0):
        trainer = fit(Trainer, model, _token_loader(), max_epochs=3, **AUTO)
    assert trainer.elastic.controllers["train"].split_count == 2
    assert [(i, c) for i, c, _ in model.microbatches[:3]] == [(0, 1), (0, 2), (1, 2)]
    assert model.microbatches[1][2] == pytest.approx(20 / 50)  # rows 0-5 keep 1+2+3+4+5+5 of 50 targets
    assert_same_parameters(parameters_of(model), parameters_of(reference))
    assert model.elastic_controllers is trainer.elastic.controllers


class _Data(ElasticDataModule, pl.LightningDataModule):
    def train_dataloader(self) -> eb.MicrobatchingDataLoader:
        return self.elastic_dataloader(IdDataset(), batch_size=10)

    def val_dataloader(self) -> eb.MicrobatchingDataLoader:
        return self.elastic_dataloader(IdDataset(), batch_size=20, stage="validate")


def test_datamodule_mixin_loaders_share_the_trainers_controllers_and_train_the_same() -> None:
    reference = Regression()
    plain_logger, auto_logger = RecordingLogger(), RecordingLogger()
    fit(pl.Trainer, reference, loader(10), loader(20), logger=plain_logger, log_every_n_steps=1)
    model = Regression(oom={"phase": "backward", "calls": [0]}, record_ids=True)
    data = _Data()
    trainer = Trainer(**quiet_trainer_kwargs(logger=auto_logger, log_every_n_steps=1, **AUTO))
    trainer.fit(model, datamodule=data)
    loader_ = trainer.train_dataloader
    assert isinstance(loader_, eb.MicrobatchingDataLoader)
    assert loader_.controller is trainer.elastic.controllers["train"] is data.elastic_controller("train")
    assert trainer.elastic.controllers["train"].split_count == 2
    assert sorted(model.seen) == sorted(list(range(40)) * 2)
    assert_same_parameters(parameters_of(model), parameters_of(reference))
    assert auto_logger.values("val_loss") == pytest.approx(plain_logger.values("val_loss"), rel=1e-5)
    assert auto_logger.values("train_loss_epoch") == pytest.approx(plain_logger.values("train_loss_epoch"), rel=1e-5)


def _build_under_lightning_capture(build: Any) -> eb.MicrobatchingDataLoader:
    # as Lightning calls train_dataloader(): DataLoader.__init__ arguments are saved on the instance
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from torch.utils.data import BatchSampler

    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        return build()


@pytest.mark.parametrize(
    "path",
    ["saved-arguments", "attributes", "saved-arguments-wrapping-a-dataloader", "datamodule-shuffle"],
)
def test_lightnings_distributed_sampler_injection_recreates_the_loader_per_rank_with_the_same_controller(
    path: str,
) -> None:
    from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    controller = eb.SplitController(split_count=2)
    builders = {
        "saved-arguments": lambda: _build_under_lightning_capture(
            lambda: eb.MicrobatchingDataLoader(IdDataset(), batch_size=5, controller=controller)
        ),
        "attributes": lambda: eb.MicrobatchingDataLoader(IdDataset(), batch_size=5, controller=controller),
        "saved-arguments-wrapping-a-dataloader": lambda: _build_under_lightning_capture(
            lambda: eb.MicrobatchingDataLoader(loader(5), controller=controller)
        ),
        "datamodule-shuffle": lambda: _build_under_lightning_capture(
            lambda: _Data().elastic_dataloader(IdDataset(), batch_size=5, shuffle=True)
        ),
    }
    original = builders[path]()
    controller = original.controller
    shards = []
    for rank in range(2):
        # what Lightning's data connector does for each rank under DDP (training: shuffled, seed 0)
        sampler = _get_distributed_sampler(
            original, shuffle=True, overfit_batches=0, mode=RunningStage.TRAINING, num_replicas=2, rank=rank
        )
        assert type(sampler) is torch.utils.data.DistributedSampler  # replaced, not wrapped
        recreated = _update_dataloader(original, sampler, mode=RunningStage.TRAINING)
        assert isinstance(recreated, eb.MicrobatchingDataLoader) and recreated.controller is controller
        batches = list(recreated)
        assert [len(b) for b in batches] == [5] * 4 and {b.split_count for b in batches} == {controller.count_for(5)}
        shards.append([i for b in batches for i in b.unwrap()["id"].tolist()])
    assert len(set(shards[0])) == len(set(shards[1])) == 20
    assert set(shards[0]) | set(shards[1]) == set(range(40))


class _OrderedData(ElasticDataModule, pl.LightningDataModule):
    def train_dataloader(self) -> eb.MicrobatchingDataLoader:
        return self.elastic_dataloader(IdDataset(), batch_size=20)


def test_datamodule_loaders_resume_mid_epoch_exactly_with_the_learned_split_count(tmp_path: Any) -> None:
    # A MicrobatchingDataLoader is a torchdata StatefulDataLoader: Lightning checkpoints its
    # position, and a run resumed from the middle of an epoch continues with the next batch (a
    # plain DataLoader would start the epoch again). (A shuffle seeded by a generator object is
    # not part of that state: its order after a resume differs, with or without this library.)
    reference = Regression()
    fit(pl.Trainer, reference, loader(20), max_epochs=3)

    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    first = Trainer(**quiet_trainer_kwargs(max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints], **AUTO))
    with MemoryBudget(limit_bytes=4_800):  # as above: 20 rows do not fit, 10 do
        first.fit(Regression(), datamodule=_OrderedData())
    learned = first.elastic.controllers["train"]
    assert learned.split_count == 2
    middle = tmp_path / "epoch=1-step=3.ckpt"  # the first batch of the second epoch done, the second not

    resumed = Regression()
    again = Trainer(**quiet_trainer_kwargs(max_epochs=3, **AUTO))
    with MemoryBudget(limit_bytes=4_800) as memory:
        again.fit(resumed, datamodule=_OrderedData(), ckpt_path=middle)
    assert again.elastic.controllers["train"].split_count == 2 and memory.oom_count == 0
    assert_same_parameters(parameters_of(resumed), parameters_of(reference))


def test_example_lightning_auto_splits_under_its_memory_budget_and_matches_the_plain_trainer() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "lightning_auto.py"
    spec = importlib.util.spec_from_file_location("lightning_auto_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(quick=True)
    assert summary["split_count"] > 1 and summary["oom_retries"] >= 1
    assert summary["peak_bytes"] <= summary["limit_bytes"]
    assert summary["max_relative_difference"] < 1e-5
