"""Microbatch policies on a real model under ``testing.MemoryBudget``, for the benchmarks that compare them.

Not a benchmark itself (the leading underscore keeps ``python -m elastic_batches bench`` from
running it). Every policy trains the same batches through the same budget and reports, per step,
the OOMs it spent and the microbatches of the attempt that fitted:

* ``predicted``: ``ElasticStep`` with ``SplitController()`` and the budget as its memory probe
  (``memory=budget``): the memory model plans, the first batch is measured;
* ``search``: ``ElasticStep`` with ``SplitController(margin=None)``: the OOM-driven search alone
  (halving, then refinement between what fitted and what failed);
* ``halving``: a microbatch size halved on each OOM and never grown, chunks of that many rows and
  a remainder, as Composer's ``device_train_microbatch_size="auto"``;
* ``x0.9``: the size times 0.9 on each OOM (``int(size * 0.9)``), as Accelerate's
  ``find_executable_batch_size``, here used for the microbatch size.

The two size policies start at the whole batch, as their originals do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.testing import MemoryBudget

LossFn = Callable[[Any], torch.Tensor]
CountFn = Callable[[Any], Any] | None

POLICIES = ("predicted", "search", "halving", "x0.9")


class Policy:
    """One policy: ``step(batch)`` trains a batch and returns ``(OOMs spent, microbatches that fitted)``."""

    def step(self, batch: eb.ElasticBatch) -> tuple[int, int]:
        raise NotImplementedError


class StepPolicy(Policy):
    """``ElasticStep`` with a controller, predicting (the budget as its probe) or not."""

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, budget: MemoryBudget, *, predicted: bool, unit: str = "rows"
    ) -> None:
        self.model, self.loss_fn, self.budget = model, loss_fn, budget
        self.controller = eb.SplitController(unit=unit, margin=0.05 if predicted else None)
        self.step_ = eb.ElasticStep(model, controller=self.controller, memory=budget if predicted else None)
        self.count_fn: CountFn = None

    def step(self, batch: eb.ElasticBatch) -> tuple[int, int]:
        seen = [0]

        def counted(mb: eb.Microbatch) -> torch.Tensor:
            seen[0] = 1 if mb.index == 0 else seen[0] + 1
            return self.loss_fn(mb.unwrap())

        before = self.controller.oom_count
        with self.budget:
            self.step_.backward(batch, counted, count_fn=self.count_fn, unwrap=False)
        self.model.zero_grad(set_to_none=True)
        return self.controller.oom_count - before, seen[0]


class SizePolicy(Policy):
    """A microbatch size in rows, shrunk by ``shrink`` on each OOM, never grown; chunks of it and a remainder."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, budget: MemoryBudget, shrink: Callable[[int], int]) -> None:
        self.model, self.loss_fn, self.budget, self.shrink = model, loss_fn, budget, shrink
        self.size: int | None = None
        self.count_fn: CountFn = None

    def _attempt(self, batch: eb.ElasticBatch, size: int) -> int:
        rows = len(batch)
        pieces = [batch.microbatch(start, min(rows, start + size)) for start in range(0, rows, size)]
        if self.count_fn is None:
            weights = [len(mb) / rows for mb in pieces]
        else:
            counts = [float(self.count_fn(mb.unwrap())) for mb in pieces]
            weights = [c / math.fsum(counts) for c in counts]
        for mb, weight in zip(pieces, weights, strict=True):
            (self.loss_fn(mb.unwrap()) * weight).backward()
        return len(pieces)

    def step(self, batch: eb.ElasticBatch) -> tuple[int, int]:
        ooms = 0
        while True:
            size = len(batch) if self.size is None else min(self.size, len(batch))
            try:
                with self.budget:
                    count = self._attempt(batch, size)
            except torch.OutOfMemoryError:
                ooms += 1
                self.model.zero_grad(set_to_none=True)
                smaller = self.shrink(size)
                if smaller < 1:
                    raise
                self.size = smaller
                continue
            self.model.zero_grad(set_to_none=True)
            return ooms, count


def halving(size: int) -> int:
    return max(int(size / 2), 1) if size > 1 else 0  # Composer: max(int(size / 2), 1), stops at 1


def decay(size: int) -> int:
    return int(size * 0.9)  # Accelerate: int(batch_size * 0.9), stops at 0


def make(name: str, model: nn.Module, loss_fn: LossFn, budget: MemoryBudget, unit: str = "rows") -> Policy:
    if name == "predicted":
        return StepPolicy(model, loss_fn, budget, predicted=True, unit=unit)
    if name == "search":
        return StepPolicy(model, loss_fn, budget, predicted=False, unit=unit)
    return SizePolicy(model, loss_fn, budget, halving if name == "halving" else decay)


def peak_at(
    model: nn.Module, loss_fn: LossFn, batch: eb.ElasticBatch, count: int, unit: str = "rows", allocator: str = "exact"
) -> int:
    """Peak bytes of one step of ``batch`` at ``count`` balanced microbatches (in the unit), nothing limited.

    Under a caching ``allocator``, the peak of what it reserved (what a limit bounds there).
    """
    budget = MemoryBudget(allocator=allocator)
    step = eb.ElasticStep(model, controller=eb.SplitController(count, unit=unit, margin=None), memory=None)
    with budget:
        step.backward(batch, loss_fn)
    model.zero_grad(set_to_none=True)
    return budget.peak_reserved_bytes


def fewest(peak: Callable[[int], int], rows: int, limit: int) -> int:
    """The smallest count whose balanced split fits in ``limit``: 1 if the whole batch does, else a bisection over
    counts from 2 (a split needs room for the gradient being accumulated, which the whole batch does not)."""
    if peak(1) <= limit:
        return 1
    low, high = 2, rows
    if peak(high) > limit:
        return rows + 1  # nothing fits
    while low < high:
        middle = (low + high) // 2
        if peak(middle) <= limit:
            high = middle
        else:
            low = middle + 1
    return low
