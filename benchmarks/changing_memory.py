"""OOMs per 1000 steps when device memory changes during training.

The largest microbatch that fits moves during the run: it shrinks in steps (fragmentation,
another process taking memory), then grows back. Each step asks the controller for a count,
"runs" it against that capacity (OOM when the microbatch is larger), and retries until it fits —
as ``ElasticStep`` does. Printed per ``grow_after`` setting: OOMs per 1000 steps, how much of the
capacity the run used (mean of microbatch size / largest that fits), and batches lost (always 0:
every OOM is retried). Capacity use is measured against the largest microbatch a balanced split
of the batch can have within the capacity (the count is what costs time).

A second table runs the same schedule on a real model under ``testing.MemoryBudget``: each
step's limit lies midway between the peak of a step at the fewest balanced microbatches of at most
the scheduled size and the peak at one microbatch fewer, so that the scheduled size is what fits.
Side by side: the predicting controller (``SplitController()``, the budget as the step's memory
probe, no ``grow_after``) and today's search at each ``grow_after`` setting (``margin=None``, no
probe). Printed: OOMs per 1000 steps, capacity used as above, and the share of steps at the
fewest microbatches.

    python benchmarks/changing_memory.py
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import torch
from _harness import QUICK, emit, table
from torch import nn

import elastic_batches as eb
from elastic_batches import SplitController
from elastic_batches.testing import MemoryBudget

ROWS = 256
STEPS = 1000


def capacity_schedule(seed: int = 0) -> list[int]:
    """Largest microbatch that fits, per step: 200 steps each at 120, 80, 40, then back to 80 and 120, with noise."""
    rng = random.Random(seed)
    levels = [120, 80, 40, 80, 120]
    return [max(1, level + rng.randint(-3, 3)) for level in levels for _ in range(STEPS // len(levels))]


def run(grow_after: int | None, capacities: list[int]) -> dict[str, float]:
    controller = SplitController(grow_after=grow_after)
    used = []
    for capacity in capacities:
        while True:
            count = controller.plan(ROWS)
            size = math.ceil(ROWS / count)
            if size <= capacity:
                controller.record_success(size, ROWS)
                best = math.ceil(ROWS / math.ceil(ROWS / min(capacity, ROWS)))  # largest balanced microbatch
                used.append(size / best)
                break
            controller.record_oom(size, ROWS)
    return {
        "grow_after": grow_after if grow_after is not None else "off",
        "ooms_per_1000_steps": controller.oom_count * 1000 / len(capacities),
        "mean_use_of_capacity": sum(used) / len(used),
        "use_in_last_200_steps": sum(used[-200:]) / 200,
        "batches_lost": 0,
    }


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 1))  # activations outweigh the gradients


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 8, generator=generator), torch.randn(ROWS, 1, generator=generator)


def _loss(model: nn.Module) -> Any:
    return lambda mb: (model(mb[0]) - mb[1]).pow(2).mean()


def _peak(count: int) -> int:
    """Peak bytes of a step of the batch at ``count`` balanced microbatches, nothing limited."""
    model = _model()
    step = eb.ElasticStep(model, controller=SplitController(count, margin=None), memory=None)
    budget = MemoryBudget()
    with budget:
        step.backward(_batch(), _loss(model))
    return budget.peak_bytes


def limits(capacities: list[int]) -> list[int]:
    """Each step's limit in bytes: midway between the peaks at the fewest counts that fit and one fewer."""
    peaks: dict[int, int] = {}

    def peak(count: int) -> int:
        if count not in peaks:
            peaks[count] = _peak(count)
        return peaks[count]

    out = []
    for capacity in capacities:
        count = math.ceil(ROWS / min(capacity, ROWS))
        above = peak(count - 1) if count > 1 else peak(1) + peak(1) // 10
        out.append((peak(count) + above) // 2)
    return out


def run_model(grow_after: int | None, predicted: bool, capacities: list[int], budgets: list[int]) -> dict[str, Any]:
    """The schedule on the real model: OOMs per 1000 steps, capacity used, steps at the fewest microbatches."""
    model = _model()
    controller = SplitController(grow_after=grow_after, margin=0.05 if predicted else None)
    budget = MemoryBudget()
    step = eb.ElasticStep(model, controller=controller, memory=budget if predicted else None)
    batch, loss = _batch(), _loss(model)
    used, fewest = [], []
    for capacity, limit in zip(capacities, budgets, strict=True):
        budget.limit_bytes = limit
        sizes: list[int] = []

        def recorded(mb: eb.Microbatch, sizes: list[int] = sizes) -> torch.Tensor:
            if mb.index == 0:
                sizes.clear()
            sizes.append(len(mb))
            return loss(mb.unwrap())

        with budget:
            step.backward(batch, recorded, unwrap=False)
        model.zero_grad(set_to_none=True)
        count = math.ceil(ROWS / min(capacity, ROWS))
        used.append(max(sizes) / math.ceil(ROWS / count))
        fewest.append(len(sizes) == count)
    return {
        "controller": "predicted" if predicted else "search",
        "grow_after": grow_after if grow_after is not None else "off",
        "ooms_per_1000_steps": controller.oom_count * 1000 / len(capacities),
        "mean_use_of_capacity": sum(used) / len(used),
        "use_in_last_200_steps": sum(used[-200:]) / len(used[-200:]),
        "steps_at_fewest": sum(fewest) / len(fewest),
    }


def main() -> None:
    capacities = capacity_schedule()
    rows = [run(grow_after, capacities) for grow_after in (None, 200, 50, 10)]
    print(f"{'grow_after':>10} | {'OOMs/1000 steps':>15} | {'mean use':>8} | {'use, last 200':>13} | {'lost':>4}")
    for row in rows:
        print(
            f"{row['grow_after']!s:>10} | {row['ooms_per_1000_steps']:>15.1f} | {row['mean_use_of_capacity']:>8.2f} | "
            f"{row['use_in_last_200_steps']:>13.2f} | {row['batches_lost']:>4}"
        )
    for row in rows:
        print(json.dumps({"benchmark": "changing_memory", **row}))
    schedule = capacities[::5] if QUICK else capacities
    budgets = limits(schedule)
    model_rows = [run_model(None, True, schedule, budgets)]
    model_rows += [run_model(grow_after, False, schedule, budgets) for grow_after in (None, 200, 50, 10)]
    print(f"\nthe same schedule on a real model under MemoryBudget ({len(schedule)} steps of {ROWS} rows)")
    print(
        table(
            ["controller", "grow_after", "OOMs/1000 steps", "mean use", "use, last 200", "steps at fewest"],
            [
                [
                    r["controller"],
                    r["grow_after"],
                    r["ooms_per_1000_steps"],
                    r["mean_use_of_capacity"],
                    r["use_in_last_200_steps"],
                    r["steps_at_fewest"],
                ]
                for r in model_rows
            ],
        )
    )
    for row in model_rows:
        emit({"benchmark": "changing_memory_model", **row})


if __name__ == "__main__":
    main()
