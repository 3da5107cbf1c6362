"""validation / test / predict steps split into microbatches by ``ElasticStep.evaluate``.

The strategy's ``validation_step``, ``test_step`` and ``predict_step`` are replaced, on the
strategy instance, by a function that runs the original on each microbatch (so the precision
context and DDP forward redirection apply), retries the batch on OOM with the stage's own
controller, logs each ``self.log`` name once with its full-batch value (straight through when
the batch runs whole), and returns the microbatch outputs combined (predictions concatenated in
row order). A step that takes ``dataloader_iter``, and a batch that cannot be cut, run whole through
the original, with a warning (see ``_unsplittable.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from elastic_batches.batch import Microbatch
from elastic_batches.lightning._outputs import combine_outputs
from elastic_batches.lightning._stages import STAGE_OF_HOOK, Stages
from elastic_batches.lightning._unsplittable import take_apart, user_batch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["elastic_evaluation_hook"]


def elastic_evaluation_hook(
    trainer: pl.Trainer, stages: Stages, hook: str, original: Callable[..., Any]
) -> Callable[..., Any]:
    """The replacement of the strategy's ``hook`` (``validation_step``, ``test_step`` or ``predict_step``).

    Args:
        trainer: The trainer.
        stages: Each stage's controller and step (the stage of ``hook`` splits its batches).
        hook: The strategy hook replaced.
        original: The strategy's own ``hook``, run on each microbatch.
    """
    stage = STAGE_OF_HOOK[hook]

    def elastic_step(batch: Any, *args: Any, **kwargs: Any) -> Any:
        where = f"{type(trainer.lightning_module).__name__}.{hook}"
        if isinstance(batch, Iterator):
            stages.unsplit.dataloader_iter(stage, where)
            return original(batch, *args, **kwargs)
        whole, why = take_apart(batch)
        if whole is None:
            if why is not None:
                stages.unsplit.batch(stage, where, user_batch(batch), why)
            return original(user_batch(batch), *args, **kwargs)
        module = trainer.lightning_module
        step = stages.step(stage)
        recorder = stages.recorder(module)
        recorder.start_batch()
        ran: list[Microbatch] = []

        def fn(mb: Microbatch) -> Any:
            if mb.index == 0:
                recorder.start_attempt()
                ran.clear()
            ran.append(mb)
            with recorder.capture(mb.weight, split=mb.count > 1):
                return original(mb.unwrap(), *args, **kwargs)

        def combine(outputs: list[Any], microbatches: list[Microbatch]) -> Any:
            # inside the attempt: an OOM in concatenating the predictions is retried like one in the step
            return combine_outputs(outputs, [mb.weight for mb in microbatches], [len(mb) for mb in microbatches])

        combined = step.evaluate(whole, fn, unwrap=False, combine=combine)
        recorder.replay()
        stages.report(stage, len(ran), max((len(mb) for mb in ran), default=0))
        return combined

    elastic_step.__wrapped__ = original  # type: ignore[attr-defined]
    return elastic_step
