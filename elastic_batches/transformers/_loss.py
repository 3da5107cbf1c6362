"""How HF's loss of a batch decomposes over its microbatches, and how predictions are put back together.

HF's ``Trainer`` backpropagates, per per-device batch, a loss ``L_r`` that is one of two kinds:

- a **sum over items** divided by a constant: a model (or ``compute_loss_func``) given
  ``num_items_in_batch`` returns ``sum of the batch's item losses / num_items_in_batch``, so
  ``L_r`` is the sum of the microbatches' losses computed with the same ``num_items_in_batch``;
- a **mean over the batch's rows** (a model that ignores ``num_items_in_batch``, or is not given
  it): ``L_r`` is the rows-weighted mean of the microbatches' losses.

The items a mean is over are the non-ignored labels (HF's models average a token-level loss over
``labels != -100``, shifted for a causal LM; a sequence classifier's one label per row makes
that the rows), counted by :func:`item_count`.

HF's DDP then averages ``L_r`` over the ``W`` processes. :class:`~elastic_batches.ElasticStep`
with that ``count_fn`` weighs microbatch ``i`` of ``c_i`` items by ``c_i / C_r`` on its rank and
each rank by ``C_r / sum(C)``: scaling each microbatch loss by :func:`microbatch_scale` makes
its result ``sum_r L_r / W``, HF's gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from elastic_batches.oom import ElasticOOMError, is_oom_error
from elastic_batches.variable_length.counts import LabelCount, label_count

__all__ = ["combine_predictions", "item_count", "loss_sums_over_items", "microbatch_scale"]


def microbatch_scale(sums: bool, items: float, batch_items: float, global_items: float, world: int) -> float:
    """The factor of a microbatch's HF loss that makes ``ElasticStep``'s weighted result HF's gradient.

    Args:
        sums: The loss is a sum over items (divided by ``num_items_in_batch``), not a mean.
        items: The microbatch's items (``c_i``, from :func:`item_count`).
        batch_items: This process's batch's items (``C_r``).
        global_items: The items of every process's batch of this step (``sum(C)``).
        world: The number of processes (``W``).

    Returns:
        ``sum(C) / (W * c_i)`` for a sum (each microbatch then counts once), ``sum(C) / (W * C_r)``
        for a mean (the weights ``c_i / C_r`` are then ``ElasticStep``'s own).

    Example:
        >>> microbatch_scale(True, items=40, batch_items=160, global_items=160, world=1)
        4.0
        >>> microbatch_scale(False, items=40, batch_items=160, global_items=160, world=1)
        1.0
    """
    return global_items / (world * (items if sums else batch_items))


def item_count(inputs: Mapping[str, Any], shifts_labels: bool) -> LabelCount | None:
    """The ``count_fn`` of the items HF's loss of ``inputs`` is a mean over; ``None``: the rows.

    Args:
        inputs: A batch, with its ``labels``.
        shifts_labels: The model's loss shifts the labels (a causal LM: HF's
            ``Trainer._loss_shifts_labels``).

    Returns:
        :func:`~elastic_batches.label_count` for token-level labels (``[rows, length, ...]``),
        ``None`` (weights by rows) for one label per row or no labels.

    Example:
        >>> import torch
        >>> count = item_count({"labels": torch.tensor([[1, 2, -100]])}, shifts_labels=True)
        >>> int(count({"labels": torch.tensor([[1, 2, -100]])}))
        1
    """
    labels = inputs.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        return label_count(causal=shifts_labels)
    return None


def _row(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    """The batch's row with the most labels (a row whose loss is not zero), as a batch of one."""
    labels = inputs.get("labels")
    rows = len(labels) if isinstance(labels, torch.Tensor) and labels.dim() else None
    row = 0
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        row = int(labels.ne(-100).flatten(1).sum(1).argmax())
    if rows is None:
        rows = next(len(v) for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim())
    return {
        k: v[row : row + 1] if isinstance(v, torch.Tensor) and v.dim() and len(v) == rows else v
        for k, v in inputs.items()
    }


def loss_sums_over_items(trainer: Any, model: nn.Module, inputs: Mapping[str, Any], num_items: Any) -> bool:
    """Whether ``trainer.compute_loss`` given ``num_items_in_batch`` is a sum over items divided by it.

    HF passes ``num_items_in_batch`` to every model whose ``forward`` takes ``**kwargs``, but
    some ignore it (``BertForSequenceClassification`` and ``BertForMaskedLM`` return a mean all
    the same). One
    row of the batch, without gradients and in eval mode, is computed at ``num_items`` and at
    twice it: a sum halves, a mean stays.

    Args:
        trainer: The HF ``Trainer``.
        model: The model of ``training_step`` (unwrapped here: no collective runs).
        inputs: The batch, on its device.
        num_items: HF's ``num_items_in_batch``.

    Returns:
        ``True`` for a sum (also where the row's loss is zero or not finite: HF's own reading).

    Raises:
        ElasticOOMError: out of memory in that row's forward: no split lets the model train.
    """
    module = trainer.accelerator.unwrap_model(model)
    modes = [(m, m.training) for m in module.modules()]
    one = _row(inputs)
    module.eval()
    try:
        with torch.no_grad(), trainer.compute_loss_context_manager():
            once = float(trainer.compute_loss(module, dict(one), num_items_in_batch=num_items))
            twice = float(trainer.compute_loss(module, dict(one), num_items_in_batch=num_items * 2))
    except Exception as err:
        if not is_oom_error(err):
            raise
        raise ElasticOOMError(
            f"elastic_batches.transformers.Trainer: out of memory in the forward of one row without gradients "
            f"({type(module).__name__}, read once to tell how its loss uses num_items_in_batch): a training "
            "microbatch of one row needs more, so no split can fit it. Free memory held before training, or use a "
            "smaller model or a device with more"
        ) from err
    finally:
        for m, training in modes:
            m.training = training
    if not (math.isfinite(once) and math.isfinite(twice)) or twice == 0.0:
        return True
    return abs(once / twice - 2.0) < abs(once / twice - 1.0)


def _concatenated(parts: list[Any]) -> Any:
    """Tensors (in tuples, lists, mappings) concatenated along the rows; ``None`` stays ``None``."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else torch.stack(parts)
    if isinstance(first, Mapping):
        return type(first)({key: _concatenated([p[key] for p in parts]) for key in first})  # type: ignore[call-arg]
    if isinstance(first, (tuple, list)):
        return type(first)(_concatenated([p[i] for p in parts]) for i in range(len(first)))
    return first


def combine_predictions(outputs: list[Any], rows: list[int]) -> Any:
    """HF's ``(loss, logits, labels)`` of a whole batch from its microbatches' (in row order).

    Args:
        outputs: Each microbatch's ``prediction_step`` result.
        rows: Each microbatch's rows.

    Returns:
        The first output itself for one microbatch; else the rows-weighted mean loss and the
        concatenated logits and labels.

    Example:
        >>> import torch
        >>> parts = [(torch.tensor(1.0), torch.zeros(3, 2), None), (torch.tensor(4.0), torch.ones(1, 2), None)]
        >>> loss, logits, labels = combine_predictions(parts, [3, 1])
        >>> float(loss), tuple(logits.shape), labels
        (1.75, (4, 2), None)
    """
    if len(outputs) == 1:
        return outputs[0]
    losses = [out[0] for out in outputs]
    loss = None
    if all(part is not None for part in losses):
        loss = sum(part * n for part, n in zip(losses, rows, strict=True)) / sum(rows)
    return (loss, _concatenated([out[1] for out in outputs]), _concatenated([out[2] for out in outputs]))
