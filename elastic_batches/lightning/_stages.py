"""The stages a Trainer runs, and what each has: its controller, its ``ElasticStep``, the ``self.log`` recorder.

``ElasticAccumulation`` makes one :class:`Stages` and hands it to what it installs (the training
loop's closure, the evaluation steps) when it makes them; ``ElasticModule`` and
``ElasticDataModule`` find it on their Trainer with :func:`stages_of`. None of them needs the
callback itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule

from elastic_batches.controller import SplitController
from elastic_batches.lightning._logging import LogRecorder
from elastic_batches.lightning._unsplittable import UnsplitWarnings
from elastic_batches.step import ElasticStep

__all__ = ["STAGES", "STAGE_OF_HOOK", "Report", "Stages", "stages_of"]

STAGES = ("train", "validate", "test", "predict")
# strategy hook -> the stage whose controller splits its batches
STAGE_OF_HOOK = {"validation_step": "validate", "test_step": "test", "predict_step": "predict"}

Report = Callable[[str, int, int], None]  # (stage, microbatches a batch ran as, rows of its largest)


class Stages:
    """Each stage's controller and, while attached to a strategy, its :class:`ElasticStep`.

    Args:
        controllers: The controller of each stage in :data:`STAGES`.
        gather: How the steps gather an FSDP2 model's parameters (``ElasticStep``'s ``gather``).
        memory: What the training steps measure memory with (``ElasticStep``'s ``memory``).

    Attributes:
        controllers: The controller of each stage (the dict shared with the callback).
        unsplit: The warnings of what runs whole (one per stage and case).

    Example:
        >>> import elastic_batches as eb
        >>> from elastic_batches.lightning._stages import STAGES, Stages
        >>> stages = Stages({stage: eb.SplitController() for stage in STAGES})
        >>> stages.ran("train") is None
        True
    """

    def __init__(
        self, controllers: Mapping[str, SplitController], *, gather: str = "auto", memory: Any = "auto"
    ) -> None:
        self.controllers = dict(controllers)
        self.gather = gather
        self.memory = memory
        self._strategy: Any = None
        self._report: Report | None = None
        self._steps: dict[str, ElasticStep] = {}
        self._recorder: LogRecorder | None = None
        self.unsplit = UnsplitWarnings()

    def attach(self, strategy: Any, report: Report) -> None:
        """Make steps for ``strategy``'s model from now on, and tell ``report`` what each batch ran as."""
        self._strategy, self._report = strategy, report

    def detach(self) -> None:
        """Forget the strategy, its steps and the recorder."""
        self._strategy = self._report = self._recorder = None
        self._steps.clear()

    def step(self, stage: str, *, backward_fn: Callable[[torch.Tensor], Any] | None = None) -> ElasticStep:
        """The ``ElasticStep`` of ``stage`` for the strategy's current model (DDP-wrapped or not).

        Raises:
            RuntimeError: not attached to a strategy (outside ``fit``, ``validate``, ``test``,
                ``predict``), or the strategy has no model yet.
        """
        model = None if self._strategy is None else self._strategy.model
        if model is None:
            raise RuntimeError(
                f"the {stage} stage's ElasticStep exists while a Trainer runs (fit, validate, test, predict) with "
                "ElasticAccumulation installed; call this from inside a step"
            )
        step = self._steps.get(stage)
        if step is None or step.model is not model:
            step = self._steps[stage] = ElasticStep(
                model, controller=self.controllers[stage], gather=self.gather, memory=self.memory
            )
        step.controller = self.controllers[stage]
        step.backward_fn = backward_fn
        return step

    def ran(self, stage: str) -> ElasticStep | None:
        """The step of ``stage`` if one ran since the strategy was attached, else ``None``."""
        return self._steps.get(stage)

    def recorder(self, module: LightningModule) -> LogRecorder:
        """The recorder of ``module``'s ``self.log`` calls (one per module)."""
        if self._recorder is None or self._recorder.module is not module:
            self._recorder = LogRecorder(module)
        return self._recorder

    def report(self, stage: str, count: int, size: int) -> None:
        """Tell the callback that a batch of ``stage`` ran as ``count`` microbatches of at most ``size`` rows."""
        if self._report is not None:
            self._report(stage, count, size)


def stages_of(trainer: Any) -> Stages | None:
    """The :class:`Stages` of ``trainer``'s ``ElasticAccumulation``, or ``None`` (no Trainer, or none installed).

    Example:
        >>> import lightning.pytorch as pl
        >>> from elastic_batches.lightning._stages import stages_of
        >>> stages_of(None), stages_of(pl.Trainer(logger=False, enable_checkpointing=False))
        (None, None)
    """
    for callback in getattr(trainer, "callbacks", None) or []:
        stages = getattr(callback, "elastic_stages", None)
        if isinstance(stages, Stages):
            return stages
    return None
