"""``ElasticModule``: a LightningModule mixin for explicit control over the automatic split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from elastic_batches.batch import Microbatch
from elastic_batches.controller import SplitController
from elastic_batches.lightning._stages import STAGES, stages_of
from elastic_batches.step import ElasticStep

__all__ = ["ElasticModule", "count_fn_of", "microbatch_hooks_of"]


class ElasticModule:
    """Mixin for a ``LightningModule`` (put it first: ``class Model(ElasticModule, pl.LightningModule)``).

    Every method has a default that behaves like a plain module; override what you need:

    * :meth:`elastic_count`: weight microbatches by counted items (non-padding tokens) instead
      of rows, so that a loss that is a mean over tokens is exact whatever the split;
    * :meth:`on_train_microbatch_start` / :meth:`on_train_microbatch_end`: per-microbatch hooks;
    * :attr:`elastic_controllers`: the Trainer's controllers, to share or inspect;
    * :meth:`elastic_backward`: the split for ``automatic_optimization = False``.

    Example:
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> from elastic_batches.lightning import ElasticModule
        >>> class TokenModel(ElasticModule, pl.LightningModule):
        ...     def elastic_count(self, microbatch):
        ...         return (microbatch["labels"] != -100).sum()
        >>> TokenModel().elastic_count({"labels": torch.tensor([[1, -100], [2, 3]])})
        tensor(3)
    """

    def elastic_count(self, microbatch: Any) -> torch.Tensor | int | float:
        """The number of items ``training_step``'s loss on ``microbatch`` is a mean over.

        Override it when the loss is a mean over something other than rows (tokens that are
        not ignored, say); microbatch ``i`` then carries ``count_i / sum(counts)`` of the batch
        (over all ranks), which makes the accumulated gradient that of the token mean over the
        whole batch. Not overridden: microbatches are weighted by rows.

        Args:
            microbatch: The microbatch, in the structure ``training_step`` receives.
        """
        raise NotImplementedError(f"{type(self).__name__}.elastic_count is not overridden: weights follow rows")

    def on_train_microbatch_start(self, microbatch: Microbatch) -> None:
        """Called before ``training_step`` runs on each microbatch (``microbatch.index``, ``.count``, ``.weight``).

        After an out-of-memory error the batch starts again at ``microbatch.index == 0``.
        """

    def on_train_microbatch_end(self, microbatch: Microbatch, outputs: Any) -> None:
        """Called after ``training_step`` returned ``outputs`` on a microbatch, before its backward."""

    @property
    def elastic_controllers(self) -> dict[str, SplitController]:
        """The controller of each stage (``"train"``, ``"validate"``, ``"test"``, ``"predict"``).

        Those of the Trainer's ``ElasticAccumulation`` callback once the module is attached to a
        Trainer that has one; before that, the module's own (handed to nobody).
        """
        stages = stages_of(getattr(self, "_trainer", None))
        if stages is not None:
            return stages.controllers
        own: dict[str, SplitController] = self.__dict__.setdefault("_elastic_own_controllers", {})
        for stage in STAGES:
            own.setdefault(stage, SplitController())
        return own

    def elastic_backward(
        self,
        batch: Any,
        loss_fn: Callable[[Any], torch.Tensor],
        *,
        count_fn: Callable[[Any], torch.Tensor | int | float] | None = None,
    ) -> torch.Tensor:
        """Manual optimization: accumulate the batch's gradient in microbatches, through ``manual_backward``.

        Call it in ``training_step`` in place of ``loss = ...; self.manual_backward(loss)``;
        then clip (``self.clip_gradients``) and step the optimizer as usual. The split count is
        the ``"train"`` controller's; an out-of-memory error in ``loss_fn`` or its backward
        retries the batch with more microbatches.

        Args:
            batch: The batch ``training_step`` received.
            loss_fn: ``microbatch -> loss`` (a mean over the microbatch's rows, or over the
                items ``count_fn`` counts).
            count_fn: Weights microbatches by counted items; defaults to :meth:`elastic_count`
                when it is overridden.

        Returns:
            The batch's mean loss, detached.
        """
        if count_fn is None and type(self).elastic_count is not ElasticModule.elastic_count:
            count_fn = self.elastic_count
        return self._elastic_train_step().backward(batch, loss_fn, count_fn=count_fn)

    def _elastic_train_step(self) -> ElasticStep:
        """The train stage's step, the same from one call to the next (its gradient sync keeps its buffers).

        The Trainer's callback's when it has one (``clip_gradients`` then agrees on the norm
        across ranks, as in automatic optimization); otherwise this module's own.
        """
        trainer = self.trainer  # type: ignore[attr-defined]
        backward_fn = self.manual_backward  # type: ignore[attr-defined]
        stages = stages_of(trainer)
        if stages is not None:
            return stages.step("train", backward_fn=backward_fn)
        model, controller = trainer.strategy.model, self.elastic_controllers["train"]
        step: ElasticStep | None = self.__dict__.get("_elastic_own_step")
        if step is None or step.model is not model or step.controller is not controller:
            step = self.__dict__["_elastic_own_step"] = ElasticStep(model, controller=controller)
        step.backward_fn = backward_fn
        return step


def count_fn_of(module: Any) -> Callable[[Any], Any] | None:
    """``module.elastic_count`` when an :class:`ElasticModule` overrides it, else ``None`` (weights by rows)."""
    if isinstance(module, ElasticModule) and is_overridden("elastic_count", module, ElasticModule):
        return module.elastic_count
    return None


def microbatch_hooks_of(module: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """An :class:`ElasticModule`'s per-microbatch hooks (start, end), else ``None``."""
    if isinstance(module, ElasticModule):
        return module.on_train_microbatch_start, module.on_train_microbatch_end
    return None
