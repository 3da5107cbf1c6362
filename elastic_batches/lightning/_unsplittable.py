"""What ``accumulate_grad_batches="auto"`` cannot split runs whole, exactly as Lightning's own Trainer runs it.

Three things cannot be cut into microbatches, and switching ``"auto"`` on must not stop a run
that Lightning would train:

* a module with ``automatic_optimization = False`` that does not mix in ``ElasticModule`` (its
  ``training_step`` steps the optimizer itself): its training runs as Lightning runs it;
* a step that takes ``dataloader_iter`` (it fetches its own batches): Lightning's own closure,
  or the strategy's own evaluation step;
* a batch that :class:`elastic_batches.ElasticBatch` cannot take apart (no field with the batch
  as first dimension, fields that disagree on it, a type it does not know): it runs whole,
  whatever the stage's split count.

Each case warns once per stage (rank zero), saying why and what would let ``"auto"`` split it;
an out-of-memory error there is Lightning's own, not retried. An empty batch (0 rows) has
nothing to cut and runs whole without a word. Which path a batch takes depends only on the
module's class and the batch's structure, never on memory, so every rank of a DDP run takes the
same one when it runs the same code on batches of the same structure; nothing is voted on then.
"""

from __future__ import annotations

from typing import Any

from elastic_batches._warnings import warn_on_rank_zero
from elastic_batches.batch import ElasticBatch

__all__ = ["UnsplitWarnings", "take_apart", "user_batch"]


def take_apart(batch: Any) -> tuple[ElasticBatch | None, Exception | None]:
    """``(batch as an ElasticBatch, None)``, or ``(None, why)`` when it cannot be cut (``why``: ``None`` if empty).

    Example:
        >>> import torch
        >>> from elastic_batches.lightning._unsplittable import take_apart
        >>> len(take_apart({"x": torch.zeros(4, 2)})[0])
        4
        >>> wrapped, why = take_apart({"a": 1, "b": None})
        >>> wrapped, type(why).__name__
        (None, 'ValueError')
    """
    try:
        wrapped = ElasticBatch.wrap(batch)
        wrapped.fields  # noqa: B018 - a deferred batch (from a MicrobatchingDataLoader) is taken apart here
        rows = len(wrapped)
    except (TypeError, ValueError) as err:
        return None, err
    return (wrapped, None) if rows else (None, None)


def user_batch(batch: Any) -> Any:
    """The batch as the step receives it: an :class:`ElasticBatch` unwrapped, anything else as it is."""
    return batch.unwrap() if isinstance(batch, ElasticBatch) else batch


_WHOLE = "its {stage} batches run whole, as under Lightning's Trainer (an out-of-memory error there is not retried)"


class UnsplitWarnings:
    """The warnings of what runs whole: one per stage and case, on rank zero.

    Example:
        >>> import warnings
        >>> from elastic_batches.lightning._unsplittable import UnsplitWarnings
        >>> unsplit = UnsplitWarnings()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for _ in range(3):
        ...         unsplit.dataloader_iter("train", "Model.training_step")
        >>> len(caught), "take (batch, batch_idx)" in str(caught[0].message)
        (1, True)
    """

    def __init__(self) -> None:
        self._warned: set[tuple[str, str]] = set()

    def _warn(self, stage: str, case: str, message: str) -> None:
        if (stage, case) in self._warned:
            return
        self._warned.add((stage, case))
        warn_on_rank_zero(f"accumulate_grad_batches='auto': {message}", stacklevel=3)

    def manual_optimization(self, module: str) -> None:
        """``module`` optimizes manually and is no ``ElasticModule``."""
        self._warn(
            "train",
            "manual",
            f"{module} uses manual optimization (automatic_optimization = False), and a training_step that steps "
            f"the optimizer itself cannot be split: {_WHOLE.format(stage='train')}. To split them, mix in "
            "elastic_batches.lightning.ElasticModule and call self.elastic_backward(batch, loss_fn) in training_step "
            "instead of self.manual_backward(loss)",
        )

    def dataloader_iter(self, stage: str, where: str) -> None:
        """``where`` (``"Model.validation_step"``) takes ``dataloader_iter``."""
        self._warn(
            stage,
            "dataloader_iter",
            f"{where} takes a dataloader_iter and fetches its own batches, which cannot be split: "
            f"{_WHOLE.format(stage=stage)}. To split them, take (batch, batch_idx) in {where.split('.')[-1]}",
        )

    def batch(self, stage: str, where: str, batch: Any, why: Exception) -> None:
        """A batch of ``stage`` cannot be taken apart (``why``)."""
        name = type(batch).__qualname__
        self._warn(
            stage,
            f"batch {name}",
            f"{where} received a batch of type {name} that cannot be split ({why}): {_WHOLE.format(stage=stage)}. To "
            "split them, give the batch tensors whose first dimension is the batch, or register its type with "
            f"elastic_batches.register_batch_type({name}, to_tensordict=..., from_tensordict=...)",
        )
