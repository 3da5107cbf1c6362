"""What an attempt runs: the microbatches of ``ElasticStep.backward`` and of ``ElasticStep.evaluate``.

A :class:`BackwardWork` runs forward and backward of each microbatch of a plan (or of a measured
cut, each piece at the size the memory model predicts from the pieces before it) and leaves
the weighted gradients; an :class:`EvaluateWork` runs a function on each microbatch. Either is
handed to the :class:`~elastic_batches.engine.AttemptEngine`, which retries it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from elastic_batches.batch import ElasticBatch, Microbatch
from elastic_batches.engine import AttemptEngine, Progress, StepSettings
from elastic_batches.memory.meter import Meter
from elastic_batches.plan import Plan, Ramp
from elastic_batches.structures import constant_tensors

__all__ = ["BackwardWork", "EvaluateWork", "input_leaves"]

logger = logging.getLogger("elastic_batches.step")

LossFn = Callable[[Any], torch.Tensor]
CountFn = Callable[[Any], "torch.Tensor | int | float"]


def input_leaves(batch: ElasticBatch) -> list[torch.Tensor]:
    """Leaf tensors of the batch that require grad, each once: their ``.grad`` is set aside like the parameters'.

    The broadcast (0-d) tensors count too: every microbatch adds to their gradient.
    """
    fields = batch.fields.values()
    plain = all(type(value) is torch.Tensor or type(value) is list for value in fields)
    values = fields if plain else batch.data.values(include_nested=True, leaves_only=True)
    leaves = [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    leaves += [t for t in constant_tensors(batch.spec) if t.requires_grad and t.is_leaf]
    return list({id(t): t for t in leaves}.values()) if len(leaves) > 1 else leaves


def _graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` a backward of ``loss`` accumulates into (its autograd graph's leaves)."""
    leaves, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _weighed(mb: Microbatch, count: float, total: float) -> Microbatch:
    """``mb`` weighted by its count over the total (0 where nothing is counted: its loss would be 0/0)."""
    return mb.reweighted(count / total if total else 0.0)


class BackwardWork:
    """Forward and backward of every microbatch of an attempt, leaving the weighted gradients in ``.grad``.

    Args:
        step: The step (its model, sync, device and backward).
        engine: The step's engine (what it checked of the first loss).
        batch: The batch.
        loss_fn, count_fn, unwrap: As :meth:`ElasticStep.backward` takes them.
        params: The parameters that train (their gradients are reduced at the vote).
        leaves: The batch tensors that collect a gradient of their own.
    """

    where = "backward"

    def __init__(
        self,
        step: StepSettings,
        engine: AttemptEngine,
        batch: ElasticBatch,
        loss_fn: LossFn,
        count_fn: CountFn | None,
        unwrap: bool,
        params: Sequence[torch.Tensor],
        leaves: Sequence[torch.Tensor],
    ) -> None:
        self.step, self.engine, self.batch = step, engine, batch
        self.loss_fn, self.count_fn, self.unwrap = loss_fn, count_fn, unwrap
        self.params = params
        self.leaves = leaves
        self.tensors = [*params, *leaves]

    def run(self, plan: Plan, meter: Meter | None, progress: Progress) -> torch.Tensor:
        """The attempt's microbatches; the batch's mean loss (detached), the gradients ready for the vote."""
        result = self._microbatches(plan, meter, progress)
        if progress.rescale != 1.0:  # the weights of a measured attempt divided by another total than the real
            torch._foreach_mul_([t.grad for t in self.tensors if t.grad is not None], progress.rescale)
            result = result * progress.rescale
        self.step.sync.prepare(self.params)  # what the gradient reduction allocates, allocated before the vote
        return result

    def discard(self) -> None:
        for t in self.tensors:
            t.grad = None
        self.step.sync.discard()

    def _microbatches(self, plan: Plan, meter: Meter | None, progress: Progress) -> torch.Tensor:
        sync = self.step.sync
        losses: list[torch.Tensor] = []  # weighted and detached; summed once, not once per microbatch
        with sync.microbatches():
            microbatches: Iterable[Microbatch]
            if meter is not None and plan.measuring:
                microbatches = self._measured(plan, meter, progress)
            else:
                microbatches = self._planned(plan, progress)
                sync.weigh(progress.total)
                if meter is not None:
                    microbatches = self._windowed(microbatches, plan, meter)
            measuring = meter is not None and plan.measuring  # cut as it goes: which one is last is unknown
            for mb in microbatches:
                progress.started += 1
                if mb.weight == 0.0:
                    if meter is not None:
                        meter.skip()
                    continue  # nothing to count in it: its loss would be 0/0
                if not measuring and mb.index == mb.count - 1:
                    sync.last_microbatch()  # DDP: its backward starts the gradient buckets' all-reduce
                losses.append(self._one(mb, meter))
                if meter is not None:
                    meter.end()
            if not losses:
                return torch.full((), math.nan)
            return torch.stack(losses).sum() if len(losses) > 1 else losses[0]

    def _planned(self, plan: Plan, progress: Progress) -> Iterable[Microbatch]:
        """The plan's cut, weighted by rows or, with ``count_fn``, by each microbatch's count over the batch's."""
        microbatches = self.batch.microbatches(sizes=plan.sizes)
        if self.count_fn is None:
            progress.total = float(len(self.batch))
            return microbatches
        cut = list(microbatches)
        counts = [float(self.count_fn(mb.unwrap())) for mb in cut]
        progress.total = total = math.fsum(counts)
        return [_weighed(mb, c, total) for mb, c in zip(cut, counts, strict=True)]

    def _windowed(self, microbatches: Iterable[Microbatch], plan: Plan, meter: Meter) -> Iterator[Microbatch]:
        """``microbatches`` (the planned cut), each taken inside its memory window."""
        pieces = iter(microbatches)
        start = 0
        for rows in plan.sizes:
            meter.begin(plan.load.cost(start, start + rows))
            yield next(pieces)
            start += rows

    def _measured(self, plan: Plan, meter: Meter, progress: Progress) -> Iterator[Microbatch]:
        """The microbatches of an attempt that measures: ``plan.lead`` rows first, then each as the :class:`Ramp` cuts.

        Each microbatch is cut inside its window (``meter.begin``); the caller closes it. With
        ``count_fn``, the weights divide by its count over the whole batch, counted first; should
        the pieces' counts add up to another total, ``progress.rescale`` says by how much the
        gradients must be scaled (where the ranks' microbatches are paired, FSDP2 per module,
        none: their gradients are reduced as they go, each weighed by the same total; the vote's
        totals correct it). The ranks agree on each microbatch's count
        (:meth:`GradientSync.agree_pieces`). When the attempt ends, every microbatch gets the
        final ``count``.
        """
        batch, sync, count_fn = self.batch, self.step.sync, self.count_fn
        predictor = self.step.controller.predictor
        assert predictor is not None  # a measuring plan comes from a controller that predicts
        ramp = Ramp(plan, predictor)
        rows, load = len(batch), plan.load
        estimate = (float(count_fn(batch.microbatch(0, rows).unwrap())) or 1.0) if count_fn is not None else 1.0
        sync.weigh(estimate if count_fn is not None else float(rows))
        made: list[Microbatch] = []
        counts: list[float] = []
        start, planned = 0, 3
        for index in itertools.count():
            if start >= rows:
                break
            room = ramp.room(start, index)
            if index == 0:
                take = plan.lead
            else:
                count = ramp.count(start, index, meter.reading_now(), len(made[-1]), progress.size)
                count = sync.agree_pieces(count, room)
                take, planned = ramp.first_of(start, count), index + count
            stop = start + ramp.rows(start, take, room)
            size = load.cost(start, stop)
            progress.size = max(progress.size, size)
            meter.begin(size)
            mb = batch.microbatch(
                start, stop, index=index, count=index + 1 if stop == rows else max(planned, index + 2)
            )
            if count_fn is not None:
                counts.append(float(count_fn(mb.unwrap())))
                mb = _weighed(mb, counts[-1], estimate)
            made.append(mb)
            yield mb
            start = stop
        for mb in made:
            mb.count = len(made)
        progress.sizes = tuple(len(mb) for mb in made)
        progress.total = math.fsum(counts) if count_fn is not None else float(rows)
        if count_fn is not None and progress.total and progress.total != estimate and not sync.pairs_microbatches:
            progress.rescale = estimate / progress.total  # count_fn did not add up over the pieces: the real total
        logger.debug("measured attempt: %d microbatches of %s rows", len(made), list(progress.sizes))

    def _one(self, mb: Microbatch, meter: Meter | None) -> torch.Tensor:
        """Forward and backward of one microbatch; its weighted loss, detached."""
        step = self.step
        if step.device is not None:
            mb = mb.to(step.device, non_blocking=True)
        loss = self.loss_fn(mb.unwrap() if self.unwrap else mb)
        if meter is not None:
            meter.forward_done()
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__qualname__
            raise ValueError(f"loss_fn must return a scalar loss tensor (a mean over the microbatch), got {shape}")
        if not self.engine.graph_checked:
            self._check_graph(loss)
        weighted = loss * mb.weight
        if step.backward_fn is not None:
            step.backward_fn(weighted)
        elif step.grad_scaler is not None:
            step.grad_scaler.scale(weighted).backward()
        else:
            weighted.backward()
        return weighted.detach()

    def _check_graph(self, loss: torch.Tensor) -> None:
        """Refuse a loss that trains tensors outside ``model`` and the batch: their gradients would survive a retry."""
        if loss.grad_fn is None:
            return
        known = {id(t) for t in self.leaves} | self.step.sync.graph_leaf_ids()
        foreign = [t for t in _graph_leaves(loss) if id(t) not in known]
        if foreign:
            shapes = ", ".join(str(tuple(t.shape)) for t in foreign[:8])
            raise ValueError(
                f"ElasticStep: loss_fn trains {len(foreign)} tensor(s) that are neither parameters of the model given "
                f"to ElasticStep ({type(self.step.model).__name__}) nor tensors of the batch (shapes {shapes}): their "
                "gradients could not be set aside and restored around an OOM retry. Give ElasticStep the module that "
                "holds every parameter loss_fn trains (for instance the whole model, not a part of it)"
            )
        self.engine.graph_checked = True


class EvaluateWork:
    """``fn`` on each microbatch of an attempt, without backward; the outputs (or ``combine``'s result).

    Args:
        step: The step (its sync and device).
        batch: The batch.
        fn, unwrap, combine: As :meth:`ElasticStep.evaluate` takes them.
    """

    where = "evaluate"
    params = None

    def __init__(
        self,
        step: StepSettings,
        batch: ElasticBatch,
        fn: Callable[[Any], Any],
        unwrap: bool,
        combine: Callable[[list[Any], list[Microbatch]], Any] | None,
    ) -> None:
        self.step, self.batch = step, batch
        self.fn, self.unwrap, self.combine = fn, unwrap, combine

    def run(self, plan: Plan, meter: Meter | None, progress: Progress) -> Any:
        progress.total = float(len(self.batch))
        outputs, ran = [], []
        with self.step.sync.microbatches():
            for mb in self.batch.microbatches(sizes=plan.sizes):
                progress.started += 1
                ran.append(mb)
                if self.step.device is not None:
                    mb = mb.to(self.step.device, non_blocking=True)
                outputs.append(self.fn(mb.unwrap() if self.unwrap else mb))
        return outputs if self.combine is None else self.combine(outputs, ran)

    def discard(self) -> None:
        """Nothing to drop: evaluation leaves no gradients."""
