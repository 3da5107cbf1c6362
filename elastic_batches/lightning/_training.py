"""Lightning's automatic optimization with the closure's forward and backward run by ``ElasticStep``.

Lightning's closure runs ``training_step`` on the batch, zeroes the gradients and calls the
strategy's ``backward``. Here the closure zeroes the gradients first, then hands the batch to
:class:`elastic_batches.ElasticStep`, which calls the user's ``training_step`` on each
microbatch (in the user's own structure, through the strategy, so autocast and DDP forward
redirection apply) and backpropagates ``loss * weight`` through the strategy's ``backward``
(precision plugin, ``on_before_backward`` / ``on_after_backward`` hooks). Everything after the
closure stays Lightning's: ``on_before_optimizer_step``, gradient clipping on the accumulated
gradient, the GradScaler's unscale/step/update, the optimizer step, lr schedulers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization
from lightning.pytorch.trainer import call
from torch.optim import Optimizer

from elastic_batches.batch import Microbatch
from elastic_batches.lightning._outputs import combine_outputs

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from elastic_batches.lightning.callback import ElasticAccumulation

__all__ = ["ElasticClosure", "ElasticOptimization"]


class ElasticClosure(Closure):
    """Zero the gradients, then run forward and backward of every microbatch (``step_fn`` does both)."""

    def __init__(self, step_fn: Callable[[], ClosureResult], zero_grad_fn: Callable[[], None] | None) -> None:
        super().__init__(step_fn=step_fn, backward_fn=None, zero_grad_fn=zero_grad_fn)

    @torch.enable_grad()
    def closure(self, *args: Any, **kwargs: Any) -> ClosureResult:
        if self._zero_grad_fn is not None:
            self._zero_grad_fn()
        return self._step_fn()


class ElasticOptimization(_AutomaticOptimization):
    """Lightning's ``_AutomaticOptimization`` loop whose closure splits the batch.

    Args:
        trainer: The trainer.
        elastic: The callback that owns the controllers and steps.
        original: The loop it replaces; its progress counters are kept (they are checkpointed).
    """

    def __init__(self, trainer: pl.Trainer, elastic: ElasticAccumulation, original: _AutomaticOptimization) -> None:
        super().__init__(trainer)
        self.optim_progress = original.optim_progress
        self._skip_backward = original._skip_backward
        self.original = original
        self.elastic = elastic

    def _make_closure(self, kwargs: OrderedDict, optimizer: Optimizer, batch_idx: int) -> Closure:
        if self._skip_backward:
            return super()._make_closure(kwargs, optimizer, batch_idx)
        step_fn = partial(self._elastic_training_step, kwargs, optimizer)
        return ElasticClosure(step_fn, self._make_zero_grad_fn(batch_idx, optimizer))

    def _elastic_training_step(self, kwargs: OrderedDict, optimizer: Optimizer) -> ClosureResult:
        trainer = self.trainer
        module = trainer.lightning_module
        elastic = self.elastic
        names = list(kwargs)
        values = list(kwargs.values())
        if "batch" not in names:
            raise ValueError(
                f"{type(module).__name__}.training_step takes a dataloader_iter: accumulate_grad_batches='auto' needs "
                "training_step(batch, batch_idx), whose batch it can split"
            )
        batch_position = names.index("batch")

        def backward_fn(loss: torch.Tensor) -> None:
            call._call_strategy_hook(trainer, "backward", loss, optimizer)

        step = elastic.step_for("train", backward_fn=backward_fn)
        recorder = elastic.recorder_for(module)
        recorder.start_batch()
        results: list[tuple[Microbatch, dict[str, Any]]] = []
        microbatch_hooks = elastic.microbatch_hooks(module)

        def loss_fn(mb: Microbatch) -> torch.Tensor:
            if mb.index == 0:
                recorder.start_attempt()
                results.clear()
            if microbatch_hooks is not None:
                microbatch_hooks[0](mb)
            arguments = list(values)
            arguments[batch_position] = mb.unwrap()
            with recorder.capture(mb.weight):
                output = call._call_strategy_hook(trainer, "training_step", *arguments)
            trainer.strategy.post_training_step()
            result = ClosureResult.from_training_step_output(output, trainer.accumulate_grad_batches)
            if result.closure_loss is None:
                raise ValueError(
                    "training_step returned None on a microbatch: skipping a batch is not supported with "
                    "accumulate_grad_batches='auto'. Return a loss (for instance loss * 0 to make the step a no-op)"
                )
            results.append((mb, result.extra))
            if microbatch_hooks is not None:
                microbatch_hooks[1](mb, output)
            return result.closure_loss

        loss = step.backward(values[batch_position], loss_fn, count_fn=elastic.count_fn(module), unwrap=False)
        recorder.replay()
        count = results[0][0].count if results else 1
        elastic.after_train_batch(trainer, module, count, max((len(mb) for mb, _ in results), default=0), step)
        extras = [extra for _, extra in results]
        extra = combine_outputs(extras, [mb.weight for mb, _ in results], [len(mb) for mb, _ in results])
        return ClosureResult(loss, extra=extra or {})
