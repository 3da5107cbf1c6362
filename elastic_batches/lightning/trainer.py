"""``Trainer``: ``lightning.pytorch.Trainer`` that also accepts ``accumulate_grad_batches="auto"``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch import Callback

from elastic_batches.lightning.callback import ElasticAccumulation, check_no_batch_size_finder

__all__ = ["Trainer"]


class Trainer(pl.Trainer):
    """A ``lightning.pytorch.Trainer`` with ``accumulate_grad_batches="auto"``.

    ``"auto"`` trains with the batch size your DataLoaders give, and splits each batch into as
    many microbatches as fit in memory, learned from out-of-memory errors (caught, and the same
    batch retried), with the update a full-batch step would make. It adds an
    :class:`ElasticAccumulation` callback (or uses the one you pass in ``callbacks``); everything
    else is Lightning's Trainer, unchanged. An int keeps Lightning's meaning.

    Args:
        accumulate_grad_batches: ``"auto"``, or Lightning's int (accumulate over that many
            batches, nothing split). For an outer accumulation on top of ``"auto"``, pass
            ``ElasticAccumulation(accumulate_grad_batches=N)`` in ``callbacks``.
        callbacks: As in Lightning.
        **kwargs: Every other ``lightning.pytorch.Trainer`` argument.

    Raises:
        ValueError: ``accumulate_grad_batches`` is a string other than ``"auto"``, or ``"auto"``
            with a ``BatchSizeFinder`` callback (see ``docs/lightning.md`` for which to choose).

    Example:
        >>> from elastic_batches.lightning import Trainer
        >>> trainer = Trainer(accumulate_grad_batches="auto", logger=False, enable_checkpointing=False,
        ...                   enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.elastic).__name__, trainer.accumulate_grad_batches
        ('ElasticAccumulation', 1)
    """

    def __init__(
        self,
        *,
        accumulate_grad_batches: int | Literal["auto"] = 1,
        callbacks: list[Callback] | Callback | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(accumulate_grad_batches, str):
            if accumulate_grad_batches != "auto":
                raise ValueError(
                    f"Trainer: accumulate_grad_batches must be an int or 'auto', got {accumulate_grad_batches!r}"
                )
            listed: Sequence[Callback] = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
            check_no_batch_size_finder(listed)
            if not any(isinstance(c, ElasticAccumulation) for c in listed):
                listed = [*listed, ElasticAccumulation()]
            callbacks = list(listed)
            accumulate_grad_batches = 1
        super().__init__(accumulate_grad_batches=accumulate_grad_batches, callbacks=callbacks, **kwargs)

    @property
    def elastic(self) -> ElasticAccumulation | None:
        """The :class:`ElasticAccumulation` callback (its ``controllers``), or ``None`` without ``"auto"``."""
        return ElasticAccumulation.find(self)
