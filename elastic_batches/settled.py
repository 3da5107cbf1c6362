"""``SettledSplit``: what a :class:`~elastic_batches.SplitController` has settled on, as a value.

The loader tags each batch with one (:meth:`ElasticBatch.tag`); the batch then keeps the count of
the moment it was tagged without a reference back to the controller (``source`` is the
controller's identity token, which the step compares with its own controller's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from elastic_batches.balance import BatchLoad, rows_within

__all__ = ["SettledSplit"]


class _Loaded(Protocol):
    """A batch as a settled split reads it: its rows, and its load in a unit."""

    def __len__(self) -> int: ...

    def load(self, unit: str = "rows") -> BatchLoad: ...


@dataclasses.dataclass(frozen=True, slots=True)
class SettledSplit:
    """What a :class:`SplitController` has settled on at one moment: the count it gives any batch, without probing.

    A value: the controller makes a new one whenever it learns, so a batch tagged with one
    (:meth:`ElasticBatch.tag`) keeps the count of the moment it was tagged, worked out only when
    it is first read.

    Example:
        >>> from elastic_batches import SplitController
        >>> controller = SplitController()
        >>> controller.record_oom(size=64, load=64)
        >>> settled = controller.settled
        >>> settled.capacity, settled.count_for(64), settled.count_for(100)
        (32, 2, 4)
    """

    start_split_count: int
    capacity: int | None  # the largest microbatch a settled count keeps to; None: no OOM known, no limit
    min_microbatch_size: int
    max_split_count: int | None
    unit: str
    fits: int = 0  # the largest microbatch that fitted (0: none): without an OOM known, never more pieces than it needs
    source: object = dataclasses.field(default=None, compare=False, repr=False)  # the settling controller's token

    def count_for(self, load: int | BatchLoad) -> int:
        """The count for a batch of ``load`` rows (``unit="tokens"``: its ``BatchLoad``)."""
        if type(load) is int:  # the rows unit, without a BatchLoad to build
            rows = load
            return self.clamp(rows, self._count(lambda capacity: rows_within(rows, capacity)))
        assert isinstance(load, BatchLoad)
        return self.clamp(load.rows, self._count(load.count_within))

    def count_of(self, batch: _Loaded) -> int:
        """The count for ``batch``, read in this controller's unit (what a tag works out when first read)."""
        return self.count_for(len(batch) if self.unit == "rows" else batch.load(self.unit))

    def unclamped(self, load: BatchLoad) -> int:
        """The count that keeps to the capacity, before the limits."""
        return self._count(load.count_within)

    def _count(self, within: Callable[[int], int]) -> int:
        """The settled rule, given ``within(size)``: the fewest pieces of at most ``size``.

        Without an OOM known, nothing caps a microbatch: the starting count, or fewer pieces
        when a larger microbatch already fitted.
        """
        if self.capacity is not None:
            return within(self.capacity)
        if self.fits:
            return min(self.start_split_count, within(self.fits))
        return self.start_split_count

    def clamp(self, rows: int, count: int) -> int:
        """``count`` within the limits: at most ``rows``, ``max_split_count``, ``rows // min_microbatch_size``."""
        count = min(count, rows, max(1, rows // self.min_microbatch_size))
        if self.max_split_count is not None:
            count = min(count, self.max_split_count)
        return max(count, 1)
