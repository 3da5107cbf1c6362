"""Batches that cannot be cut (an int, a dict of ints or ``None``...) run whole, as under the plain Trainer.

Lightning runs any batch a DataLoader yields. Under ``accumulate_grad_batches="auto"`` a batch
that :class:`elastic_batches.ElasticBatch` cannot take apart (no field with the batch as first
dimension, fields that disagree on it, a type it does not know) still runs whole while its
stage's split count is 1; only a split that is needed refuses it: a split count above 1, or an
out-of-memory error in the whole batch, raises the ``TypeError`` below, which names the type and
``register_batch_type``. An empty batch (0 rows) has nothing to cut and always runs whole.
"""

from __future__ import annotations

from typing import Any

from elastic_batches.batch import ElasticBatch

__all__ = ["cannot_split", "take_apart", "user_batch"]


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


def cannot_split(where: str, batch: Any, why: Exception, *, count: int | None = None) -> TypeError:
    """The error for a split that is needed on a batch that cannot be cut.

    Args:
        where: What needs the split, e.g. ``"LitModel.training_step"``.
        batch: The batch, as the step receives it.
        why: What taking it apart raised.
        count: The split count asked for; ``None``: the whole batch ran out of memory.

    Example:
        >>> from elastic_batches.lightning._unsplittable import cannot_split
        >>> print(cannot_split("Model.training_step", 7, TypeError("no rows"), count=2))  # doctest: +ELLIPSIS
        Model.training_step: the split count is 2, but a batch of type int cannot be split (no rows). ...
    """
    name = type(batch).__qualname__
    need = "ran out of memory on the whole batch" if count is None else f"the split count is {count}"
    return TypeError(
        f"{where}: {need}, but a batch of type {name} cannot be split ({why}). A batch that cannot be cut runs "
        "whole while the split count is 1; to split it, give it tensors whose first dimension is the batch, or "
        f"register its type with elastic_batches.register_batch_type({name}, to_tensordict=..., "
        "from_tensordict=...)"
    )
