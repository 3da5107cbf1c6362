"""``Trainer``: ``lightning.pytorch.Trainer`` that also accepts ``accumulate_grad_batches="auto"``."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal, Union

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.utilities.argparse import _defaults_from_env_vars

from elastic_batches.lightning.callback import ElasticAccumulation, check_no_batch_size_finder

__all__ = ["Trainer"]


def _signature() -> inspect.Signature:
    """Lightning's ``Trainer.__init__`` signature, with ``accumulate_grad_batches`` that also takes ``"auto"``.

    ``PL_TRAINER_*`` environment defaults and LightningCLI (jsonargparse) read the arguments from it.
    """
    lightning = inspect.signature(pl.Trainer.__init__)
    parameters = [
        p.replace(annotation=Union[int, Literal["auto"]]) if p.name == "accumulate_grad_batches" else p  # noqa: UP007
        for p in lightning.parameters.values()
    ]
    return lightning.replace(parameters=parameters)


class Trainer(pl.Trainer):
    """A ``lightning.pytorch.Trainer`` with ``accumulate_grad_batches="auto"``.

    ``"auto"`` trains with the batch size your DataLoaders give, and splits each batch into as
    many microbatches as fit in memory, learned from out-of-memory errors (caught, and the same
    batch retried), with the update a full-batch step would make. It adds an
    :class:`ElasticAccumulation` callback (or uses the one you pass in ``callbacks``); everything
    else is Lightning's Trainer, unchanged. An int keeps Lightning's meaning.

    The signature is Lightning's own (every argument, keyword-only), so ``PL_TRAINER_*``
    environment variables set defaults as for Lightning's Trainer (``PL_TRAINER_ACCUMULATE_GRAD_BATCHES=auto``
    too), and ``LightningCLI(trainer_class=Trainer)`` offers ``--trainer.accumulate_grad_batches auto``.

    Args:
        accumulate_grad_batches: ``"auto"``, or Lightning's int (accumulate over that many
            batches, nothing split). For an outer accumulation on top of ``"auto"``, pass
            ``ElasticAccumulation(accumulate_grad_batches=N)`` in ``callbacks``: the trainer's
            ``accumulate_grad_batches`` then reads ``N`` from construction on.
        callbacks: As in Lightning.
        **kwargs: Every other ``lightning.pytorch.Trainer`` argument.

    Raises:
        ValueError: ``accumulate_grad_batches`` is a string other than ``"auto"``, or ``"auto"``
            with a ``BatchSizeFinder`` callback (see ``docs/lightning.md`` for which to choose).

    Example:
        >>> from elastic_batches.lightning import ElasticAccumulation, Trainer
        >>> trainer = Trainer(accumulate_grad_batches="auto", logger=False, enable_checkpointing=False,
        ...                   enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.elastic).__name__, trainer.accumulate_grad_batches
        ('ElasticAccumulation', 1)
        >>> Trainer(accumulate_grad_batches="auto", callbacks=[ElasticAccumulation(accumulate_grad_batches=4)],
        ...         logger=False, enable_checkpointing=False).accumulate_grad_batches
        4
    """

    @_defaults_from_env_vars
    def __init__(self, **kwargs: Any) -> None:
        accumulate_grad_batches = kwargs.pop("accumulate_grad_batches", 1)
        callbacks = kwargs.pop("callbacks", None)
        listed: Sequence[Callback] = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
        if isinstance(accumulate_grad_batches, str):
            if accumulate_grad_batches != "auto":
                raise ValueError(
                    f"Trainer: accumulate_grad_batches must be an int or 'auto', got {accumulate_grad_batches!r}"
                )
            check_no_batch_size_finder(listed)
            if not any(isinstance(c, ElasticAccumulation) for c in listed):
                listed = [*listed, ElasticAccumulation()]
            callbacks = list(listed)
            accumulate_grad_batches = 1
        elastic = next((c for c in listed if isinstance(c, ElasticAccumulation)), None)
        if elastic is not None and elastic.accumulate_grad_batches is not None:
            accumulate_grad_batches = elastic.accumulate_grad_batches  # what its setup would set, read from now on
        super().__init__(accumulate_grad_batches=accumulate_grad_batches, callbacks=callbacks, **kwargs)

    @property
    def elastic(self) -> ElasticAccumulation | None:
        """The :class:`ElasticAccumulation` callback (its ``controllers``), or ``None`` without ``"auto"``."""
        return ElasticAccumulation.find(self)


Trainer.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
