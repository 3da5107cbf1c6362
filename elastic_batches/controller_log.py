"""What a :class:`~elastic_batches.SplitController` says: its log lines, and the error at its limits."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from elastic_batches.balance import BatchLoad
from elastic_batches.oom import ElasticOOMError

__all__ = ["describe", "limit_error", "log_oom", "log_success", "logger", "pieces_text"]

logger = logging.getLogger("elastic_batches.controller")


class _Limits(Protocol):
    unit: str

    @property
    def min_microbatch_size(self) -> int: ...

    @property
    def max_split_count(self) -> int | None: ...


def describe(count: int, load: BatchLoad, unit: str) -> str:
    """``2 microbatches of at most 64 rows``."""
    unit = "rows" if unit == "rows" else "tokens"
    return f"{count} microbatch{'es' if count != 1 else ''} of at most {load.size_at(count)} {unit}"


def pieces_text(pieces: Sequence[int]) -> str:
    """``6 microbatches of 43 rows``, ``9 microbatches of 1 to 74 rows``."""
    low, high = min(pieces), max(pieces)
    rows = f"{high} row{'s' if high != 1 else ''}" if low == high else f"{low} to {high} rows"
    return f"{len(pieces)} microbatch{'es' if len(pieces) != 1 else ''} of {rows}"


def limit_error(controller: _Limits, load: BatchLoad, size: int, count: int, tried: Sequence[int]) -> ElasticOOMError:
    """The final error of an OOM at the smallest microbatch the controller's limits allow."""
    unit = "" if controller.unit == "rows" else " tokens"
    return ElasticOOMError(
        f"out of memory on a batch of {load.rows} rows even at microbatch size {size}{unit} ({count} microbatches); "
        f"microbatch sizes tried on this batch: {', '.join(map(str, tried))}. Splitting cannot help further "
        f"(min_microbatch_size={controller.min_microbatch_size}, max_split_count={controller.max_split_count}): "
        "lower the batch size or free memory"
    )


def log_success(load: BatchLoad, pieces: Sequence[int], before: int, after: int, note: str) -> None:
    """The INFO line of a batch that completed at another count than the one before."""
    what = pieces_text(pieces)
    logger.info("a batch of %d rows ran as %s: split count %d -> %d%s", load.rows, what, before, after, note)


def log_oom(load: BatchLoad, unit: str, count: int, settled: int, after: int, note: str) -> None:
    """The INFO line of an OOM at ``count`` microbatches (``settled``: the count before it), retried at ``after``."""
    probe = f" (a probe; settled at {settled})" if count != settled else ""
    low, high = describe(count, load, unit), describe(after, load, unit)
    logger.info(
        "OOM at %s on a batch of %d rows%s: split count %d -> %d, %s%s", low, load.rows, probe, count, after, high, note
    )
