"""Memory that churns, measured: many OOM-and-retry cycles, memory that shrinks, memory that grows back.

Each procedure trains a small MLP inside a :class:`~elastic_batches.testing.MemoryBudget` and
returns what it measured as plain values; ``tests/test_reliability.py`` asserts bounds on them
and ``benchmarks/fault_matrix.py --leaks`` prints them (the tables of ``docs/reliability.md``).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import elastic_batches as eb
from elastic_batches.testing.memory import MemoryBudget

__all__ = ["growing_memory", "mlp", "mse", "oom_retry_cycles", "peak_at", "shrinking_memory"]

Batch = tuple[torch.Tensor, torch.Tensor]


def mlp(seed: int = 0, width: int = 256) -> nn.Module:
    """An MLP 16-``width``-1, from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 1))


def mse(model: nn.Module) -> Callable[[Batch], torch.Tensor]:
    """``loss_fn``: the mean squared error of ``model`` on an ``(x, y)`` microbatch."""

    def loss_fn(mb: Batch) -> torch.Tensor:
        x, y = mb
        return nn.functional.mse_loss(model(x), y)

    return loss_fn


def peak_at(model: nn.Module, batch: Batch, split_count: int) -> int:
    """Peak simulated bytes of a step on ``batch`` at ``split_count`` microbatches (gradients cleared after).

    Example:
        >>> import torch
        >>> from support.fault_matrix.churn import mlp, peak_at
        >>> model, batch = mlp(), (torch.randn(64, 16), torch.randn(64, 1))
        >>> peak_at(model, batch, 1) > peak_at(model, batch, 4)
        True
    """
    step = eb.ElasticStep(model, controller=eb.SplitController(split_count=split_count))
    with MemoryBudget(None) as budget:
        step.backward(batch, mse(model))
    model.zero_grad(set_to_none=True)
    return budget.peak_bytes


def _resident_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live(kind: type) -> int:
    return sum(1 for obj in gc.get_objects() if isinstance(obj, kind))


def oom_retry_cycles(cycles: int = 200, warmup: int = 10) -> dict[str, Any]:
    """``cycles`` cycles of a step that runs out of memory and is retried, then one that runs whole.

    An MLP 16-256-1 and a batch of 64 under a budget between what 1 and 2 microbatches need;
    ``grow_after=1`` makes every step after a retry try the whole batch again. Measured after
    ``warmup`` cycles, over the ``cycles``: the budget's OOMs, and what is left alive.

    Returns:
        ``ooms``, ``retries`` (the controller's, warm-up included), ``live_bytes`` (simulated,
        after the cycles), ``tensors`` and ``oom_errors`` (change in the live objects),
        ``resident_bytes`` (change in the process's resident memory), ``tried`` (sizes the
        controller holds for error messages) and ``seconds_per_cycle``.
    """
    model = mlp()
    batch = (torch.randn(64, 16), torch.randn(64, 1))
    limit = (peak_at(model, batch, 1) + peak_at(model, batch, 2)) // 2
    controller = eb.SplitController(grow_after=1)
    step = eb.ElasticStep(model, controller=controller, memory=None)  # the OOM-driven search: no prediction
    budget = MemoryBudget(None)
    loss_fn = mse(model)

    def cycle() -> None:
        for tight in (True, False):
            budget.limit_bytes = limit if tight else None
            with budget:
                step.backward(batch, loss_fn)
            model.zero_grad(set_to_none=True)

    for _ in range(warmup):  # the allocator, caches and lazy imports settle first
        cycle()
    gc.collect()
    tensors, errors, resident, ooms = (
        _live(torch.Tensor),
        _live(torch.OutOfMemoryError),
        _resident_bytes(),
        budget.oom_count,
    )
    start = time.perf_counter()
    for _ in range(cycles):
        cycle()
    seconds = time.perf_counter() - start
    gc.collect()
    return {
        "ooms": budget.oom_count - ooms,
        "retries": controller.retry_count,
        "live_bytes": budget.live_bytes,
        "tensors": _live(torch.Tensor) - tensors,
        "oom_errors": _live(torch.OutOfMemoryError) - errors,
        "resident_bytes": _resident_bytes() - resident,
        "tried": len(controller._tried),
        "seconds_per_cycle": seconds / cycles,
    }


def shrinking_memory(batches: int = 6) -> dict[str, Any]:
    """A budget lowered in 4 levels (room for 1, then 2, 3, 4 microbatches' worth less), ``batches`` batches each.

    Returns:
        ``settled`` (the split count at each level), ``ooms`` (per level) and ``gradient_error``
        (the largest relative error of a batch's gradient against the whole batch's, over all).
    """
    model = mlp(width=512)
    data = [(torch.randn(48, 16), torch.randn(48, 1)) for _ in range(batches)]
    peaks = {k: peak_at(model, data[0], k) for k in (1, 2, 3, 4)}
    limits = [peaks[1] + 1, (peaks[1] + peaks[2]) // 2, (peaks[2] + peaks[3]) // 2, (peaks[3] + peaks[4]) // 2]
    controller = eb.SplitController()
    step = eb.ElasticStep(model, controller=controller, memory=None)  # the OOM-driven search: no prediction
    budget = MemoryBudget(None)
    settled, ooms, errors = [], [], []
    for limit in limits:  # the device loses memory (fragmentation, another process)
        budget.limit_bytes = limit
        before = controller.oom_count
        for batch in data:
            reference = torch.autograd.grad(mse(model)(batch), list(model.parameters()))
            with budget:
                step.backward(batch, mse(model))
            errors.append(
                max(
                    float((p.grad - r).abs().max() / r.abs().max())
                    for p, r in zip(model.parameters(), reference, strict=True)
                    if p.grad is not None
                )
            )
            model.zero_grad(set_to_none=True)
        settled.append(controller.split_count)
        ooms.append(controller.oom_count - before)
    return {"settled": settled, "ooms": ooms, "gradient_error": max(errors), "batches": len(errors)}


def growing_memory(grow_after: int = 10) -> dict[str, Any]:
    """Settle under a tight budget, stay there 50 steps, then lift it for 60 (``grow_after`` probes).

    Returns:
        ``settled`` (the count under the tight budget), ``probe_ooms`` (failed growth probes in
        the 50 tight steps), ``freed`` (the count 60 steps after the budget is lifted) and
        ``freed_ooms`` (OOMs on the way there).
    """
    model = mlp(width=512)
    batch = (torch.randn(48, 16), torch.randn(48, 1))
    tight = (peak_at(model, batch, 3) + peak_at(model, batch, 4)) // 2
    controller = eb.SplitController(grow_after=grow_after)
    step = eb.ElasticStep(model, controller=controller, memory=None)  # the OOM-driven search: no prediction
    budget = MemoryBudget(tight)

    def steps(n: int) -> None:
        for _ in range(n):
            with budget:
                step.backward(batch, mse(model))
            model.zero_grad(set_to_none=True)

    steps(20)
    settled, ooms = controller.split_count, controller.oom_count
    steps(50)
    probe_ooms = controller.oom_count - ooms
    settled_after = controller.split_count
    budget.limit_bytes = None  # memory comes back
    before = controller.oom_count
    steps(60)
    return {
        "settled": settled,
        "settled_after": settled_after,
        "probe_ooms": probe_ooms,
        "freed": controller.split_count,
        "freed_ooms": controller.oom_count - before,
    }
