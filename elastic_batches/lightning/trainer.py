"""``Trainer``: ``lightning.pytorch.Trainer`` that also accepts ``accumulate_grad_batches="auto"``."""

from __future__ import annotations

import inspect
from argparse import Namespace
from collections.abc import Sequence
from typing import Any, Literal, Union

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.utilities import argparse as lightning_argparse
from lightning.pytorch.utilities.argparse import _defaults_from_env_vars

from elastic_batches.lightning.callback import ElasticAccumulation, check_no_batch_size_finder

__all__ = ["Trainer"]

_ENV = "PL_TRAINER_ACCUMULATE_GRAD_BATCHES"


def _signature() -> inspect.Signature:
    """Lightning's ``Trainer.__init__`` signature; ``accumulate_grad_batches`` also takes ``"auto"``, default ``None``.

    ``PL_TRAINER_*`` environment defaults and LightningCLI (jsonargparse) read the arguments from
    it. ``None`` is Lightning's ``1`` unless ``PL_TRAINER_ACCUMULATE_GRAD_BATCHES`` says otherwise:
    LightningCLI passes every argument, the defaults too, and would hide the variable behind a ``1``.
    """
    lightning = inspect.signature(pl.Trainer.__init__)
    parameters = [
        p.replace(annotation=Union[int, Literal["auto"], None], default=None)  # noqa: UP007
        if p.name == "accumulate_grad_batches"
        else p
        for p in lightning.parameters.values()
    ]
    return lightning.replace(parameters=parameters)


def _refusing_auto_for_lightnings_trainer(parse: Any) -> Any:
    """Lightning's ``PL_TRAINER_*`` parser, refusing ``accumulate_grad_batches=auto`` for a Trainer that is not ours.

    The variable names no class: it reaches ``lightning.pytorch.Trainer`` too, which would take
    the string and fail at ``fit`` (``batch_idx % "auto"``). Refused where that Trainer is made.
    """

    def parse_env_variables(cls: type, *args: Any, **kwargs: Any) -> Namespace:
        parsed = parse(cls, *args, **kwargs)
        if getattr(parsed, "accumulate_grad_batches", None) == "auto" and not issubclass(cls, Trainer):
            raise ValueError(
                f"{_ENV}=auto reached {cls.__module__}.{cls.__qualname__}, which takes an int: 'auto' is "
                "elastic_batches.lightning.Trainer's. Make the Trainer with elastic_batches.lightning.Trainer "
                "(LightningCLI(trainer_class=elastic_batches.lightning.Trainer)), or unset the variable and add "
                "elastic_batches.lightning.ElasticAccumulation() to this Trainer's callbacks"
            )
        return parsed

    parse_env_variables.__wrapped__ = parse  # type: ignore[attr-defined]
    return parse_env_variables


class Trainer(pl.Trainer):
    """A ``lightning.pytorch.Trainer`` with ``accumulate_grad_batches="auto"``.

    ``"auto"`` trains with the batch size your DataLoaders give, and splits each batch into as
    many microbatches as fit in memory, learned from out-of-memory errors (caught, and the same
    batch retried), with the update a full-batch step would make. It adds an
    :class:`ElasticAccumulation` callback (or uses the one you pass in ``callbacks``); everything
    else is Lightning's Trainer, unchanged. An int keeps Lightning's meaning.

    The signature is Lightning's own (every argument, keyword-only), so ``PL_TRAINER_*``
    environment variables set defaults as for Lightning's Trainer, and
    ``LightningCLI(trainer_class=Trainer)`` offers ``--trainer.accumulate_grad_batches auto``.
    ``PL_TRAINER_ACCUMULATE_GRAD_BATCHES=auto`` is honoured here, under LightningCLI too, and
    refused with a ``ValueError`` by a ``lightning.pytorch.Trainer`` made in the same process
    (which cannot run it).

    Args:
        accumulate_grad_batches: ``"auto"``, or Lightning's int (accumulate over that many
            batches, nothing split). ``None`` (default): ``PL_TRAINER_ACCUMULATE_GRAD_BATCHES``
            if set, else ``1``, Lightning's default. For an outer accumulation on top of ``"auto"``, pass
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
        accumulate_grad_batches = kwargs.pop("accumulate_grad_batches", None)
        if accumulate_grad_batches is None:
            accumulate_grad_batches = getattr(
                lightning_argparse._parse_env_variables(type(self)), "accumulate_grad_batches", 1
            )
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
if not hasattr(lightning_argparse._parse_env_variables, "__wrapped__"):  # once, should this module be reloaded
    lightning_argparse._parse_env_variables = _refusing_auto_for_lightnings_trainer(
        lightning_argparse._parse_env_variables
    )
