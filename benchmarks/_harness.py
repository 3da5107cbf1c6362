"""Shared helpers of the benchmark scripts: interleaved timing, medians, tables and JSON lines.

Not a benchmark itself (the leading underscore keeps ``python -m elastic_batches bench`` from
running it). Timings are taken side by side in one process, alternating which variant runs
first, and reported as medians, so that a machine that is busier during one part of the run
moves both variants alike.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

QUICK = os.environ.get("ELASTIC_BATCHES_BENCH_QUICK", "") not in ("", "0")


def configure_threads() -> str:
    """Apply ``ELASTIC_BATCHES_BENCH_THREADS`` (torch intra-op threads) if set; describe the setting.

    On a machine shared with other jobs, ``ELASTIC_BATCHES_BENCH_THREADS=1`` avoids the stalls of
    oversubscribed OpenMP threads, which hit both variants but at random, and drown the ratio.
    """
    import torch

    threads = os.environ.get("ELASTIC_BATCHES_BENCH_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    return f"{torch.get_num_threads()} torch thread(s)"


def interleaved(variants: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each variant, ``repeats`` times, alternating the order every round."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over rounds of the per-round ratio (each round ran both variants back to back)."""
    return median([a / b for a, b in zip(numerator, denominator, strict=True)])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def emit(record: dict[str, Any]) -> None:
    """One JSON line, for machines (``grep '^{' | jq``).

    A record that states a target carries ``"target"`` and ``"met"`` (a bool):
    ``python -m elastic_batches bench --check`` exits 1 when any ``"met"`` is false.
    """
    print(json.dumps(record, sort_keys=True), flush=True)
