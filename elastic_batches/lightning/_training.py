"""Lightning's automatic optimization with the closure's forward and backward run by ``ElasticStep``.

Lightning's closure runs ``training_step`` on the batch, zeroes the gradients and calls the
strategy's ``backward``. Here the closure hands the batch to :class:`elastic_batches.ElasticStep`,
which calls the user's ``training_step`` on each microbatch (in the user's own structure,
through the strategy, so autocast and DDP forward redirection apply) and backpropagates
``loss * weight`` through the strategy's ``backward`` (precision plugin, ``on_before_backward`` /
``on_after_backward`` hooks). The order of each microbatch is Lightning's: ``training_step``,
then (after the first one only) ``zero_grad``, then ``backward`` (see ``_zero_grad.py``). A batch
whose every microbatch returns ``None`` is skipped as Lightning skips it; a ``training_step`` that
takes ``dataloader_iter``, and a batch that cannot be cut, run through Lightning's own closure,
whole, with a warning (see ``_unsplittable.py``).

Everything after the closure stays Lightning's: ``on_before_optimizer_step``, gradient clipping
on the accumulated gradient, the GradScaler's unscale/step/update, the optimizer step, lr
schedulers. After the optimizer step, one small collective tells every rank whether that part
went through on every rank, so that an OOM in clipping or in the step on one rank raises on all
of them; clipping by norm computes the norm as ``ElasticStep.optimizer_step`` does, with a vote
before any rank steps.

Lightning's ``_AutomaticOptimization`` loop itself stays in place (its state, checkpointed, is
the plain Trainer's): :class:`ElasticOptimization` replaces two of its methods on the instance,
``_make_closure`` and ``_optimizer_step``, and puts them back at ``teardown``.
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

from elastic_batches.batch import ElasticBatch, Microbatch
from elastic_batches.engine import raise_if_failed
from elastic_batches.lightning._outputs import combine_outputs
from elastic_batches.lightning._stages import Stages
from elastic_batches.lightning._unsplittable import take_apart, user_batch
from elastic_batches.lightning._zero_grad import ZeroGradAfterFirstStep
from elastic_batches.lightning.module import count_fn_of, microbatch_hooks_of
from elastic_batches.oom import ElasticOOMError, Status, status_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ElasticClosure", "ElasticOptimization"]

_WHERE = "the optimizer step (on_before_optimizer_step, gradient clipping or optimizer.step())"
_ABSENT = object()
_SKIPPED = "`training_step` returned `None`. If this was on purpose, ignore this warning..."  # Lightning's words


class ElasticClosure(Closure):
    """Runs ``step_fn``, which does ``training_step``, ``zero_grad`` and ``backward`` of every microbatch."""

    def __init__(self, step_fn: Callable[[], ClosureResult]) -> None:
        super().__init__(step_fn=step_fn, backward_fn=None, zero_grad_fn=None)
        self.finished = False  # the microbatches ran (what fails after this may fail on one rank only)

    @torch.enable_grad()
    def closure(self, *args: Any, **kwargs: Any) -> ClosureResult:
        result = self._step_fn()
        if result.closure_loss is None:
            self.warning_cache.warn(_SKIPPED)
        self.finished = True
        return result


class ElasticOptimization:
    """Puts the elastic closure into Lightning's ``_AutomaticOptimization`` loop (two methods, on the instance).

    Args:
        trainer: The trainer.
        stages: Each stage's controller and step (the train stage's run the closure).
        loop: ``trainer.fit_loop.epoch_loop.automatic_optimization``.
    """

    def __init__(self, trainer: pl.Trainer, stages: Stages, loop: _AutomaticOptimization) -> None:
        self.trainer = trainer
        self.stages = stages
        self.loop = loop
        self._norm_voted = False  # this optimizer step reached the gradient norm's vote
        self._lightning = {name: getattr(loop, name) for name in ("_make_closure", "_optimizer_step")}
        self._previous: dict[str, Any] = {}

    def install(self) -> None:
        """Replace the loop's ``_make_closure`` and ``_optimizer_step`` (instance attributes)."""
        for name, method in (("_make_closure", self._make_closure), ("_optimizer_step", self._optimizer_step)):
            self._previous[name] = self.loop.__dict__.get(name, _ABSENT)
            self.loop.__dict__[name] = method

    def uninstall(self) -> None:
        """Give the loop its own methods back."""
        for name, previous in self._previous.items():
            if previous is _ABSENT:
                self.loop.__dict__.pop(name, None)
            else:
                self.loop.__dict__[name] = previous
        self._previous.clear()

    def _make_closure(self, kwargs: OrderedDict, optimizer: Optimizer, batch_idx: int) -> Closure:
        loop, module = self.loop, self.trainer.lightning_module
        lightnings = self._lightning["_make_closure"]
        if loop._skip_backward:
            return lightnings(kwargs, optimizer, batch_idx)
        if "batch" not in kwargs:
            self.stages.unsplit.dataloader_iter("train", f"{type(module).__name__}.training_step")
            return lightnings(kwargs, optimizer, batch_idx)
        batch, why = take_apart(kwargs["batch"])
        if batch is None:
            whole = OrderedDict(kwargs)
            whole["batch"] = user_batch(kwargs["batch"])
            if why is not None:
                self.stages.unsplit.batch("train", f"{type(module).__name__}.training_step", whole["batch"], why)
            return lightnings(whole, optimizer, batch_idx)
        zero_grad_fn = loop._make_zero_grad_fn(batch_idx, optimizer)
        return ElasticClosure(partial(self._training_step, kwargs, optimizer, batch, zero_grad_fn))

    def _optimizer_step(self, batch_idx: int, train_step_and_backward_closure: Callable[[], Any]) -> None:
        """Lightning's optimizer step, then one small collective: every rank raises if it failed on any rank.

        The microbatches agree on their own outcome (``ElasticStep.backward``). What follows them
        inside ``optimizer.step`` (``on_before_optimizer_step``, gradient clipping, the update) can
        run out of memory on one rank only, which would leave the others waiting in their next
        collective; splitting cannot help there, so every rank raises ``ElasticOOMError``.
        """
        closure = train_step_and_backward_closure
        optimizer_step = self._lightning["_optimizer_step"]
        if not isinstance(closure, ElasticClosure):
            optimizer_step(batch_idx, closure)
            return
        status, error = Status.OK, None
        self._norm_voted = False
        try:
            optimizer_step(batch_idx, closure)
        except Exception as err:
            if not closure.finished:
                raise  # from the microbatches: ElasticStep raised it on every rank already
            error = err
            # An ElasticOOMError comes from the norm's vote, which told every rank already: nothing more to report.
            status = Status.OK if isinstance(err, ElasticOOMError) else status_of(err)
        step = self.stages.step("train")  # the one the closure ran (the closure sets its backward_fn again)
        if error is not None and not self._norm_voted and self._clips_by_norm():
            step.sync.agree(status, 0.0, 1.0)  # failed before clipping: meet the other ranks in the norm's vote
        outcome = step.sync.agree(status)
        if isinstance(error, ElasticOOMError):
            raise error
        raise_if_failed(outcome, error, _WHERE)

    def _clips_by_norm(self) -> bool:
        clip_val = self.trainer.gradient_clip_val
        return bool(clip_val) and self.trainer.gradient_clip_algorithm in (None, "norm")

    def agreed_clip_grad_by_norm(
        self, original: Callable[[Optimizer, float], None]
    ) -> Callable[[Optimizer, float], None]:
        """A precision plugin's ``clip_grad_by_norm`` whose norm every rank agrees on before any rank steps.

        ``torch.nn.utils.clip_grad_norm_`` all-reduces the norm of FSDP2's sharded gradients
        inside itself: a rank that runs out of memory before that collective leaves the others
        waiting in it. Here each rank's part of the squared norm travels in the train
        ``ElasticStep``'s vote (summed over shards under FSDP2), as in
        ``ElasticStep.optimizer_step``, and an OOM on any rank raises ``ElasticOOMError`` ("out
        of memory in the gradient norm") on every rank before any of them steps. ``original``
        clips when no elastic step ran.
        """

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            step = self.stages.ran("train")
            if step is None:
                original(optimizer, clip_val)
                return
            self._norm_voted = True
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            step.clip_grad_norm_(grads, clip_val, failed_where=_WHERE)

        return clip_grad_by_norm

    def _training_step(
        self,
        kwargs: OrderedDict,
        optimizer: Optimizer,
        batch: ElasticBatch,
        zero_grad_fn: Callable[[], None] | None,
    ) -> ClosureResult:
        trainer = self.trainer
        module = trainer.lightning_module
        stages = self.stages
        values = list(kwargs.values())
        batch_position = list(kwargs).index("batch")
        skip_backward = False  # the microbatch returned None: Lightning calls no backward for it

        def backward_fn(loss: torch.Tensor) -> None:
            if not skip_backward:
                call._call_strategy_hook(trainer, "backward", loss, optimizer)

        step = stages.step("train", backward_fn=backward_fn)
        recorder = stages.recorder(module)
        recorder.start_batch()
        ran: list[Microbatch] = []  # the microbatches of the attempt
        results: list[tuple[Microbatch, dict[str, Any]]] = []  # those that returned a loss, with their extras
        skipped: list[int] = []  # those whose training_step returned None
        shapes: list[torch.Size] = []  # the shape of a one-element loss that is not a scalar
        microbatch_hooks = microbatch_hooks_of(module)
        zero_grad = None if zero_grad_fn is None else ZeroGradAfterFirstStep(list(module.parameters()), zero_grad_fn)

        def loss_fn(mb: Microbatch) -> torch.Tensor:
            nonlocal skip_backward
            if mb.index == 0:
                recorder.start_attempt()
                ran.clear()
                results.clear()
                skipped.clear()
                shapes.clear()
            ran.append(mb)
            if microbatch_hooks is not None:
                microbatch_hooks[0](mb)
            arguments = list(values)
            arguments[batch_position] = mb.unwrap()
            with recorder.capture(mb.weight, split=mb.count > 1):
                output = call._call_strategy_hook(trainer, "training_step", *arguments)
            trainer.strategy.post_training_step()
            if output is None and trainer.world_size > 1:
                raise RuntimeError(  # Lightning's words
                    "Skipping the `training_step` by returning None in distributed training is not supported."
                    " It is recommended that you rewrite your training logic to avoid having to skip the step in the"
                    " first place."
                )
            result = ClosureResult.from_training_step_output(output, trainer.accumulate_grad_batches)
            if zero_grad is not None:
                zero_grad()
            skip_backward = result.closure_loss is None
            if skip_backward:
                skipped.append(mb.index)
            else:
                results.append((mb, result.extra))
            if skipped and results:
                raise ValueError(
                    f"{type(module).__name__}.training_step returned None on microbatch(es) {skipped} and a loss on "
                    f"microbatch(es) {[r.index for r, _ in results]} of the same batch, split into {mb.count}: "
                    "Lightning skips a batch whose training_step returns None, and a split batch can only be skipped "
                    "whole. Return None for every row of a batch to skip (decide it from batch_idx, say), or a loss "
                    "(loss * 0 makes the step a no-op)"
                )
            if microbatch_hooks is not None:
                microbatch_hooks[1](mb, output)
            if skip_backward:
                return torch.zeros(())  # weighted and summed by ElasticStep; no backward is called on it
            closure_loss = result.closure_loss
            assert closure_loss is not None
            if closure_loss.dim() and closure_loss.numel() == 1:  # Lightning takes a one-element loss of any shape
                shapes.append(closure_loss.shape)
                closure_loss = closure_loss.reshape(())
            return closure_loss

        try:
            loss = step.backward(batch, loss_fn, count_fn=count_fn_of(module), unwrap=False)
        finally:
            if zero_grad is not None:
                zero_grad.finish()
        recorder.replay()
        count = ran[0].count if ran else 1
        stages.report("train", count, max((len(mb) for mb in ran), default=0))
        if skipped:
            return ClosureResult(None)
        extras = [extra for _, extra in results]
        extra = combine_outputs(extras, [mb.weight for mb, _ in results], [len(mb) for mb, _ in results])
        return ClosureResult(loss.reshape(shapes[0]) if shapes else loss, extra=extra or {})
