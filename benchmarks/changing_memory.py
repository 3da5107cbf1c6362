"""OOMs per 1000 steps when device memory changes during training.

The largest microbatch that fits moves during the run: it shrinks in steps (fragmentation,
another process taking memory), then grows back. Each step asks the controller for a count,
"runs" it against that capacity (OOM when the microbatch is larger), and retries until it fits —
as ``ElasticStep`` does. Printed per ``grow_after`` setting: OOMs per 1000 steps, how much of the
capacity the run used (mean of microbatch size / largest that fits), and batches lost (always 0:
every OOM is retried). Capacity use is measured against the largest microbatch a balanced split
of the batch can have within the capacity (the count is what costs time).

    python benchmarks/changing_memory.py
"""

from __future__ import annotations

import json
import math
import random

from elastic_batches import SplitController

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


if __name__ == "__main__":
    main()
