"""``elastic_batches.transformers.Trainer`` against Hugging Face's own ``Trainer``, with HF's real classes.

A tiny GPT-2 (causal LM, ``DataCollatorForLanguageModeling(mlm=False)``), a tiny BERT for masked
LM (dynamic masking) and for sequence classification (``DataCollatorWithPadding``), built from
configs, trained 6 optimizer steps at ``per_device_train_batch_size=16``: the elastic Trainer
inside a ``MemoryBudget`` too small for 16 rows, HF's without one. OOMs are caught and the
weights equal HF's within 1e-5 relative (fp32), and so does the update itself (SGD: the update is
the clipped gradient times the learning rate, so a wrong normalisation shows at once).
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from elastic_batches.transformers import Trainer  # noqa: E402 - after the skips

from support import hf_models  # noqa: E402

RTOL = 1e-5
BATCH, STEPS = 16, 6
BUDGET = 1_500_000  # bytes: the models, their SGD state and a batch of about 8 rows, not 16


@pytest.fixture(scope="module", autouse=True)
def _quiet_transformers() -> Any:
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # config notes about token ids of the tiny vocabularies
    yield
    transformers.logging.set_verbosity(verbosity)


def arguments(tmp_path: Path, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "per_device_train_batch_size": BATCH,
        "max_steps": STEPS,
        "optim": "sgd",
        "learning_rate": 0.5,
        "max_grad_norm": 1.0,
        "logging_steps": 2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }
    return transformers.TrainingArguments(str(tmp_path / "out"), **settings)


def trained(
    cls: type, name: str, args: Any, budget: MemoryBudget | None = None, resume: str | None = None
) -> tuple[nn.Module, Any]:
    """A fresh client trained by ``cls`` (inside ``budget``); the model and the trainer."""
    rows = BATCH * args.gradient_accumulation_steps * STEPS
    model, collator, samples = hf_models.client(name, rows=rows)
    trainer = cls(model=model, args=args, train_dataset=samples, data_collator=collator)
    if budget is None:
        trainer.train(resume_from_checkpoint=resume)
    else:
        with budget:
            trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def relative(got: nn.Module, want: nn.Module, start: list[torch.Tensor] | None = None) -> float:
    """``|got - want| / |want - start|`` over all parameters (``|want|`` without ``start``)."""
    pairs = list(zip(got.parameters(), want.parameters(), strict=True))
    error = sum(float((a.detach() - b.detach()).pow(2).sum()) for a, b in pairs) ** 0.5
    if start is None:
        scale = sum(float(b.detach().pow(2).sum()) for _, b in pairs) ** 0.5
    else:
        scale = sum(float((b.detach() - s).pow(2).sum()) for (_, b), s in zip(pairs, start, strict=True)) ** 0.5
    return error / scale


def initial_weights(name: str) -> list[torch.Tensor]:
    model, _, _ = hf_models.client(name, rows=1)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("accumulation", [1, 2], ids=["no-accumulation", "accumulation-2"])
@pytest.mark.parametrize("name", hf_models.CLIENTS)
def test_weights_equal_hf_trainer_where_the_batch_fits(
    name: str, accumulation: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = arguments(tmp_path, gradient_accumulation_steps=accumulation)
    want, reference = trained(transformers.Trainer, name, args)
    capsys.readouterr()
    got, trainer = trained(Trainer, name, args, MemoryBudget(BUDGET))
    printed = capsys.readouterr().out

    controller = trainer.split_controller
    assert controller.oom_count >= 1 and controller.split_count >= 2
    assert trainer.state.global_step == reference.state.global_step == STEPS
    assert relative(got, want) < RTOL
    assert relative(got, want, initial_weights(name)) < RTOL  # the update itself, not only the weights
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    want_logs = [entry for entry in reference.state.log_history if "loss" in entry]
    assert [e["loss"] for e in logs] == pytest.approx([e["loss"] for e in want_logs], rel=RTOL)
    assert [e["learning_rate"] for e in logs] == [e["learning_rate"] for e in want_logs]
    assert [e["grad_norm"] for e in logs] == pytest.approx([e["grad_norm"] for e in want_logs], rel=RTOL)
    assert sum(e["ooms"] for e in logs) == controller.oom_count
    assert logs[-1]["split_count"] == controller.split_count
    assert f"'split_count': {controller.split_count}" in printed  # HF's own progress output shows it


def test_the_naive_per_microbatch_mean_would_be_caught(tmp_path: Path) -> None:
    # the same comparison, with HF's loss naively averaged over 2 microbatches, is off by far more than RTOL
    args = arguments(tmp_path)
    want, _ = trained(transformers.Trainer, "gpt2", args)

    class Naive(transformers.Trainer):
        def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
            model.train()
            halves = [{k: v[i::2] for k, v in inputs.items()} for i in range(2)]
            for half in halves:
                self.accelerator.backward(self.compute_loss(model, half) / 2)
            return torch.zeros(())

    got, _ = trained(Naive, "gpt2", args)
    assert relative(got, want, initial_weights("gpt2")) > 100 * RTOL


def test_controller_state_is_saved_in_checkpoints_and_restored_on_resume(tmp_path: Path) -> None:
    args = arguments(tmp_path, save_strategy="steps", save_steps=3)
    whole, first = trained(Trainer, "gpt2", args, MemoryBudget(BUDGET))
    checkpoint = tmp_path / "out" / "checkpoint-3"
    assert (checkpoint / "elastic_batches.pt").is_file()
    saved = torch.load(checkpoint / "elastic_batches.pt", weights_only=True)
    assert saved["train"]["oom_count"] >= 1

    resumed_model, resumed = trained(Trainer, "gpt2", args, MemoryBudget(BUDGET), resume=str(checkpoint))
    assert resumed.split_controller.oom_count == saved["train"]["oom_count"]  # planned from what was learned
    assert resumed.split_controller.split_count == first.split_controller.split_count
    assert resumed.state.global_step == STEPS
    assert relative(resumed_model, whole) < RTOL


def test_a_state_of_another_version_is_refused(tmp_path: Path) -> None:
    model, collator, samples = hf_models.client("gpt2", rows=4)
    trainer = Trainer(model=model, args=arguments(tmp_path), train_dataset=samples, data_collator=collator)
    with pytest.raises(ValueError, match=r"elastic_batches.pt is not a state of version 1 \(missing keys \['eval'\]"):
        trainer.load_elastic_state_dict({"version": 1, "train": {}})


def test_auto_find_batch_size_keeps_the_batch_and_splits(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    want, _ = trained(transformers.Trainer, "bert-classify", arguments(tmp_path))
    args = arguments(tmp_path, auto_find_batch_size=True)
    shrunk, hf = trained(transformers.Trainer, "bert-classify", args, MemoryBudget(BUDGET))
    assert hf.state.train_batch_size < BATCH  # HF's answer: a smaller batch, a different update

    with caplog.at_level(logging.INFO, logger="elastic_batches.transformers.trainer"):
        got, trainer = trained(Trainer, "bert-classify", args, MemoryBudget(BUDGET))
    notes = [r.getMessage() for r in caplog.records if "auto_find_batch_size" in r.getMessage()]
    assert len(notes) == 1 and "keeps per_device_train_batch_size=16" in notes[0]
    assert trainer.state.train_batch_size == BATCH and trainer.split_controller.oom_count >= 1
    assert args.auto_find_batch_size is True  # the user's arguments are left as they were
    assert relative(got, want, initial_weights("bert-classify")) < RTOL


def test_evaluate_and_predict_split_instead_of_failing(tmp_path: Path) -> None:
    model, collator, samples = hf_models.client("bert-classify", rows=48)
    args = arguments(tmp_path, per_device_eval_batch_size=48)
    reference = transformers.Trainer(model=copy.deepcopy(model), args=args, data_collator=collator)
    want_metrics = reference.evaluate(samples)
    want = reference.predict(samples)

    trainer = Trainer(model=model, args=args, data_collator=collator)
    with MemoryBudget(600_000):  # the model, and the no-grad forward of about 20 rows
        metrics = trainer.evaluate(samples)
        got = trainer.predict(samples)
    assert trainer.eval_split_controller.oom_count >= 1 and trainer.eval_split_controller.split_count >= 2
    assert trainer.split_controller.oom_count == 0  # the training batch is left alone
    assert metrics["eval_loss"] == pytest.approx(want_metrics["eval_loss"], rel=RTOL)
    torch.testing.assert_close(
        torch.as_tensor(got.predictions), torch.as_tensor(want.predictions), rtol=RTOL, atol=1e-6
    )
    assert (got.label_ids == want.label_ids).all()


def test_bf16_mixed_precision_trains_close_to_hf(tmp_path: Path) -> None:
    # bf16 autocast on a CPU: microbatches round differently than the whole batch, so the tolerance is bf16's
    args = arguments(tmp_path, bf16=True)
    want, _ = trained(transformers.Trainer, "bert-classify", args)
    got, trainer = trained(Trainer, "bert-classify", args, MemoryBudget(BUDGET * 3 // 5))  # bf16 activations
    assert trainer.split_controller.oom_count >= 1
    assert relative(got, want, initial_weights("bert-classify")) < 2e-2


def test_import_without_transformers_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import elastic_batches.transformers\nexcept ImportError as err:\n    print(err)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'pip install "elastic-batches[transformers]"' in result.stdout, result.stderr[-2000:]


def test_a_trainer_without_splits_is_hf_trainer_step_for_step(tmp_path: Path) -> None:
    # no budget: one microbatch per batch, the controller never raised, the weights HF's
    args = arguments(tmp_path, gradient_accumulation_steps=2)
    want, _ = trained(transformers.Trainer, "bert-mlm", args)
    got, trainer = trained(Trainer, "bert-mlm", args)
    assert trainer.split_controller.oom_count == 0 and trainer.split_controller.split_count == 1
    assert relative(got, want, initial_weights("bert-mlm")) < RTOL
    assert isinstance(trainer.elastic_step(trainer.model_wrapped), eb.ElasticStep)
