"""``elastic_batches.transformers.Trainer``: Hugging Face's ``Trainer``, each batch that does not fit split on OOM.

The subclass keeps HF's training loop whole (its data loading, ``num_items_in_batch``,
gradient accumulation, clipping, optimizer and schedule, logging, checkpoints) and replaces one
seam: ``training_step`` runs the per-device batch through an :class:`~elastic_batches.ElasticStep`
instead of one forward and ``accelerator.backward``. Each microbatch's loss is HF's own
``compute_loss`` on the microbatch, scaled so that the microbatches add up to the loss HF
backpropagates for the whole batch (see :func:`microbatch_scale`): the gradient, and so the
update, is HF's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, cast

import torch
import transformers
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from elastic_batches.batch import ElasticBatch, Microbatch
from elastic_batches.controller import SplitController
from elastic_batches.memory import MemoryProbe, check_memory
from elastic_batches.step import ElasticStep
from elastic_batches.transformers._loss import combine_predictions, item_count, loss_sums_over_items, microbatch_scale
from elastic_batches.variable_length.trim import TrimPadding

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)

STATE_FILE = "elastic_batches.pt"  # the controllers' state, in each of HF's checkpoint folders
_STATE_VERSION = 1


def _first(samples: list[Any]) -> Any:
    """The collate function of a batch HF's collator has padded already."""
    return samples[0]


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` with exactly its arguments, whose per-device batches are split on OOM.

    A batch that does not fit is cut into microbatches and retried; the gradient left for HF's
    optimizer step is the one HF's own ``Trainer`` computes where the batch fits, with the same
    ``TrainingArguments``: the same effective batch (``per_device_train_batch_size x
    gradient_accumulation_steps x world size``), HF's loss normalisation (``num_items_in_batch``,
    ``average_tokens_across_devices``), ``max_grad_norm`` clipping once on the full gradient, the
    same schedule and ``global_step``. A padded batch (an ``attention_mask``, padded on the
    right) is cut per microbatch to its own longest row (:class:`~elastic_batches.TrimPadding`).
    ``evaluate`` and ``predict`` split their batches too (a controller of their own).

    What the controllers learned is saved in each checkpoint folder (``elastic_batches.pt``) and
    restored by ``train(resume_from_checkpoint=...)``. Every training log has ``split_count`` (the
    microbatches of the last step) and ``ooms`` (OOMs caught since the previous log), in HF's
    ``log_history``, its progress output and its reporters. ``auto_find_batch_size=True`` keeps
    the batch and splits instead of shrinking it (said once in the log). Mixed precision
    (``bf16``, ``fp16`` with its grad scaler) runs through HF's ``accelerator.backward``.

    Args:
        *args: ``transformers.Trainer``'s.
        memory: The memory probe the training steps measure each microbatch with, to predict
            the split from measured memory (``ElasticStep(memory=...)``): ``"auto"`` (default)
            the device's (CUDA, XPU; none on a CPU), a
            :class:`~elastic_batches.memory.MemoryProbe` (on a CPU, the
            ``elastic_batches.testing.MemoryBudget`` the training runs in), or ``None``: the
            OOM-driven search alone.
        **kwargs: ``transformers.Trainer``'s.

    Attributes:
        split_controller: The training batches' :class:`~elastic_batches.SplitController`.
        eval_split_controller: The controller of ``evaluate`` and ``predict``.

    Example:
        >>> import torch
        >>> import transformers
        >>> import elastic_batches as eb
        >>> from elastic_batches.transformers import Trainer
        >>> class Regressor(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.linear = torch.nn.Linear(3, 1)
        ...     def forward(self, x, labels):
        ...         return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}
        >>> data = [{"x": torch.randn(3), "labels": torch.randn(1)} for _ in range(8)]
        >>> args = transformers.TrainingArguments(
        ...     "/tmp/eb_doctest", per_device_train_batch_size=8, max_steps=1, report_to=[], use_cpu=True,
        ...     save_strategy="no", disable_tqdm=True)
        >>> trainer = Trainer(model=Regressor(), args=args, train_dataset=data)
        >>> trainer.split_controller = eb.SplitController(split_count=2)  # as if it had learned 2
        >>> _ = trainer.train()  # doctest: +ELLIPSIS
        {'train_runtime': ...}
        >>> trainer.state.global_step, trainer.split_controller.split_count
        (1, 2)
    """

    def __init__(self, *args: Any, memory: MemoryProbe | str | None = "auto", **kwargs: Any) -> None:
        check_memory("elastic_batches.transformers.Trainer", memory)
        super().__init__(*args, **kwargs)
        self.memory = memory
        self.split_controller = SplitController()
        self.eval_split_controller = SplitController()
        self._steps: dict[tuple[int, bool], ElasticStep] = {}
        self._loss_sums: bool | None = None  # whether a microbatch's loss is a part of a sum (learned once)
        self._ooms_logged = 0

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """HF's ``train``; with ``auto_find_batch_size=True`` the batch is kept and split instead of shrunk."""
        if not self.args.auto_find_batch_size:
            return super().train(*args, **kwargs)
        logger.info(
            "elastic_batches.transformers.Trainer: auto_find_batch_size=True keeps per_device_train_batch_size=%d "
            "and splits each batch that does not fit into microbatches, with the same update",
            self.args.per_device_train_batch_size,
        )
        self.args.auto_find_batch_size = False  # HF's search would catch the final OOM and shrink the batch
        try:
            return super().train(*args, **kwargs)
        finally:
            self.args.auto_find_batch_size = True

    def elastic_step(self, model: nn.Module, *, evaluation: bool = False) -> ElasticStep:
        """The :class:`~elastic_batches.ElasticStep` that runs ``model``'s batches (one per model and stage).

        Args:
            model: The model HF hands to ``training_step`` or ``prediction_step`` (DDP-wrapped
                under several processes).
            evaluation: The step of ``evaluate`` and ``predict`` (its own controller).

        Returns:
            The step, made at the first call: training backpropagates through HF's
            ``accelerator.backward`` (its grad scaler), and measures memory with the
            trainer's ``memory`` (``"auto"``: where the device has a probe).
        """
        key = (id(model), evaluation)
        if key not in self._steps:
            controller = self.eval_split_controller if evaluation else self.split_controller
            backward = None if evaluation else self.accelerator.backward
            self._steps[key] = ElasticStep(model, controller=controller, backward_fn=backward, memory=self.memory)
        return self._steps[key]

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """HF's training step of one per-device batch, in as many microbatches as it takes to fit.

        Returns:
            The loss HF's own ``training_step`` returns for the batch (detached).
        """
        model.train()
        train_mode = getattr(self.optimizer, "train", None)  # schedule-free optimizers have modes
        if callable(train_mode):
            train_mode()
        inputs = self._prepare_inputs(inputs)
        batch = _trimmed(inputs)
        passes_items = num_items_in_batch is not None and (
            self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        )
        if self.loss_is_scaled_for_ga is not None:
            scaled_for_ga = self.loss_is_scaled_for_ga
        else:
            scaled_for_ga = passes_items
        if passes_items and self._loss_sums is None:
            self._loss_sums = loss_sums_over_items(self, model, inputs, num_items_in_batch)
        sums = passes_items and bool(self._loss_sums)
        count_fn = item_count(inputs, bool(getattr(self, "_loss_shifts_labels", False)))
        items = float(len(batch) if count_fn is None else count_fn(inputs))
        global_items = self._global_items(items, inputs)
        world = self.accelerator.num_processes

        def loss_fn(mb: Microbatch) -> torch.Tensor:
            with self.compute_loss_context_manager():
                loss = cast(torch.Tensor, self.compute_loss(model, mb.unwrap(), num_items_in_batch=num_items_in_batch))
            if self.args.n_gpu > 1:
                loss = loss.mean()
            if not scaled_for_ga:
                loss = loss / self.current_gradient_accumulation_steps
            own = len(mb) if count_fn is None else float(count_fn(mb.unwrap()))
            return loss * microbatch_scale(sums, own, items, global_items, world)

        loss = self.elastic_step(model).backward(batch, loss_fn, count_fn=count_fn, unwrap=False)
        return loss * (world * items / global_items)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """HF's prediction step, the batch split as it takes to fit; loss, logits and labels of the whole batch.

        The loss is the rows-weighted mean of the microbatches' losses (HF's evaluation loop
        weighs each batch's loss by its rows too); logits and labels are concatenated in row order.
        """
        inputs = self._prepare_inputs(inputs)

        def predict(mb: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
            return transformers.Trainer.prediction_step(self, model, mb, prediction_loss_only, ignore_keys)

        def combine(outputs: list[Any], microbatches: list[Microbatch]) -> Any:
            return combine_predictions(outputs, [len(mb) for mb in microbatches])

        # not trimmed: the logits keep the batch's length, as HF's evaluation loop concatenates them
        return self.elastic_step(model, evaluation=True).evaluate(ElasticBatch.wrap(inputs), predict, combine=combine)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """HF's ``log``; a training log also gets ``split_count`` and ``ooms`` (caught since the previous log)."""
        if "loss" in logs:
            logs["split_count"] = self.split_controller.split_count
            logs["ooms"] = self.split_controller.oom_count - self._ooms_logged
            self._ooms_logged = self.split_controller.oom_count
        super().log(logs, start_time)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            torch.save(self.elastic_state_dict(), os.path.join(folder, STATE_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, STATE_FILE)
        if os.path.isfile(path):
            self.load_elastic_state_dict(torch.load(path, weights_only=True))

    def elastic_state_dict(self) -> dict[str, Any]:
        """What the two controllers learned: saved in each checkpoint folder as ``elastic_batches.pt``."""
        return {
            "version": _STATE_VERSION,
            "train": self.split_controller.state_dict(),
            "eval": self.eval_split_controller.state_dict(),
        }

    def load_elastic_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`elastic_state_dict`'s output (``train(resume_from_checkpoint=...)`` calls it).

        Raises:
            ValueError: ``state`` is not a state of this version, or lacks a controller's part.
        """
        missing = sorted({"version", "train", "eval"} - set(state))
        if missing or state["version"] != _STATE_VERSION:
            raise ValueError(
                f"elastic_batches.transformers.Trainer: {STATE_FILE} is not a state of version {_STATE_VERSION} "
                f"(missing keys {missing}, version {state.get('version')!r}); delete the file to start afresh"
            )
        self.split_controller.load_state_dict(state["train"])
        self.eval_split_controller.load_state_dict(state["eval"])

    def _global_items(self, items: float, inputs: Any) -> float:
        """The items of this step's batches over every process (one small collective under several)."""
        if self.accelerator.num_processes == 1:
            return items
        device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), self.args.device)
        total = self.accelerator.reduce(torch.tensor(items, dtype=torch.float64, device=device), reduction="sum")
        return float(total)


def _trimmed(inputs: Any) -> ElasticBatch:
    """The batch, each microbatch cut to its own longest row where it has a right-padded ``attention_mask``."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return ElasticBatch.wrap(inputs)
    try:
        return TrimPadding(_first)([inputs])
    except ValueError:  # left padding: the rows cannot be trimmed, only split
        return ElasticBatch.wrap(inputs)
